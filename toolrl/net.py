"""What every HTTP service and client shares: bearer-token auth, capped bodies, JSON errors,
uvicorn start-up, the one retry policy, free ports and services run as child processes.

Services bind 127.0.0.1 unless told otherwise and take an optional bearer token; clients send it
with `auth_headers`.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse


def bearer_matches(header: str | bytes | None, token: str | None) -> bool:
    """Whether an Authorization header value carries `Bearer <token>` (always, with no token set).
    The one parse of the header, for the dependency, the body cap and the executor's hot routes."""
    if token is None:
        return True
    if not header:
        return False
    raw = header if isinstance(header, bytes) else header.encode("latin-1", "replace")
    scheme, _, credentials = raw.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), token.encode())


def require_bearer(request: Request, token: str | None) -> None:
    """401 unless the request carries `Bearer <token>` (when a token is set)."""
    if not bearer_matches(request.headers.get("authorization"), token):
        raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


def bearer_auth(token: str | None) -> Callable:
    """A FastAPI dependency that requires `Authorization: Bearer <token>` when a token is set."""

    async def check(request: Request) -> None:
        require_bearer(request, token)

    return check


# A service refusing the token (wrong or missing): every request will be refused alike, so the caller
# stops and says why instead of retrying or dropping one piece of work after another
AUTH_REFUSED = (401, 403)


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class ByteBudget:
    """Bytes that requests hold at once (bodies being received, or waiting to be decoded), bounded:
    a request that would pass `limit` gets 503 + Retry-After instead of memory."""

    def __init__(self, limit: int, what: str = "request bodies"):
        self.limit, self.what, self.held = limit, what, 0

    def take(self, n: int) -> None:
        if self.held + n > self.limit:
            raise HTTPException(status_code=503, headers={"Retry-After": "1"},
                                detail=f"busy: {self.held} bytes of {self.what} held, limit {self.limit}; retry")
        self.held += n

    def release(self, n: int) -> None:
        self.held -= n


async def read_body_capped(request: Request, max_bytes: int, timeout_s: float | None = None,
                           budget: ByteBudget | None = None) -> bytes:
    """The request body, refusing with 413 as soon as it passes `max_bytes` (never buffers more).

    `timeout_s`: the whole body must arrive within it, else 408 (and the connection is closed): a
    client that stalls or trickles holds nothing for longer. `budget`: the bytes are taken from it as
    they arrive (given back here on any failure; on success the caller releases len(body))."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPException(status_code=413, detail=f"body of {declared} bytes is over the limit of {max_bytes}")
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            if size + len(chunk) > max_bytes:
                raise HTTPException(status_code=413, detail=f"body is over the limit of {max_bytes} bytes")
            if budget is not None:
                budget.take(len(chunk))
            size += len(chunk)
            chunks.append(chunk)

    try:
        if timeout_s is None:
            await read()
        else:
            async with asyncio.timeout(timeout_s):
                await read()
    except TimeoutError:
        if budget is not None:
            budget.release(size)
        raise HTTPException(status_code=408, headers={"Connection": "close"},
                            detail=f"request body not complete within {timeout_s:g}s "
                                   f"({size} of {declared or '?'} bytes arrived)") from None
    except BaseException:
        if budget is not None:
            budget.release(size)
        raise
    return b"".join(chunks)


def install_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """Unexpected exceptions become a JSON 500 with the reason, logged, and the server keeps serving.
    A client that leaves mid-request is a line, not a traceback (a worker dying mid-upload is
    routine); a 422 never echoes the input (FastAPI's did, and a NaN in it made the answer itself
    fail: a 500 with two tracebacks; found in review)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.requests import ClientDisconnect

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        log.info("client left during %s %s", request.method, request.url.path)
        return JSONResponse(status_code=400, content={"detail": "the client left before its request was whole"})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": errors})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # pragma: no cover - last resort
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(status_code=500, content={"detail": f"internal error: {type(exc).__name__}: {exc}"})


BODY_TIMEOUT_S = 60.0  # a request body still arriving this long after the request began: 408


class BodyStalled(Exception):
    """A streamed body sent nothing for its idle limit (a sender that hung or vanished without closing)."""


async def idle_bounded(chunks: AsyncIterator[bytes], idle_s: float) -> AsyncIterator[bytes]:
    """`chunks` (a streamed body), raising BodyStalled when the next chunk takes more than `idle_s`. For
    bodies too large for one deadline (weight buckets under an egress limit): without it, a sender
    whose host vanished (no FIN) held the request, its buffer and its update for good."""
    it = chunks.__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(it.__anext__(), idle_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise BodyStalled(f"no body bytes for {idle_s:g} s") from None
        yield chunk


class BodyCap:
    """ASGI middleware that bounds every body a JSON route reads, before the route sees a byte.
    FastAPI reads and parses a JSON route's whole body before its auth dependency runs, so:
    - with a `token`, a request that carries a body without `Authorization: Bearer <token>` gets 401
      at once, unread (nobody without the token makes the server buffer or parse anything);
    - a body over `max_bytes` gets 413, whether it says so up front (Content-Length) or only as it
      arrives (chunked: counted, never buffered past the cap);
    - a body still arriving `body_timeout_s` after the request began gets 408 (a stalled sender
      would otherwise hold its connection and buffer for good; uvicorn has no body deadline).
    The refusal goes out at once and the route sees the client gone. Routes in `exempt` (exact
    paths) stream, authenticate and bound their own bodies (uploads, weight buckets)."""

    def __init__(self, app, max_bytes: int, exempt: tuple[str, ...] = (), token: str | None = None,
                 body_timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.exempt = app, max_bytes, frozenset(exempt)
        self.token = token or None
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        has_body = b"transfer-encoding" in headers or (length is not None and length not in (b"", b"0"))
        if has_body and not bearer_matches(headers.get(b"authorization"), self.token):
            return await _refuse(scope, receive, send, 401, "missing or wrong bearer token",
                                 {"WWW-Authenticate": "Bearer"})
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_big(scope, receive, send, f"body of {int(length)} bytes")
        seen, refused, done = 0, False, not has_body
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def capped():
            nonlocal seen, refused, done
            if refused:
                return {"type": "http.disconnect"}
            if done:  # the body is in: later receives wait for a disconnect, untimed
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                refused = True
                await _refuse(scope, receive, send, 408,
                              f"the body did not arrive within {self.body_timeout_s:g} s")
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                done = not message.get("more_body", False)
                if seen > self.max_bytes:
                    refused = True
                    await self._too_big(scope, receive, send, "body")
                    return {"type": "http.disconnect"}
            return message

        async def send_unless_refused(message):
            if not refused:  # the refusal is the answer; the route's own (to a gone client) is dropped
                await send(message)
        await self.app(scope, capped, send_unless_refused)

    async def _too_big(self, scope, receive, send, what: str) -> None:
        await _refuse(scope, receive, send, 413, f"{what} is over the limit of {self.max_bytes} bytes")


async def _refuse(scope, receive, send, status: int, detail: str, headers: dict | None = None) -> None:
    await JSONResponse(status_code=status, content={"detail": detail},
                       headers={"Connection": "close", **(headers or {})})(scope, receive, send)


def cap_request_bodies(app: FastAPI, max_bytes: int, exempt: tuple[str, ...] = (), token: str | None = None,
                       body_timeout_s: float = BODY_TIMEOUT_S) -> None:
    """Every route's body from a caller with `token` only, at most `max_bytes` (413 otherwise) and
    whole within `body_timeout_s` (408), but for the `exempt` paths (BodyCap)."""
    app.add_middleware(BodyCap, max_bytes=max_bytes, exempt=exempt, token=token, body_timeout_s=body_timeout_s)


def setup_logging(name: str, level: str = "INFO") -> logging.Logger:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpcore"):  # one line per request drowns the logs that matter
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(name)


def add_bind_args(parser, section: str) -> None:
    """--host and --port of a service, defaulting to its config section's (127.0.0.1 unless set)."""
    parser.add_argument("--host", help=f"bind address (default: {section}.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help=f"port (default: {section}.port)")


HEADER_TIMEOUT_S = 30.0  # a request's headers must arrive within this of the connection (or the last answer)


def http_protocol(parser: str = "auto"):
    """uvicorn's HTTP protocol with a deadline for request headers. uvicorn has none: a connection
    that sends half a request line and stops (slowloris) is held for ever. Armed when the
    connection opens and again after each answer (waiting for the next request on a kept-alive
    connection), cleared when a request's headers are complete; past it the connection is closed.
    Request bodies have their own deadlines where they are read (read_body_capped).

    parser: "httptools" (uvicorn's C parser, its own default when installed), "h11" (pure Python),
    or "auto" (httptools when importable). The h11 protocol cost the executor's front end ~0.5 ms
    of CPU per request more (measured on the AVX2 host)."""
    if parser == "auto":
        try:
            import httptools  # noqa: F401
            parser = "httptools"
        except ImportError:
            parser = "h11"
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base  # lazy, as uvicorn
    elif parser == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
    else:
        raise ValueError(f"unknown HTTP parser {parser!r}: httptools, h11 or auto")

    class HeaderDeadline(Base):
        deadline = None

        def _arm(self) -> None:
            self._disarm()
            self.deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._late)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _late(self) -> None:
            self.deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # not while a pipelined request, its headers already read, is being answered
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()

        if parser == "h11":
            def handle_events(self) -> None:
                cycle = self.cycle
                super().handle_events()
                if self.cycle is not cycle:  # a request's headers are complete
                    self._disarm()
        else:
            def on_headers_complete(self) -> None:  # the parser's callback
                self._disarm()
                super().on_headers_complete()

    return HeaderDeadline


def warn_if_open(host: str, token: str | None, section: str) -> None:
    """A service bound beyond this machine without a bearer token serves anyone who reaches it."""
    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        logging.getLogger("toolrl").warning("binding %s without a token: anyone who reaches the port can use it; "
                                            "set %s.token (launch.sh makes one per run)", host, section)


def serve(app: FastAPI, host: str, port: int, token: str | None, section: str, log_level: str = "warning") -> None:
    import uvicorn  # here, not at the top: clients import this module and never serve

    warn_if_open(host, token, section)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30, http=http_protocol())


# ---------------------------------------------------------------------------------------------
# One retry policy for every client

@dataclass(frozen=True)
class RetryPolicy:
    """How every client of the system retries what is worth retrying: exponential backoff from
    `base_s`, capped at `cap_s`, with jitter so that many clients do not retry in lock-step, and
    never sooner than the server's Retry-After (itself capped at `max_retry_after_s`)."""
    retries: int = 5
    base_s: float = 0.1
    cap_s: float = 10.0
    max_retry_after_s: float = 60.0

    def delay(self, attempt: int, retry_after_s: float = 0.0) -> float:
        backoff = min(self.cap_s, self.base_s * 2 ** attempt) * random.uniform(0.5, 1.0)
        return max(min(self.max_retry_after_s, retry_after_s), backoff)


def async_transport(max_connections: int = 256, max_keepalive: int = 64) -> httpx.AsyncBaseTransport:
    """The transport of the system's hot async clients: httpx's API over aiohttp's HTTP/1.1, whose
    parser is C. A trivial request costs the caller about half the CPU of httpx's own transport
    (0.6-0.7 ms against 1.2-1.5 ms, docs/BENCHMARKS.md), which a tool call pays on the cores the
    engine needs. Its idle connections expire after 5 s, before the server's keep-alive (30 s)."""
    from httpx_aiohttp import AiohttpTransport

    return AiohttpTransport(limits=httpx.Limits(max_connections=max_connections,
                                                max_keepalive_connections=max_keepalive))


def never_sent(exc: Exception) -> bool:
    """True when the request surely never reached the server, so sending it again cannot run it
    twice: a refused or timed-out connect. httpx-aiohttp maps every aiohttp connection error to
    httpx.ConnectTimeout, including a server that dropped the connection after reading the request;
    only aiohttp's connect-phase errors count here."""
    if not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return False
    cause = exc.__cause__
    if cause is None or not type(cause).__module__.startswith("aiohttp"):
        return True  # httpx's own transport: its connect errors are connect errors
    import aiohttp

    return isinstance(cause, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def retry_after_s(resp: httpx.Response | None) -> float:
    """The server's Retry-After in seconds (0 when absent or not a number)."""
    if resp is None:
        return 0.0
    try:
        return max(0.0, float(resp.headers.get("retry-after", "")))
    except ValueError:
        return 0.0


async def wait_for(aw, timeout_s: float, what: str):
    """Every wait has a timeout: asyncio.wait_for, with an error that says what was waited for."""
    try:
        return await asyncio.wait_for(aw, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f}s") from None


# ---------------------------------------------------------------------------------------------
# Local services: ports, and a service run as a child process

def free_port() -> int:
    """A port the OS says is free now (another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalService:
    """A service of this package run as a child process in its own session, ready once its
    /health answers 200, stopped with SIGTERM (then SIGKILL) and never left behind:

        with LocalService("toolrl.executor", ["--port", str(port)], f"http://127.0.0.1:{port}") as svc:
            ...
    """

    def __init__(self, module: str, args: list[str], url: str, *, token: str | None = None,
                 log_path: str | Path | None = None, startup_timeout_s: float = 120.0, cwd: str | Path | None = None,
                 env: dict[str, str | None] | None = None):
        self.module, self.args, self.url = module, list(args), url.rstrip("/")
        self.env = env or {}  # over ours for the child; None removes a variable (secrets stay out of argv)
        self.token = token
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LocalService":
        out = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ)
        for k, v in self.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=self.cwd, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:  # whatever interrupts the wait (timeout, Ctrl-C), the service we started goes too
            deadline = time.monotonic() + self.startup_timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"python -m {self.module} exited with {self.proc.returncode}: "
                                       f"{self.log_tail()}")
                try:
                    if httpx.get(f"{self.url}/health", headers=auth_headers(self.token), timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            raise TimeoutError(f"{self.module} not healthy after {self.startup_timeout_s} s: {self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def log_tail(self, n: int = 30) -> str:
        if self.log_path and self.log_path.exists():
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> "LocalService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
