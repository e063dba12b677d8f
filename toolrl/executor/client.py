"""Clients of the executor service: `ExecutorClient` (sync) and `AsyncExecutorClient` (async).

    c = AsyncExecutorClient(url, token=None, timeout_s=60.0, retries=5)
    r: ExecResult = await c.execute(code, timeout_s=None, memory_mb=None, stdin=None, session_id=None,
                                    session_continues=False)
    rs: list[ExecResult] = await c.execute_batch([{"code": ..., "timeout_s": ...}, ...])
    await c.delete_session(session_id); ok: bool = await c.health(); await c.aclose()

Retries: 429 and 503 (the request was not run) and failures to connect, by the system's one
`toolrl.net.RetryPolicy` (exponential backoff from `backoff_s` up to `max_backoff_s`, with jitter,
never sooner than Retry-After). After `retries` retries: ExecutorUnavailable. A request that was sent
but got no answer in time is not retried (its code may have run): ExecutorUnavailable at once.
A request the server refuses (4xx) raises ExecutorRequestError with the server's reason.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Iterable
from urllib.parse import quote

import httpx

from toolrl.executor.api import BatchResponse, ExecRequest, ExecResult
from toolrl.net import RetryPolicy, async_transport, auth_headers, never_sent, retry_after_s

RETRY_STATUS = (429, 503)  # the service did not run the request: always safe to send again


class ExecutorError(RuntimeError):
    def __init__(self, msg: str, status_code: int | None = None):
        super().__init__(msg)
        self.status_code = status_code


class ExecutorUnavailable(ExecutorError):
    """The service could not be reached, or stayed busy, through every retry."""


class ExecutorRequestError(ExecutorError):
    """The service refused the request itself (bad input, auth, size): retrying will not help."""


class _Common:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 60.0, retries: int = 5,
                 backoff_s: float = 0.1, max_backoff_s: float = 10.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.retry = RetryPolicy(retries=retries, base_s=backoff_s, cap_s=max_backoff_s)

    @staticmethod
    def _parse(model, resp: httpx.Response):
        """The answer as `model`; an answer that does not fit it is the service's fault, reported as
        an ExecutorError like every other failure of the service, never as a pydantic error."""
        try:
            return model.model_validate_json(resp.content)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise ExecutorError(f"the executor's answer to {resp.request.url.path} is malformed: "
                                f"{str(exc)[:300]}", resp.status_code) from None

    @staticmethod
    def _exec_payload(code: str, timeout_s, memory_mb, stdin, session_id, session_continues=False) -> dict:
        req = ExecRequest(code=code, timeout_s=timeout_s, memory_mb=memory_mb, stdin=stdin,
                          session_id=session_id, session_continues=session_continues)
        # defaults left out: session_continues goes only when true (a block after a session's first)
        return req.model_dump(exclude_defaults=True)

    @staticmethod
    def _batch_payload(items: Iterable[dict | ExecRequest]) -> dict:
        reqs = [i if isinstance(i, ExecRequest) else ExecRequest.model_validate(i) for i in items]
        return {"items": [r.model_dump(exclude_defaults=True) for r in reqs]}

    def _timeout(self, payload_timeouts: list[float | None]) -> httpx.Timeout:
        """Long enough for the code's own limits plus queueing; connecting stays quick."""
        longest = max([t for t in payload_timeouts if t] or [0.0])
        read = max(self.timeout_s, longest + 30.0)
        return httpx.Timeout(read, connect=min(10.0, self.timeout_s))

    def _decide(self, resp: httpx.Response | None, exc: Exception | None, attempt: int, path: str):
        """Returns the response to use, or None to retry; raises when there is nothing more to try."""
        if exc is not None:
            if never_sent(exc):
                if attempt < self.retry.retries:
                    return None
                raise ExecutorUnavailable(f"cannot reach the executor at {self.url}{path} after "
                                          f"{attempt + 1} attempts: {exc!r}") from exc
            raise ExecutorUnavailable(f"no usable answer from the executor at {self.url}{path}: "
                                      f"{exc!r}") from exc
        assert resp is not None
        if resp.status_code in RETRY_STATUS:
            if attempt < self.retry.retries:
                return None
            raise ExecutorUnavailable(f"executor at {self.url} still busy after {attempt + 1} attempts: "
                                      f"{resp.status_code} {_detail(resp)}", resp.status_code)
        if 400 <= resp.status_code < 500:
            raise ExecutorRequestError(f"executor refused {path}: {resp.status_code} {_detail(resp)}",
                                       resp.status_code)
        if resp.status_code >= 500:
            raise ExecutorError(f"executor error on {path}: {resp.status_code} {_detail(resp)}",
                                resp.status_code)
        return resp


def _session_path(session_id: str) -> str:
    return "/sessions/" + quote(session_id, safe="")


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        return str(body.get("detail", body)) if isinstance(body, dict) else str(body)
    except ValueError:
        return resp.text[:500]


class ExecutorClient(_Common):
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 60.0, retries: int = 5,
                 transport: httpx.BaseTransport | None = None, **kw):
        super().__init__(url, token, timeout_s, retries, **kw)
        self._http = httpx.Client(base_url=self.url, headers=auth_headers(token), timeout=timeout_s,
                                  transport=transport)

    def _request(self, method: str, path: str, json: Any = None, timeout=None) -> httpx.Response:
        attempt = 0
        while True:
            resp, exc = None, None
            try:
                resp = self._http.request(method, path, json=json, timeout=timeout or self.timeout_s)
            except httpx.HTTPError as e:
                exc = e
            used = self._decide(resp, exc, attempt, path)
            if used is not None:
                return used
            time.sleep(self.retry.delay(attempt, retry_after_s(resp)))
            attempt += 1

    def execute(self, code: str, timeout_s: float | None = None, memory_mb: int | None = None,
                stdin: str | None = None, session_id: str | None = None,
                session_continues: bool = False) -> ExecResult:
        payload = self._exec_payload(code, timeout_s, memory_mb, stdin, session_id, session_continues)
        resp = self._request("POST", "/execute", payload, self._timeout([timeout_s]))
        return self._parse(ExecResult, resp)

    def execute_batch(self, items: Iterable[dict | ExecRequest]) -> list[ExecResult]:
        payload = self._batch_payload(items)
        if not payload["items"]:
            return []
        resp = self._request("POST", "/execute_batch", payload,
                             self._timeout([i.get("timeout_s") for i in payload["items"]]))
        return self._parse(BatchResponse, resp).results

    def delete_session(self, session_id: str) -> bool:
        return bool(self._request("DELETE", _session_path(session_id)).json().get("deleted"))

    def health(self) -> bool:
        try:
            resp = self._http.get("/health", timeout=min(self.timeout_s, 10.0))
            return resp.status_code == 200 and bool(resp.json().get("ok"))
        except (httpx.HTTPError, ValueError):
            return False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ExecutorClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncExecutorClient(_Common):
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 60.0, retries: int = 5,
                 transport: httpx.AsyncBaseTransport | None = None, **kw):
        super().__init__(url, token, timeout_s, retries, **kw)
        # Every tool call is a request: the aiohttp transport halves the client's CPU per call
        self._http = httpx.AsyncClient(base_url=self.url, headers=auth_headers(token), timeout=timeout_s,
                                       transport=transport or async_transport())

    async def _request(self, method: str, path: str, json: Any = None, timeout=None) -> httpx.Response:
        attempt = 0
        while True:
            resp, exc = None, None
            try:
                resp = await self._http.request(method, path, json=json, timeout=timeout or self.timeout_s)
            except httpx.HTTPError as e:
                exc = e
            used = self._decide(resp, exc, attempt, path)
            if used is not None:
                return used
            await asyncio.sleep(self.retry.delay(attempt, retry_after_s(resp)))
            attempt += 1

    async def execute(self, code: str, timeout_s: float | None = None, memory_mb: int | None = None,
                      stdin: str | None = None, session_id: str | None = None,
                session_continues: bool = False) -> ExecResult:
        payload = self._exec_payload(code, timeout_s, memory_mb, stdin, session_id, session_continues)
        resp = await self._request("POST", "/execute", payload, self._timeout([timeout_s]))
        return self._parse(ExecResult, resp)

    async def execute_batch(self, items: Iterable[dict | ExecRequest]) -> list[ExecResult]:
        payload = self._batch_payload(items)
        if not payload["items"]:
            return []
        resp = await self._request("POST", "/execute_batch", payload,
                                   self._timeout([i.get("timeout_s") for i in payload["items"]]))
        return self._parse(BatchResponse, resp).results

    async def delete_session(self, session_id: str) -> bool:
        return bool((await self._request("DELETE", _session_path(session_id))).json().get("deleted"))

    async def health(self) -> bool:
        try:
            resp = await self._http.get("/health", timeout=min(self.timeout_s, 10.0))
            return resp.status_code == 200 and bool(resp.json().get("ok"))
        except (httpx.HTTPError, ValueError):
            return False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncExecutorClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
