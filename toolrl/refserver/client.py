"""Clients of the reference server: async for the gen worker, sync for the learner.

Transient trouble (connection errors, 408/502/503/504, a full queue) is retried with backoff inside a
bounded time; a request the server rejects for its content (400, 401, 413, 422) raises
`RefServerError` at once, since retrying cannot help. Retries are safe: uploads carry an
`X-Upload-Id`, and batch, grant and lease requests a `request_id`, so the server answers a retry
with the first answer instead of taking a group twice, losing a batch whose response was lost, or
holding a second grant or lease.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from toolrl.net import RetryPolicy, auth_headers, retry_after_s
from toolrl.protocol import CONTENT_TYPE, Sample, decode_samples, encode_ref_logprobs, encode_samples

log = logging.getLogger("toolrl.refserver.client")
_RETRY_STATUS = (408, 502, 503, 504)  # 408: the body did not arrive in time (a slow link): send it again
SERVER_MAX_BATCH_WAIT_S = 300.0  # the server caps /batch?wait_s at this


class RefServerUnavailable(RuntimeError):
    """The server could not be reached, or stayed full, for longer than the allowed wait."""


class RefServerError(RuntimeError):
    """The server rejected the request itself (bad payload, auth, size); retrying will not help."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"reference server answered {status}: {detail}")
        self.status, self.detail = status, detail


def _detail(r: httpx.Response) -> str:
    try:
        d = r.json().get("detail")
        return d if isinstance(d, str) else str(d)
    except Exception:  # noqa: BLE001 - any odd body: show the raw text
        return r.text[:500]


class _Tries:
    """The attempts of one request under the retry policy: iterating yields the pause before each
    try; `judge` keeps a usable answer (and ends the iteration), notes why a try failed, or raises
    RefServerError at once when retrying cannot help. Exhausted tries raise RefServerUnavailable."""

    def __init__(self, policy: RetryPolicy, what: str, ok: tuple[int, ...]):
        self.policy, self.what, self.ok = policy, what, ok
        self.answer: httpx.Response | None = None
        self.last: httpx.Response | None = None
        self.reason = ""

    def __iter__(self):
        for attempt in range(self.policy.retries + 1):
            yield self.policy.delay(attempt - 1, retry_after_s(self.last)) if attempt else 0.0
            if self.answer is not None:
                return
        raise RefServerUnavailable(f"{self.what} failed after {self.policy.retries + 1} tries; last: {self.reason}")

    def judge(self, r: httpx.Response | None, exc: Exception | None) -> None:
        self.last = r
        self.answer, self.reason = _outcome(r, exc, self.ok)


def _call(send, *args, **kw) -> tuple[httpx.Response | None, Exception | None]:
    try:
        return send(*args, **kw), None
    except httpx.TransportError as exc:
        return None, exc


async def _acall(send, *args, **kw) -> tuple[httpx.Response | None, Exception | None]:
    try:
        return await send(*args, **kw), None
    except httpx.TransportError as exc:
        return None, exc


def _outcome(r: httpx.Response | None, exc: Exception | None, ok: tuple[int, ...]) -> tuple[httpx.Response | None, str]:
    """(the response to use, "") or (None, why) when the request is worth retrying; raises
    RefServerError when the server refused the request itself."""
    if exc is not None:
        return None, f"{type(exc).__name__}: {exc}"
    if r.status_code in ok:
        return r, ""
    if r.status_code not in _RETRY_STATUS:
        raise RefServerError(r.status_code, _detail(r))
    return None, f"{r.status_code}: {_detail(r)}"


class AsyncRefServerClient:
    """For the gen worker (asyncio). `max_wait_s` bounds how long `upload` keeps retrying."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0, max_wait_s: float = 1800.0,
                 upload_wait_s: float = 10.0, retries: int = 4, transport: httpx.AsyncBaseTransport | None = None):
        self.url, self.timeout_s, self.max_wait_s, self.retries = url.rstrip("/"), timeout_s, max_wait_s, retries
        self.upload_wait_s = upload_wait_s  # asks the server to hold a full-queue upload this long
        self.policy = RetryPolicy(retries=retries, cap_s=5.0)
        self._http = httpx.AsyncClient(base_url=self.url, headers=auth_headers(token), timeout=timeout_s,
                                       transport=transport)
        self.upload_waits = 0  # 503s seen by upload: how often backpressure made us wait

    async def upload(self, samples: list[Sample], *, max_wait_s: float | None = None,
                     grant_id: str | None = None) -> dict[str, Any]:
        """Upload one group; returns the server's answer ({accepted, dropped_stale, ...}) once accepted.
        Waits (never drops) while the server is full or unreachable, up to `max_wait_s`. `grant_id`:
        the flow-control grant the group was started under, which the upload ends."""
        body = encode_samples(samples) if len(samples) < 64 else await asyncio.to_thread(encode_samples, samples)
        headers = {"Content-Type": CONTENT_TYPE, "X-Upload-Id": uuid.uuid4().hex}
        if grant_id:
            headers["X-Grant-Id"] = grant_id
        limit = self.max_wait_s if max_wait_s is None else max_wait_s
        deadline = time.monotonic() + limit
        attempt, reason = 0, ""
        while True:
            t0 = time.monotonic()
            wait = min(self.upload_wait_s, max(0.0, deadline - t0))
            r, exc = await _acall(self._http.post, "/upload", content=body, headers=headers,
                                  params={"wait_s": round(wait, 3)}, timeout=self.timeout_s + wait)
            accepted, reason = _outcome(r, exc, (200,))
            if accepted is not None:
                return accepted.json()
            self.upload_waits += r is not None
            now = time.monotonic()
            if now >= deadline:
                raise RefServerUnavailable(f"upload not accepted within {limit:.0f}s; last: {reason}")
            # The server already held us `wait` seconds: go again at once. Otherwise honour Retry-After.
            held = r is not None and r.status_code == 503 and now - t0 >= wait * 0.9 and wait > 0
            pause = 0.0 if held else self.policy.delay(attempt, retry_after_s(r))
            attempt += 1
            if attempt % 10 == 0:
                log.info("upload still waiting (%d tries): %s", attempt, reason)
            await asyncio.sleep(min(pause, max(0.0, deadline - now)))

    async def _request(self, method: str, path: str, ok: tuple[int, ...] = (200,), **kw) -> httpx.Response:
        tries = _Tries(self.policy, f"{method} {path}", ok)
        for pause in tries:
            await asyncio.sleep(pause)
            tries.judge(*await _acall(self._http.request, method, path, **kw))
        return tries.answer

    async def register(self, worker_id: str, url: str, capabilities: dict[str, Any] | None = None,
                       policy_version: int = 0, wait_s: float = 0.0) -> dict[str, Any]:
        """Register (or re-register) this worker. The answer includes `learner_version`, `ttl_s` and
        `resume_state` (see `heartbeat`). `wait_s`: how long to keep trying a server that is not up
        yet (launch.sh starts the workers beside it; a worker on another node may start before the
        head). A server that answers with an error (a wrong token) fails at once."""
        body = {"id": worker_id, "url": url, "capabilities": capabilities or {}, "policy_version": policy_version}
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                return (await self._request("POST", "/workers", json=body)).json()
            except RefServerUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise RefServerUnavailable(f"no reference server took the registration at {self.url} "
                                               f"within {wait_s:.0f}s; last: {exc}") from exc
                if not said:
                    log.info("waiting for the reference server at %s to take the registration", self.url)
                    said = True
                await asyncio.sleep(1.0)

    async def heartbeat(self, worker_id: str, policy_version: int, state: dict[str, Any] | None = None,
                        resume_applied: str | None = None) -> dict[str, Any] | None:
        """The server's answer ({ok, ttl_s, learner_version, resume_state, resume_id}, truthy) if it knows
        us; None if it forgot us (expired or restarted): register again. `state`: our producer state,
        which the learner checkpoints; `resume_state` is ours from the checkpoint a resumed run started
        from, handed back until a heartbeat says `resume_applied` with its `resume_id`."""
        body: dict[str, Any] = {"policy_version": policy_version}
        if state is not None:
            body["state"] = state
        if resume_applied is not None:
            body["resume_applied"] = resume_applied
        r = await self._request("POST", f"/workers/{worker_id}/heartbeat", ok=(200, 404), json=body)
        return r.json() if r.status_code == 200 else None

    async def grant(self, worker_id: str, n: int, wait_s: float = 0.0) -> tuple[bool, str | None]:
        """Flow control (toolrl.refserver.flow): may this worker start a group of `n` samples now?
        Waits up to `wait_s` on the server for room. (True, grant id) when it may; the id is None when
        the server does no flow control. (False, None) when there is no room yet."""
        # request_id: a retry after a lost answer gets the grant the first try took, not a second one
        r = await self._request("POST", "/grants", ok=(200, 204), timeout=self.timeout_s + wait_s,
                                json={"worker_id": worker_id, "n": n, "wait_s": wait_s,
                                      "request_id": uuid.uuid4().hex})
        return (True, r.json().get("grant_id")) if r.status_code == 200 else (False, None)

    async def give_back(self, grant_id: str) -> bool:
        """End a grant whose group will not be uploaded (left out, failed)."""
        r = await self._request("DELETE", f"/grants/{grant_id}")
        return bool(r.json().get("released"))

    async def deregister(self, worker_id: str) -> bool:
        r = await self._request("DELETE", f"/workers/{worker_id}")
        return bool(r.json().get("removed"))

    async def keep_registered(self, worker_id: str, url: str, capabilities: dict[str, Any],
                              policy_version: Callable[[], int], interval_s: float = 5.0,
                              state: Callable[[], dict[str, Any] | None] | None = None,
                              on_resume: Callable[[dict[str, Any]], None] | None = None,
                              on_training_over: Callable[[bool], None] | None = None,
                              registered: bool = False, applied: str | None = None) -> None:
        """Register, then heartbeat every `interval_s` and re-register when forgotten. Runs until cancelled;
        server trouble is logged and retried, never raised. `state()` is sent with every heartbeat;
        `on_resume(state)` gets the resume state an answer carries, `on_training_over(over)` whether
        the learner has finished (`finish`) (their errors are logged, not raised), once per resume
        id, said applied in the next heartbeat. `registered`: the caller has just registered, so
        heartbeats come first (registering a live id again means a restarted worker to the server,
        which releases that id's flow-control grants); `applied`: the resume id its answer carried,
        if the caller applied that state."""
        while True:
            try:
                if not registered:
                    answer = await self.register(worker_id, url, capabilities, policy_version())
                    registered = True
                else:
                    answer = await self.heartbeat(worker_id, policy_version(), state() if state else None,
                                                  resume_applied=applied)
                    if answer is None:
                        log.warning("reference server forgot worker %s; registering again", worker_id)
                        registered = False
                        continue
                rid = answer.get("resume_id")
                if on_resume is not None and answer.get("resume_state") is not None and rid != applied:
                    applied = rid  # said at the next heartbeat; a state that fails to apply is not retried
                    try:
                        on_resume(answer["resume_state"])
                    except Exception:  # noqa: BLE001 - a bad state must not end the heartbeats
                        log.exception("could not apply the resume state of worker %s", worker_id)
                if on_training_over is not None:
                    try:
                        on_training_over(bool(answer.get("training_over", False)))
                    except Exception:  # noqa: BLE001 - as above
                        log.exception("worker %s could not act on the end of training", worker_id)
            except (RefServerUnavailable, RefServerError) as exc:
                log.warning("registry: %s", exc)
            await asyncio.sleep(interval_s)

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health", timeout=min(5.0, self.timeout_s))).status_code == 200
        except httpx.TransportError:
            return False

    async def stats(self) -> dict[str, Any]:
        return (await self._request("GET", "/stats")).json()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRefServerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class RefServerClient:
    """For the learner and reference replicas (synchronous). Every call is bounded by `timeout_s`
    (plus the batch or lease wait) and `retries` retries of transient failures, then raises
    RefServerUnavailable."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0, retries: int = 4,
                 transport: httpx.BaseTransport | None = None):
        self.url, self.timeout_s, self.retries = url.rstrip("/"), timeout_s, retries
        self._http = httpx.Client(base_url=self.url, headers=auth_headers(token), timeout=timeout_s,
                                  transport=transport)
        self.policy = RetryPolicy(retries=retries, cap_s=5.0)
        self.last_batch_meta: dict[str, Any] = {}  # the server's notes on the last batch (versions, timings)
        self.version: int | None = None  # the last version set: batch requests repeat it (a restarted server learns it)

    def _request(self, method: str, path: str, ok: tuple[int, ...] = (200,), **kw) -> httpx.Response:
        tries = _Tries(self.policy, f"{method} {path}", ok)
        for pause in tries:
            time.sleep(pause)
            tries.judge(*_call(self._http.request, method, path, **kw))
        return tries.answer

    def get_batch(self, max_samples: int, max_tokens: int, wait_s: float | None = None,
                  min_samples: int = 1) -> list[Sample] | None:
        """The next batch (with ref_logprobs when the server has a reference), or None if nothing became
        ready within `wait_s` (default: the server's batch_wait_s). Waits for up to `min_samples`."""
        params: dict[str, Any] = {"max_samples": max_samples, "max_tokens": max_tokens, "min_samples": min_samples,
                                  "request_id": uuid.uuid4().hex}
        if self.version is not None:
            params["version"] = self.version
        if wait_s is not None:
            params["wait_s"] = wait_s
        server_wait = SERVER_MAX_BATCH_WAIT_S if wait_s is None else wait_s
        r = self._request("GET", "/batch", ok=(200, 204), params=params, timeout=self.timeout_s + server_wait)
        if r.status_code == 204:
            self.last_batch_meta = {}
            return None
        samples, extra = decode_samples(r.content, max_bytes=max(len(r.content), 1))
        self.last_batch_meta = extra.get("ref_server", {})
        return samples

    def set_version(self, version: int, restart: bool = False) -> dict[str, Any]:
        """Announce the learner's policy version (the server drops what it makes stale, and refuses
        samples claiming a newer one). `restart`: a learner starting or resuming, which took none of
        what the server delivered so far. The version is kept first: when the server cannot be
        reached, the next batch request carries it."""
        self.version = version
        return self._request("POST", "/version", json={"version": version, "restart": restart}).json()

    def finish(self, version: int) -> dict[str, Any]:
        """Say training is over at `version`: no group starts from now on, and workers stop the rollouts
        they have in flight (told in their heartbeat answers), so nothing competes with a final
        evaluation. Announcing a version again (`set_version`, a resumed learner) lifts it."""
        answer = self._request("POST", "/version", json={"version": version, "finished": True}).json()
        self.version = version
        return answer

    def workers(self) -> list[dict[str, Any]]:
        """Live workers: each {id, url, capabilities, policy_version, last_seen, state, ...}; `state` is
        the producer state of its last heartbeat (None before one), what a checkpoint saves."""
        return self._request("GET", "/workers").json()["workers"]

    def set_resume_states(self, states: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Hand the workers' producer states from a checkpoint back (worker id -> state); each worker
        takes its own once, in its next register or heartbeat answer. Returns {ok, pending}."""
        return self._request("POST", "/workers/resume", json={"states": states}).json()

    def lease_window(self, replica_id: str, max_tokens: int, wait_s: float = 5.0) -> tuple[str, list[Sample]] | None:
        """A reference replica's next window: (lease id, its samples, tokens only), or None if nothing
        was pending within `wait_s` (toolrl.refserver.replicas)."""
        r = self._request("POST", "/reference/lease", ok=(200, 204), timeout=self.timeout_s + wait_s,
                          json={"replica_id": replica_id, "max_tokens": max_tokens, "wait_s": wait_s,
                                "request_id": uuid.uuid4().hex})  # a retry gets the lease the first try took
        if r.status_code == 204:
            return None
        samples, extra = decode_samples(r.content, max_bytes=max(len(r.content), 1))
        return extra["lease"]["id"], samples

    def answer_lease(self, lease_id: str, rows: list[list[float] | None], compute_s: float) -> dict[str, Any]:
        """Post a lease's reference logprobs (None: that sample failed). RefServerError 409 when the
        lease ran out first (its window went to another taker)."""
        body = encode_ref_logprobs(rows, compute_s=round(compute_s, 6))
        return self._request("POST", f"/reference/lease/{lease_id}", content=body,
                             headers={"Content-Type": CONTENT_TYPE}).json()

    def stats(self) -> dict[str, Any]:
        return self._request("GET", "/stats").json()

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=min(5.0, self.timeout_s)).status_code == 200
        except httpx.TransportError:
            return False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RefServerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
