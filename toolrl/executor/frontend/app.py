"""The executor's HTTP front end (FastAPI). It never forks: runners come from the fork server.

POST /execute           ExecRequest -> ExecResult
POST /execute_batch     BatchRequest -> BatchResponse, results in the order of the items
GET  /health            HealthResponse (503 while the fork server is down)
DELETE /sessions/{id}   {"deleted": bool}

Errors: 400 body is not JSON, 422 it does not validate or asks for more than the server allows,
413 body over executor.max_request_bytes, 401 missing/wrong bearer token, 429 queue full and 503
fork server down, every session busy, or no memory for a new session (both with Retry-After).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from toolrl.config import ExecutorConfig
from toolrl.executor.api import BatchRequest, BatchResponse, ExecRequest, ExecResult, HealthResponse
from toolrl.executor.frontend.forkserver_link import ForkServerDown, ForkServerLink, QueueFull
from toolrl.executor.frontend.session_ids import SessionManager, SessionsFull
from toolrl.executor.ipc import EXECUTOR_CAUSED
from toolrl.net import BODY_TIMEOUT_S, bearer_auth, install_error_handlers, read_body_capped, require_bearer

log = logging.getLogger("toolrl.executor")


class LimitError(ValueError):
    pass


class Executor:
    """Validation, admission and sessions around the fork server."""

    def __init__(self, cfg: ExecutorConfig):
        self.cfg = cfg
        self.forkserver = ForkServerLink(cfg, on_restart=self._on_restart)
        self.sessions = SessionManager(cfg.max_sessions, cfg.session_ttl_s, self._kill_session)
        self.withdrawn = 0  # executions withdrawn because their client disconnected first

    def _kill_session(self, index: int, note: str) -> None:
        self.forkserver.send({"op": "kill_session", "session": index, "note": note})

    def _on_restart(self) -> None:
        self.sessions.reset_all("the executor's fork server restarted; the session's state was lost")

    async def expiry_loop(self) -> None:
        period = min(5.0, max(0.05, self.cfg.session_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            self.sessions.expire()

    def job(self, req: ExecRequest, where: str) -> dict:
        c = self.cfg
        timeout = c.timeout_s if req.timeout_s is None else req.timeout_s
        memory = c.memory_mb if req.memory_mb is None else req.memory_mb
        if timeout > c.max_timeout_s:
            raise LimitError(f"{where}timeout_s={timeout:g} is over this server's limit of "
                             f"{c.max_timeout_s:g}")
        if memory > c.max_memory_mb:
            raise LimitError(f"{where}memory_mb={memory} is over this server's limit of {c.max_memory_mb}")
        return {"code": req.code, "stdin": req.stdin, "timeout": float(timeout), "memory_mb": int(memory)}

    async def run(self, reqs: list[ExecRequest], batch: bool) -> list[ExecResult]:
        """Run requests; raises HTTPException for everything the caller should see as an HTTP error."""
        try:
            jobs = [self.job(r, f"items[{i}]." if batch else "") for i, r in enumerate(reqs)]
            self.forkserver.admit(len(jobs))
        except LimitError as exc:
            raise HTTPException(422, str(exc)) from None
        except QueueFull as exc:
            raise HTTPException(429, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
        except ForkServerDown as exc:
            raise HTTPException(503, str(exc), headers={"Retry-After": "1"}) from None
        try:
            plain = [i for i, r in enumerate(reqs) if r.session_id is None]
            out: list[ExecResult | None] = [None] * len(reqs)

            async def run_plain():
                items = await self.forkserver.run([jobs[i] for i in plain]) if plain else []
                for i, item in zip(plain, items):
                    out[i] = _result(item, None)

            async def run_session(i: int):
                out[i] = await self._run_session(reqs[i].session_id, jobs[i], reqs[i].session_continues)

            # tasks start in item order, so blocks of one session take its lock in item order
            await asyncio.gather(run_plain(), *(run_session(i) for i, r in enumerate(reqs) if r.session_id))
            return out  # type: ignore[return-value]
        except (ForkServerDown, SessionsFull) as exc:
            raise HTTPException(503, str(exc), headers={"Retry-After": "1"}) from None
        except asyncio.TimeoutError as exc:
            raise HTTPException(503, f"timed out waiting for results: {exc}",
                                headers={"Retry-After": "5"}) from None
        finally:
            self.forkserver.release(len(jobs))

    async def _run_session(self, sid: str, job: dict, continues: bool = False) -> ExecResult:
        while True:
            s = self.sessions.acquire(sid, continues)
            s.busy += 1
            try:
                await asyncio.wait_for(s.lock.acquire(), self.cfg.max_wait_s)
                try:
                    if not s.alive:
                        continue  # it ended while we waited for it: acquire again (a new session)
                    reset, s.pending_reset = s.pending_reset, None
                    fresh, s.fresh = s.fresh, False
                    [item] = await self.forkserver.run([dict(job, session=s.index, fresh=fresh)])
                    if item.get("refused"):  # no memory for its process: as if it had never started
                        self.sessions.refused(s, reset or item.get("reset"))
                        raise SessionsFull(item["refused"])
                finally:
                    s.lock.release()
            finally:
                s.busy -= 1
                s.last_used = time.monotonic()
            if item.get("lost"):
                self.sessions.lost(s, item["lost"])
            return _result(item, reset)


def _result(item: dict, reset: str | None) -> ExecResult:
    reset = reset or item.get("reset")
    lost = item.get("lost")
    notes = [f"session was reset: {reset}" if reset else None,
             f"session state lost: {lost}" if lost else None]
    note = "; ".join(n for n in notes if n) or None
    fault = bool(item.get("fault")) or any(n is not None and n.startswith(EXECUTOR_CAUSED) for n in (reset, lost))
    return ExecResult(**item["result"], session_reset=bool(reset), session_note=note, executor_fault=fault)


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is read: the server's next message is that)."""
    with contextlib.suppress(Exception):  # a receive that fails: the client is as good as gone
        while (await request.receive())["type"] != "http.disconnect":
            pass


def _parse(model, body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        if any(e["type"] == "json_invalid" for e in errs):
            raise HTTPException(400, f"request body is not valid JSON: {errs[0]['msg']}") from None
        msgs = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errs[:5]]
        raise HTTPException(422, "invalid request: " + "; ".join(msgs)) from None


def log_isolation(hello: dict, cfg: ExecutorConfig) -> None:
    iso = hello["isolation"]
    log.info("executor isolation: namespaces %s; uid drop %s; cgroups %s; filesystem %s",
             iso.get("namespaces"), iso.get("uid_drop"), iso.get("cgroups"), iso.get("filesystem"))
    log.info("executor memory bound: %s", iso.get("memory"))
    for item in iso.get("missing", []):
        log.warning("!!! ISOLATION MISSING !!! %s", item)
    for item in iso.get("warnings", []):
        log.warning("executor isolation: %s", item)
    for item in iso.get("preimport_missing", []):
        log.warning("could not pre-import %s (runners will import it on first use, if at all)", item)
    if hello.get("workers") != cfg.workers:
        log.warning("running %s slot(s), not executor.workers=%d (see the missing isolation above)",
                    hello.get("workers"), cfg.workers)
    if iso.get("missing") and cfg.strict_isolation:
        raise RuntimeError("executor.strict_isolation is set and isolation is missing: "
                           + "; ".join(iso["missing"]))


def create_app(cfg: ExecutorConfig) -> FastAPI:
    ex = Executor(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        hello = await ex.forkserver.start()
        try:
            log_isolation(hello, cfg)
        except RuntimeError:
            await ex.forkserver.stop()
            raise
        expiry = asyncio.create_task(ex.expiry_loop())
        gc.collect()
        gc.freeze()  # start-up objects (FastAPI, pydantic) never rescanned: no long GC pauses in p99
        log.info("executor ready: %d slot(s), queue %d, sessions %d", hello["workers"], cfg.max_queue,
                 cfg.max_sessions)
        try:
            yield
        finally:
            expiry.cancel()
            await ex.forkserver.stop()

    app = FastAPI(title="toolrl executor", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.executor = ex
    install_error_handlers(app, log)
    auth = [Depends(bearer_auth(cfg.token))]

    async def authorize(request: Request) -> None:
        """The shared bearer check, called directly: FastAPI's dependency solving cost ~0.45 ms of
        CPU per request, half the front end's share of a trivial execution."""
        require_bearer(request, cfg.token)

    async def run_for(request: Request, reqs: list[ExecRequest], batch: bool) -> list[ExecResult]:
        """ex.run, withdrawn if the client disconnects first: its executions would hold queue slots and
        workers for nobody until they ended (up to their time limit)."""
        run = asyncio.ensure_future(ex.run(reqs, batch))
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait((run, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not run.done():
                run.cancel()
        if not run.done() or run.cancelled():
            with contextlib.suppress(asyncio.CancelledError, HTTPException):
                await run
            ex.withdrawn += len(reqs)
            log.info("client went away: withdrew %d execution(s)", len(reqs))
            raise HTTPException(499, "client closed the request")  # nobody reads it
        return run.result()

    # The two hot endpoints are plain Starlette routes (same errors, same JSON), the rest FastAPI.
    async def execute(request: Request) -> Response:
        await authorize(request)
        req = _parse(ExecRequest, await read_body_capped(request, cfg.max_request_bytes, BODY_TIMEOUT_S))
        [res] = await run_for(request, [req], batch=False)
        return Response(res.model_dump_json(), media_type="application/json")

    async def execute_batch(request: Request) -> Response:
        await authorize(request)
        req = _parse(BatchRequest, await read_body_capped(request, cfg.max_request_bytes, BODY_TIMEOUT_S))
        if len(req.items) > cfg.max_queue:
            raise HTTPException(413, f"batch of {len(req.items)} items is over "
                                     f"executor.max_queue={cfg.max_queue}; split it")
        results = await run_for(request, req.items, batch=True) if req.items else []
        return Response(BatchResponse(results=results).model_dump_json(), media_type="application/json")

    app.add_route("/execute", execute, methods=["POST"])
    app.add_route("/execute_batch", execute_batch, methods=["POST"])

    @app.get("/health", dependencies=auth)
    async def health() -> JSONResponse:
        b = ex.forkserver
        hello = b.hello or {}
        body = HealthResponse(ok=b.ready, workers=hello.get("workers", 0), queued=b.admitted,
                              max_queue=cfg.max_queue, sessions=len(ex.sessions),
                              isolation=hello.get("isolation", {}), uids=hello.get("uids", {}),
                              forkserver_pid=b.proc.pid if b.proc else None, restarts=b.restarts,
                              withdrawn=ex.withdrawn,
                              memory=b.memory_status())
        return JSONResponse(body.model_dump(), status_code=200 if b.ready else 503)

    @app.delete("/sessions/{session_id:path}", dependencies=auth)
    async def delete_session(session_id: str) -> dict:
        return {"deleted": ex.sessions.delete(session_id)}

    return app
