"""The services' HTTP layer: a request's headers have a deadline (uvicorn alone has none)."""
import asyncio
import re
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from procs import free_port  # tests/ is on sys.path (conftest)
from toolrl import net


def serve_in_thread(monkeypatch, deadline_s=0.5, parser="auto"):
    monkeypatch.setattr(net, "HEADER_TIMEOUT_S", deadline_s)
    app = FastAPI()
    app.get("/")(lambda: {"ok": True})

    @app.get("/slow")
    async def slow():  # answers after the header deadline: only the headers are timed
        await asyncio.sleep(deadline_s * 1.6)
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=net.http_protocol(parser)))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, port


def closed_within(sock, seconds) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1 << 16) == b""
    except TimeoutError:
        return False


def read_response(sock, timeout_s=5.0) -> bytes:
    """One whole response: headers and body may arrive in separate segments."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            re.search(rb"content-length: (\d+)", data, re.I).group(1)):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data


def test_the_c_parser_is_used_where_installed():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    assert issubclass(net.http_protocol(), HttpToolsProtocol)
    with pytest.raises(ValueError, match="unknown HTTP parser"):
        net.http_protocol("fast")


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_half_sent_headers_are_cut_off_and_whole_requests_are_served(monkeypatch, parser):
    server, port = serve_in_thread(monkeypatch, parser=parser)
    try:
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        t0 = time.time()
        assert closed_within(stalled, 5) and time.time() - t0 < 2
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b'{"ok":true}' in read_response(kept)
        kept.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b'{"ok":true}' in read_response(kept)
        kept.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" * 2)  # pipelined: both answered
        got, t0 = b"", time.time()
        while got.count(b'{"ok":true}') < 2 and time.time() - t0 < 5:
            chunk = kept.recv(1 << 16)
            if not chunk:
                break
            got += chunk
        assert got.count(b'{"ok":true}') == 2, got
        time.sleep(0.2)
        kept.sendall(b"GET / HT")  # the next request on the kept-alive connection stalls
        t0 = time.time()
        assert closed_within(kept, 5) and time.time() - t0 < 2
    finally:
        server.should_exit = True


def test_bodies_over_the_cap_are_refused_declared_or_chunked(monkeypatch):
    import httpx
    from fastapi import Request
    from pydantic import BaseModel

    class Body(BaseModel):
        data: list[int]

    app = FastAPI()

    @app.post("/json")
    async def json_route(b: Body):
        return {"n": len(b.data)}

    @app.post("/stream")
    async def stream_route(request: Request):
        return {"n": len(await request.body())}
    net.cap_request_bodies(app, 1000, exempt=("/stream",))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpx.post(f"{url}/json", json={"data": [1, 2, 3]}).json() == {"n": 3}
        big = {"data": list(range(1000))}
        r = httpx.post(f"{url}/json", json=big)
        assert r.status_code == 413 and "over the limit of 1000" in r.text
        chunks = (b"1," * 20 for _ in range(200))  # no Content-Length: counted as it comes
        r = httpx.post(f"{url}/json", content=iter(chunks), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        assert httpx.post(f"{url}/stream", content=b"x" * 5000).json() == {"n": 5000}  # exempt
    finally:
        server.should_exit = True


def test_a_body_is_read_only_from_a_caller_with_the_token_and_only_within_its_deadline():
    import httpx
    from fastapi import Depends
    from pydantic import BaseModel

    class Body(BaseModel):
        data: list[int]

    app = FastAPI()
    auth = Depends(net.bearer_auth("s3cret"))
    got = []

    @app.post("/json", dependencies=[auth])
    async def json_route(b: Body):
        got.append(len(b.data))
        return {"n": len(b.data)}

    @app.post("/stream_more", dependencies=[auth])  # shares a prefix with the exempt path, not the path
    async def prefixed(b: Body):
        return {"n": len(b.data)}
    app.get("/health")(lambda: {"ok": True})
    net.cap_request_bodies(app, 1000, exempt=("/stream",), token="s3cret", body_timeout_s=0.5)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    url, ok = f"http://127.0.0.1:{port}", {"Authorization": "Bearer s3cret"}
    try:
        assert httpx.post(f"{url}/json", json={"data": [1, 2]}, headers=ok).json() == {"n": 2}
        assert httpx.get(f"{url}/health").json() == {"ok": True}  # no body: no token needed here
        # without the token, a declared body is refused before a byte of it is sent or read
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /json HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 999\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 401")
        r = httpx.post(f"{url}/json", content=b"{not json", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and got == [2]  # not 422: never parsed
        assert httpx.post(f"{url}/stream_more", json={"data": list(range(1000))}, headers=ok).status_code == 413
        # a body that stops arriving is cut off at its deadline
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /json HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"data\": [1,")
        t0 = time.time()
        answer = read_response(s)
        assert answer.startswith(b"HTTP/1.1 408") and time.time() - t0 < 3, answer
        assert got == [2]
    finally:
        server.should_exit = True


@pytest.mark.parametrize("header,ok", [
    ("Bearer s3cret", True), ("bearer s3cret", True), ("BEARER  s3cret ", True), (b"Bearer s3cret", True),
    ("Bearer s3cre", False), ("Bearer s3cretX", False), ("Basic s3cret", False), ("s3cret", False),
    ("Bearer", False), ("", False), (None, False), ("Bearer s3cr\xe9t", False)])
def test_the_one_bearer_check(header, ok):
    """One parse of the header for the dependency, the body cap and the executor's hot routes."""
    assert net.bearer_matches(header, "s3cret") is ok
    assert net.bearer_matches(header, None) is True  # no token set: no auth


def test_an_empty_token_is_refused_by_the_config():
    """"" would lock every caller out of one service and let every caller into another."""
    from toolrl.config import ConfigError, load_config
    for section in ("executor", "ref_server", "rollout"):
        with pytest.raises(ConfigError, match=f"{section}.token"):
            load_config("configs/cpu_tiny.yaml", [f"{section}.token="])


def test_a_service_open_beyond_this_machine_without_a_token_is_warned_about(caplog):
    """Every service warns alike; the gen worker (its own uvicorn server) warned never, though its
    port takes weight pushes and fan-out relays to any URL (found in review)."""
    from toolrl.net import warn_if_open

    with caplog.at_level("WARNING"):
        warn_if_open("0.0.0.0", None, "rollout")
        warn_if_open("0.0.0.0", "a-token", "rollout")
        warn_if_open("127.0.0.1", None, "executor")
    assert [r.getMessage() for r in caplog.records] == [
        "binding 0.0.0.0 without a token: anyone who reaches the port can use it; set rollout.token "
        "(launch.sh makes one per run)"]
    import inspect

    from toolrl.worker import service
    assert "warn_if_open(host, cfg.rollout.token" in inspect.getsource(service.run_service)
