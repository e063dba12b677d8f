"""The executor's HTTP contract: auth, input errors, size caps, the bounded queue, restarts, and the
clients' retry behaviour (against the real service and against scripted transports)."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from toolrl.executor.api import ExecResult
from toolrl.executor.client import (AsyncExecutorClient, ExecutorClient, ExecutorError, ExecutorRequestError,
                                   ExecutorUnavailable)
from toolrl.executor.local import LocalExecutor
from toolrl.net import RetryPolicy, free_port

pytestmark = pytest.mark.timeout(120)
TOKEN = "s3cret-token"
MAX_QUEUE = 4


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    log = tmp_path_factory.mktemp("executor") / "executor.log"
    with LocalExecutor(token=TOKEN, log_path=log,
                       sets=["executor.workers=1", f"executor.max_queue={MAX_QUEUE}",
                             "executor.max_request_bytes=8192", "executor.max_timeout_s=10"]) as ex:
        yield ex


@pytest.fixture
def http(ex):
    with httpx.Client(base_url=ex.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as h:
        yield h


def test_token_required(ex):
    assert httpx.post(f"{ex.url}/execute", json={"code": "print(1)"}).status_code == 401
    assert httpx.get(f"{ex.url}/health").status_code == 401
    for path in ("/docs", "/redoc", "/openapi.json"):  # FastAPI's own pages skip route dependencies
        assert httpx.get(f"{ex.url}{path}").status_code in (401, 404), path
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(f"{ex.url}/execute", json={"code": "print(1)"}, headers=wrong).status_code == 401
    with ExecutorClient(ex.url, token=TOKEN) as c:
        assert c.execute("print(1)").stdout == "1\n"
    with ExecutorClient(ex.url) as c, pytest.raises(ExecutorRequestError) as err:
        c.execute("print(1)")
    assert err.value.status_code == 401


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"", 400, "not valid JSON"),
    (b"[]", 422, "body"),
    (b'{"cod": "print(1)"}', 422, "code: Field required"),
    (b'{"code": "print(1)", "timeout": 5}', 422, "timeout: Extra inputs are not permitted"),
    (b'{"code": 5}', 422, "code: Input should be a valid string"),
    (b'{"code": "1", "timeout_s": -1}', 422, "timeout_s"),
    (b'{"code": "1", "timeout_s": 100}', 422, "over this server's limit of 10"),
    (b'{"code": "1", "memory_mb": 999999}', 422, "memory_mb=999999 is over"),
])
def test_bad_requests_get_clear_errors(http, body, status, needle):
    r = http.post("/execute", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"], r.json()


def test_bad_batch_item_names_its_index(http):
    r = http.post("/execute_batch", json={"items": [{"code": "1"}, {"code": "1", "timeout_s": 99}]})
    assert r.status_code == 422 and "items[1].timeout_s=99" in r.json()["detail"]
    r = http.post("/execute_batch", json={"items": [{"code": "1"}, {"cod": "1"}]})
    assert r.status_code == 422 and "items.1.code" in r.json()["detail"]


def test_request_size_cap(http):
    r = http.post("/execute", json={"code": "x = '" + "a" * 10000 + "'"})
    assert r.status_code == 413 and "8192" in r.json()["detail"]


def test_batch_bigger_than_the_queue_is_refused(http):
    r = http.post("/execute_batch", json={"items": [{"code": "1"}] * (MAX_QUEUE + 1)})
    assert r.status_code == 413 and "max_queue" in r.json()["detail"]


def test_empty_batch(http):
    r = http.post("/execute_batch", json={"items": []})
    assert r.status_code == 200 and r.json() == {"results": []}


def _fill_queue(url: str, seconds: float) -> threading.Thread:
    """MAX_QUEUE slow items in one batch: the queue is full until they finish (1 worker)."""
    items = [{"code": f"import time; time.sleep({seconds / MAX_QUEUE})"}] * MAX_QUEUE

    def go():
        with ExecutorClient(url, token=TOKEN) as c:
            res = c.execute_batch(items)
        assert all(r.status == "ok" for r in res)

    t = threading.Thread(target=go)
    t.start()
    return t


def _wait_queued(http, n: int) -> None:
    deadline = time.monotonic() + 10
    while http.get("/health").json()["queued"] < n:
        assert time.monotonic() < deadline, "the slow batch was never admitted"
        time.sleep(0.02)


def test_full_queue_answers_429_with_retry_after(ex, http):
    t = _fill_queue(ex.url, 2.0)
    try:
        _wait_queued(http, MAX_QUEUE)
        r = http.post("/execute", json={"code": "print(1)"})
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1 and "queue is full" in r.json()["detail"]
    finally:
        t.join()
    assert http.post("/execute", json={"code": "print(1)"}).status_code == 200


def test_a_client_that_disconnects_has_its_executions_withdrawn(ex, http):
    """Its queued and running executions held the queue and the one worker for nobody until they
    ended (found in review): now they are cancelled when the connection closes."""
    before = http.get("/health").json()["withdrawn"]
    clients = []

    def send(code: str) -> None:
        with httpx.Client(base_url=ex.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=0.5) as h:
            with pytest.raises(httpx.ReadTimeout):
                h.post("/execute", json={"code": code, "timeout_s": 8})
    for _ in range(3):  # one runs, two wait (1 worker)
        clients.append(threading.Thread(target=send, args=("import time; time.sleep(6)",)))
        clients[-1].start()
    for t in clients:
        t.join()
    t0 = time.monotonic()
    r = http.post("/execute", json={"code": "print(1)"})
    assert r.status_code == 200 and r.json()["stdout"] == "1\n"
    assert time.monotonic() - t0 < 3  # not behind 3 x 6 s of sleeps nobody waits for
    health = http.get("/health").json()
    assert health["withdrawn"] - before == 3 and health["queued"] == 0


def test_a_session_whose_running_block_was_withdrawn_is_reset_as_the_executors_doing(http, ex):
    """The withdrawn block is killed with its session; the session's next block must not score the lost
    state (a NameError here) as the model's: it is marked executor_fault."""
    assert http.post("/execute", json={"code": "x = 5", "session_id": "gone"}).json()["status"] == "ok"
    with httpx.Client(base_url=ex.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=0.5) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post("/execute", json={"code": "import time; time.sleep(6)", "session_id": "gone"})
    r = http.post("/execute", json={"code": "print(x)", "session_id": "gone"}).json()
    assert r["session_reset"] and r["executor_fault"] and "cancelled while it ran" in r["session_note"]


class CountingTransport(httpx.HTTPTransport):
    def __init__(self):
        super().__init__()
        self.statuses: list[int] = []

    def handle_request(self, request):
        resp = super().handle_request(request)
        self.statuses.append(resp.status_code)
        return resp


def test_client_waits_out_a_full_queue(ex, http):
    t = _fill_queue(ex.url, 1.5)
    try:
        _wait_queued(http, MAX_QUEUE)
        transport = CountingTransport()
        with ExecutorClient(ex.url, token=TOKEN, retries=10, transport=transport) as c:
            r = c.execute("print('through')")
    finally:
        t.join()
    assert r.stdout == "through\n"
    assert transport.statuses[0] == 429 and transport.statuses[-1] == 200


def test_client_gives_up_with_executor_unavailable(ex, http):
    t = _fill_queue(ex.url, 2.0)
    try:
        _wait_queued(http, MAX_QUEUE)
        with ExecutorClient(ex.url, token=TOKEN, retries=1, max_backoff_s=0.05) as c:
            c.retry = RetryPolicy(retries=1, cap_s=0.05, max_retry_after_s=0.05)  # not the server's Retry-After
            with pytest.raises(ExecutorUnavailable) as err:
                c.execute("print(1)")
        assert err.value.status_code == 429
    finally:
        t.join()


def test_forkserver_crash_is_survived(ex, http):
    with ExecutorClient(ex.url, token=TOKEN) as c:
        c.execute("v = 1", session_id="before-crash")
        h = http.get("/health").json()
        os.kill(h["forkserver_pid"], signal.SIGKILL)  # its PID-1 child and every runner die with it
        deadline = time.monotonic() + 60
        while True:
            h2 = http.get("/health")
            if h2.status_code == 200 and h2.json()["restarts"] >= 1:
                break
            assert time.monotonic() < deadline, "the fork server was not restarted"
            time.sleep(0.1)
        assert c.execute("print(2)").stdout == "2\n"
        r = c.execute("print(v)", session_id="before-crash")
        assert r.session_reset and "restarted" in r.session_note and "NameError" in r.stderr and r.executor_fault
        c.delete_session("before-crash")


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return kids


def test_zygote_crash_is_survived(ex, http):
    h = http.get("/health").json()
    restarts = h["restarts"]
    [manager] = _children(h["forkserver_pid"])
    rss = {k: int(open(f"/proc/{k}/statm").read().split()[1]) for k in _children(manager)}
    zygote = max(rss, key=rss.get)  # the one holding numpy and sympy
    os.kill(zygote, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        h2 = http.get("/health")
        if h2.status_code == 200 and h2.json()["restarts"] > restarts:
            break
        assert time.monotonic() < deadline, "the fork server was not restarted after its zygote died"
        time.sleep(0.1)
    with ExecutorClient(ex.url, token=TOKEN) as c:
        assert c.execute("import sympy; print(sympy.Integer(2) ** 10)").stdout == "1024\n"


# -- client behaviour against scripted transports ------------------------------------------------------

OK_BODY = ExecResult(status="ok", exit_code=0, stdout="1\n", stderr="", truncated=False, wall_ms=1.0,
                     cpu_ms=1.0).model_dump()


def scripted(responses: list, calls: list):
    def handler(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, request.url.path, time.monotonic()))
        item = responses.pop(0) if len(responses) > 1 else responses[0]
        if isinstance(item, Exception):
            raise item
        status, headers, body = item
        return httpx.Response(status, headers=headers, json=body)
    return handler


def test_client_retries_503_honouring_retry_after():
    calls: list = []
    t = scripted([(503, {"Retry-After": "0.3"}, {"detail": "down"}), (503, {}, {"detail": "down"}),
                  (200, {}, OK_BODY)], calls)
    with ExecutorClient("http://x", transport=httpx.MockTransport(t), retries=3, backoff_s=0.01) as c:
        r = c.execute("print(1)")
    assert r.stdout == "1\n" and len(calls) == 3
    assert calls[1][2] - calls[0][2] >= 0.29  # waited as told


def test_client_does_not_retry_refusals():
    calls: list = []
    t = scripted([(422, {}, {"detail": "invalid request: code: Field required"})], calls)
    with ExecutorClient("http://x", transport=httpx.MockTransport(t), retries=5) as c:
        with pytest.raises(ExecutorRequestError, match="Field required"):
            c.execute("print(1)")
    assert len(calls) == 1


def test_client_connect_errors_are_retried_then_unavailable():
    calls: list = []
    t = scripted([httpx.ConnectError("refused")], calls)
    with ExecutorClient("http://x", transport=httpx.MockTransport(t), retries=2, backoff_s=0.001) as c:
        with pytest.raises(ExecutorUnavailable, match="after 3 attempts"):
            c.execute("print(1)")
    assert len(calls) == 3


def test_client_read_timeouts_are_not_retried():
    calls: list = []
    t = scripted([httpx.ReadTimeout("slow")], calls)
    with ExecutorClient("http://x", transport=httpx.MockTransport(t), retries=5) as c:
        with pytest.raises(ExecutorUnavailable, match="no usable answer"):
            c.execute("print(1)")
    assert len(calls) == 1


def test_unreachable_service():
    with ExecutorClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01) as c:
        assert c.health() is False
        with pytest.raises(ExecutorUnavailable):
            c.execute("print(1)")


def test_async_client_same_contract():
    calls: list = []
    t = scripted([(429, {"Retry-After": "0"}, {"detail": "full"}),
                  (200, {}, {"results": [OK_BODY, OK_BODY]})], calls)

    async def go():
        async with AsyncExecutorClient("http://x", transport=httpx.MockTransport(t), retries=2) as c:
            rs = await c.execute_batch([{"code": "print(1)"}, {"code": "print(1)", "timeout_s": 2}])
            return rs
    rs = asyncio.run(go())
    assert [r.stdout for r in rs] == ["1\n", "1\n"] and len(calls) == 2


def test_client_validates_items_before_sending():
    calls: list = []
    with ExecutorClient("http://x", transport=httpx.MockTransport(scripted([(200, {}, OK_BODY)], calls))) as c:
        with pytest.raises(ValueError, match="timeout"):
            c.execute_batch([{"code": "1", "timeout": 5}])
    assert calls == []


def test_async_client_against_the_real_service(ex):
    async def go():
        async with AsyncExecutorClient(ex.url, token=TOKEN) as c:
            assert await c.health()
            rs = await asyncio.gather(*(c.execute(f"print({i})") for i in range(8)))
            assert [r.stdout for r in rs] == [f"{i}\n" for i in range(8)]
            await c.execute("a = 1", session_id="async")
            assert (await c.execute("print(a)", session_id="async")).stdout == "1\n"
            assert await c.delete_session("async") is True
    asyncio.run(go())


def test_a_malformed_answer_is_an_executor_error_not_a_pydantic_one():
    calls: list = []
    bad = {**OK_BODY, "cpu_ms": "NaN", "status": "forged"}
    t = scripted([(200, {}, bad)], calls)
    with ExecutorClient("http://x", transport=httpx.MockTransport(t)) as c:
        with pytest.raises(ExecutorError, match="malformed") as e:
            c.execute("print(1)")
    assert not isinstance(e.value, ValueError) and len(calls) == 1

    async def go():
        async with AsyncExecutorClient("http://x", transport=httpx.MockTransport(scripted([(200, {}, {})], []))) as c:
            await c.execute_batch([{"code": "1"}])
    with pytest.raises(ExecutorError, match="malformed"):
        asyncio.run(go())


# -- the async client's default (aiohttp) transport against real sockets ------------------------------

def _drop_after_reading(port: int, accepted: list, stop: threading.Event) -> None:
    """A server that reads each request whole and closes the connection without answering: the
    code may have run, so the client must not send it again."""
    import socket
    with socket.create_server(("127.0.0.1", port)) as srv:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            accepted.append(time.monotonic())
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    if not (chunk := conn.recv(65536)):
                        break  # the client closed first: nothing more will come
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next((v for k, v in (h.split(b":", 1) for h in head.split(b"\r\n")[1:] if b":" in h)
                                   if k.strip().lower() == b"content-length"), 0))
                while len(body) < length and (chunk := conn.recv(65536)):
                    body += chunk


def test_async_client_never_resends_a_request_the_server_dropped():
    port, accepted, stop = free_port(), [], threading.Event()
    t = threading.Thread(target=_drop_after_reading, args=(port, accepted, stop), daemon=True)
    t.start()
    time.sleep(0.3)

    async def go():
        async with AsyncExecutorClient(f"http://127.0.0.1:{port}", retries=3, backoff_s=0.01) as c:
            await c.execute("print(1)")
    try:
        with pytest.raises(ExecutorUnavailable, match="no usable answer"):
            asyncio.run(go())
    finally:
        stop.set()
        t.join(5)
    assert len(accepted) == 1


def test_async_client_retries_refused_connects_then_unavailable():
    async def go():
        async with AsyncExecutorClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01) as c:
            await c.execute("print(1)")
    with pytest.raises(ExecutorUnavailable, match="after 3 attempts"):
        asyncio.run(go())


def test_the_services_working_directory_is_not_readable_from_the_sandbox(tmp_path):
    """`python -m` puts the cwd on sys.path, and the sandbox binds sys.path in: a service started
    from a home or /tmp directory exposed what was there (a config with its token, say)."""
    import shutil
    import tempfile

    from toolrl.net import LocalService

    where = tempfile.mkdtemp(prefix="toolrl-cwd-")
    try:
        os.chmod(where, 0o755)
        secret = os.path.join(where, "launch.env")
        with open(secret, "w") as f:
            f.write("TOKEN=hunter2\n")
        os.chmod(secret, 0o644)
        port = free_port()
        with LocalService("toolrl.executor", ["--port", str(port)], f"http://127.0.0.1:{port}",
                          log_path=tmp_path / "executor.log", cwd=where):
            with ExecutorClient(f"http://127.0.0.1:{port}", timeout_s=60) as c:
                assert c.execute("print(1)").stdout == "1\n"
                r = c.execute(f"print(open({secret!r}).read())")
        assert "hunter2" not in r.stdout and r.status == "error", r
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_tools_find_the_executor_with_their_token_or_run_a_private_one_under_its_own(ex, monkeypatch):
    """inference.py, evaluate.py and trace collection: with TOOLRL_EXECUTOR_TOKEN in the environment
    (RUN_DIR/tokens.env sourced) the /health probe went without it, and the private executor took
    the token from the environment while its start-up probe did not: 60 s, then a traceback. Without
    one, the private executor ran anyone's code (found in review)."""
    import subprocess
    import sys

    from toolrl.config import load_config
    from toolrl.executor.local import ExecutorRefused, executor_available

    monkeypatch.setenv("TOOLRL_EXECUTOR_TOKEN", "not-the-service-token")
    nothing = load_config("configs/cpu_tiny.yaml", [f"executor.url=http://127.0.0.1:{free_port()}"])
    t0 = time.monotonic()
    with executor_available(nothing, log=lambda m: None) as cfg:
        assert time.monotonic() - t0 < 30 and cfg.executor.token not in (None, "not-the-service-token")
        assert httpx.post(f"{cfg.executor.url}/execute", json={"code": "print(1)"}).status_code == 401
        with ExecutorClient(cfg.executor.url, token=cfg.executor.token) as c:
            assert c.execute("print(6 * 7)").stdout == "42\n"
    wrong = load_config("configs/cpu_tiny.yaml", [f"executor.url={ex.url}"])  # the env's token, not TOKEN
    with pytest.raises(ExecutorRefused, match="refuses our token"):
        with executor_available(wrong):
            pass
    with executor_available(load_config("configs/cpu_tiny.yaml", [f"executor.url={ex.url}", f"executor.token={TOKEN}"]),
                            log=lambda m: pytest.fail(m)) as cfg:
        assert cfg.executor.url == ex.url  # the configured one, with our token
    out = subprocess.run([sys.executable, "evaluate.py", "score", "--config", "configs/cpu_tiny.yaml", "--task",
                          "humaneval:HumanEval/0", "--program", "-", "--set", f"executor.url={ex.url}"],
                         input="def has_close_elements(n, t): return False\n", capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 2 and out.stderr.strip().startswith("evaluate.py score: the executor at"), out.stderr
