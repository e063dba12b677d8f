"""The reference server's HTTP API (FastAPI). See docs/REF_SERVER.md for the contract.

Bodies of /upload and /batch are the wire format of toolrl.protocol; everything else is JSON.
Every endpoint but /health requires the bearer token when one is configured.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from toolrl.config import Config
from toolrl.protocol import (CONTENT_TYPE, PayloadTooLarge, Sample, SampleTooLong, WireFormatError, decode_samples,
                             encode_samples, samples_held_bytes)
from toolrl.net import ByteBudget, bearer_auth, cap_request_bodies, install_error_handlers, read_body_capped
from toolrl.refserver import metrics
from toolrl.refserver.checks import AheadOfLearner, Refused, check_versions
from toolrl.refserver.flow import Grants
from toolrl.refserver.queue import AsyncSampleQueue, GroupTooLarge, QueueFull, SampleQueue
from toolrl.refserver.reference import Reference
from toolrl.refserver.replicas import Leases, router as replica_router
from toolrl.refserver.registry import MAX_STATE_BYTES, RegistryError, WorkerRegistry

MAX_UPLOAD_WAIT_S = 60.0  # a client may ask /upload to wait this long for space
MAX_GRANT_WAIT_S = 60.0  # ... and /grants this long for room
MAX_UPLOAD_WAITERS = 64  # uploads waiting for space at once (each holds its decoded group)
MAX_CONCURRENT_DECODES = 4  # bodies decoded at once (CPU); reading happens outside, under a deadline
BODY_BUDGET_UPLOADS = 4  # bodies held undecoded (arriving or waiting to decode): this many max_upload_bytes
INLINE_CODEC_BYTES = 256 << 10  # smaller payloads are (de)coded on the loop: a thread hop costs more


async def _off_loop(big: bool, fn, *args):
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


class Replay:
    """Answers to recent requests keyed by a client-chosen id, so a retry (after a lost response)
    gets the first answer instead of a duplicate upload or a lost batch. Bounded by count and age."""

    def __init__(self, max_entries: int, ttl_s: float):
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._done: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self.in_flight: set[str] = set()

    def get(self, key: str) -> Any | None:
        now = time.monotonic()
        while self._done and now - next(iter(self._done.values()))[0] > self.ttl_s:
            self._done.popitem(last=False)
        hit = self._done.get(key)
        return None if hit is None else hit[1]

    def put(self, key: str, value: Any) -> None:
        self._done[key] = (time.monotonic(), value)
        self._done.move_to_end(key)
        while len(self._done) > self.max_entries:
            self._done.popitem(last=False)


class RegisterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    url: str
    capabilities: dict[str, Any] = Field(default_factory=dict)
    policy_version: int = Field(0, ge=0)


class HeartbeatBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_version: int | None = Field(None, ge=0)
    state: dict[str, Any] | None = None  # the worker's producer state, kept for the learner's checkpoints
    resume_applied: str | None = Field(None, max_length=64)  # the resume id (handed back) it has applied


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # worker id -> the producer state it had at the checkpoint; the registry checks each (400, not 422)
    states: dict[str, Any]


class VersionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)
    finished: bool = False  # the learner trains no more: no group may start (until a version without it)
    # a learner (re)starting: what was delivered at this version went to one that is gone, so it uses
    # none of this version's room (flow control); without it a learner restarted at the version the
    # server holds found the room used up and waited out its batch deadline
    restart: bool = False


class GrantBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    worker_id: str = Field(min_length=1, max_length=128)
    n: int = Field(ge=1, le=1 << 16)  # one group's samples
    wait_s: float = Field(0.0, ge=0, le=MAX_GRANT_WAIT_S)
    request_id: str | None = Field(None, min_length=1, max_length=128)  # a retry gets the first answer's grant


def _busy(detail: str) -> HTTPException:
    return HTTPException(status_code=503, detail=detail, headers={"Retry-After": "1"})


def create_app(cfg: Config, *, model=None, log: logging.Logger | None = None) -> FastAPI:
    """The app for `cfg`. `model` injects an already loaded reference model (tests, benchmarks)."""
    log = log or logging.getLogger("ref_server")
    rs = cfg.ref_server
    reference = Reference(cfg, model=model, log=log)
    queue = AsyncSampleQueue(SampleQueue(rs.max_queue_samples, rs.max_queue_bytes, rs.order, rs.max_staleness),
                             max_upload_waiters=MAX_UPLOAD_WAITERS)
    # what the learner draws per version: with dynamic sampling up to max_draws batches (it leaves out
    # groups without signal and draws again); at one batch the room ran out mid-step, and no grant came
    # until a version the learner could not reach (found in review)
    draws = cfg.grpo.max_draws if cfg.grpo.dynamic_sampling else 1
    samples_per_version = cfg.learner.batch_samples * cfg.learner.sync_every * draws
    grants = Grants(samples_per_version, rs.max_staleness, rs.grant_lease_s) if rs.flow_control else None

    def expired(w) -> None:
        log.warning("worker %s (%s) expired: no heartbeat for %.0fs", w.id, w.url, rs.worker_ttl_s)
        if grants is not None and grants.release_worker(w.id):
            queue.notify()  # its groups will never come: others may start theirs

    registry = WorkerRegistry(rs.worker_ttl_s, on_expire=expired)
    leases = Leases(queue, reference, rs.replica_lease_s, log)
    uploads, batches = Replay(10_000, 600.0), Replay(8, 600.0)
    retried_batches: dict[str, asyncio.Event] = {}  # batch requests in progress -> set when a retry supersedes
    http = {"uploads_rejected": 0, "uploads_too_large": 0, "uploads_timed_out": 0, "uploads_busy": 0,
            "uploads_ahead_of_learner": 0}
    rejected_by_field: dict[str, int] = {}  # 400s for a sample's content, by the field at fault
    version_known = [False]  # has the learner announced its version since this server started?
    finished = [False]  # has the learner said it trains no more? Workers stop their rollouts then
    bodies = ByteBudget(BODY_BUDGET_UPLOADS * rs.max_upload_bytes, "upload bodies")
    started = time.monotonic()
    tasks: list[asyncio.Task] = []
    decoding = asyncio.Semaphore(MAX_CONCURRENT_DECODES)
    # What the uploads being decoded will hold (estimated from their headers): at most the queue's own
    # bound at once, so a few large groups decoding together cannot take several times that
    decoded = ByteBudget(rs.max_queue_bytes, "uploads being decoded (their size once decoded)")

    def stats() -> dict[str, Any]:
        q, ref = {**queue.core.stats(), "upload_waiters": queue.upload_waiters}, reference.stats()
        # The headline numbers also flat at the top, for loggers that take top-level numbers only.
        flat = {"queue_depth": q["samples"], "queue_ready": q["ready"], "samples_in": q["samples_in"],
                "samples_out": q["samples_out"], "dropped_stale": q["dropped_stale"],
                "stale_drop_fraction": q["stale_drop_fraction"],
                "ref_tokens_per_s": ref["tokens_per_s_last_60s"], "workers_live": len(registry)}
        if grants is not None:
            flat["flow_in_flight"] = grants.in_flight
        flat["training_over"] = finished[0]
        return {**flat, "queue": q, "reference": {**ref, **leases.stats()}, "workers": registry.stats(),
                "flow": grants.stats() if grants is not None else None,
                "http": {**http, "rejected_by_field": dict(rejected_by_field), "body_bytes_held": bodies.held},
                "uptime_s": round(time.monotonic() - started, 3)}

    async def sweep() -> None:
        while True:
            await asyncio.sleep(min(5.0, max(0.2, rs.worker_ttl_s / 4)))
            registry.expire()

    def watch(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s died: %r", task.get_name(), task.exception())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks[:] = [asyncio.create_task(reference.run(queue), name="reference"),
                    asyncio.create_task(sweep(), name="registry-sweep"),
                    asyncio.create_task(leases.sweep(), name="lease-sweep")]
        for t in tasks:
            t.add_done_callback(watch)
        log.info("reference server ready: reference=%s, queue %d samples / %d bytes, order=%s",
                 "disabled (beta=0)" if not reference.enabled else
                 cfg.model.name if reference.local else "replicas only (local_reference=false)",
                 rs.max_queue_samples, rs.max_queue_bytes, rs.order)
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            reference.close()

    # no /docs, /redoc or /openapi.json: they answered without the token (docs/REF_SERVER.md lists the API)
    app = FastAPI(title="toolrl reference server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.queue, app.state.reference, app.state.registry, app.state.stats = queue, reference, registry, stats
    install_error_handlers(app, log)
    # JSON routes: the largest legitimate body is a resume set of every worker's state. /upload
    # streams and caps its own (max_upload_bytes, under a deadline).
    cap_request_bodies(app, registry.max_workers * MAX_STATE_BYTES + (1 << 20), exempt=("/upload",),
                       token=rs.token, body_timeout_s=rs.body_timeout_s)
    # (a replica's answer, POST /reference/lease/ID, is also capped by its lease's size: replicas.router)
    auth = [Depends(bearer_auth(rs.token))]
    app.include_router(replica_router(leases, cfg), dependencies=auth)
    registry_metrics = metrics.metrics_registry(stats)

    def reject(status: int, reason: str, field: str | None = None, headers: dict | None = None) -> HTTPException:
        http[{413: "uploads_too_large", 408: "uploads_timed_out"}.get(status, "uploads_rejected")] += 1
        if field is not None:
            rejected_by_field[field] = rejected_by_field.get(field, 0) + 1
        log.warning("upload rejected (%d): %s", status, reason)
        return HTTPException(status_code=status, detail=reason, headers=headers)

    def busy(counter: str, reason: str) -> HTTPException:
        http[counter] += 1
        return _busy(reason)

    @app.post("/upload", dependencies=auth)
    async def upload(request: Request, wait_s: float = Query(0.0, ge=0, le=MAX_UPLOAD_WAIT_S)):
        upload_id = request.headers.get("x-upload-id")
        if upload_id is None:
            result = await admit(request, wait_s)
        else:
            if len(upload_id) > 128:
                raise reject(400, "X-Upload-Id is longer than 128 characters")
            if (done := uploads.get(upload_id)) is not None:
                return {**done, "duplicate": True}
            if upload_id in uploads.in_flight:
                raise _busy(f"upload {upload_id} is still being admitted; retry")
            uploads.in_flight.add(upload_id)  # no await since the checks: a concurrent retry sees it
            try:
                result = await admit(request, wait_s)
            finally:
                uploads.in_flight.discard(upload_id)
            uploads.put(upload_id, result)
        # The group's grant ends with its upload: its samples are now queued (or dropped as stale).
        # With or without an upload id (without one, the room stayed held for the grant's lease).
        grant_id = request.headers.get("x-grant-id")
        if grants is not None and grant_id and grants.release(grant_id):
            queue.notify()
        return result

    def decode_and_check(body: bytes) -> list[Sample]:
        try:
            samples, _extra = decode_samples(body, rs.max_upload_bytes, max_tokens=reference.max_len,
                                             max_samples=rs.max_queue_samples, max_held_bytes=rs.max_queue_bytes)
        except SampleTooLong as exc:  # as check_sample says it, before any list was built
            raise Refused(exc.index, "length", f"{exc.tokens} tokens, over the model's {exc.limit} positions") from None
        reference.validate(samples)
        # Reference logprobs are this server's to compute (or none, at beta 0): a client's are dropped.
        # Kept, a batch mixing samples with and without them could not be encoded, and was lost.
        return [s if s.ref_logprobs is None else s.model_copy(update={"ref_logprobs": None}) for s in samples]

    async def receive(request: Request) -> list[Sample]:
        """Read the body under its deadline and the byte budget, then decode it in one of the few
        decode slots. Reading is outside the slots: a stalled client cannot hold one."""
        body = await read_body_capped(request, rs.max_upload_bytes, timeout_s=rs.body_timeout_s, budget=bodies)
        try:
            try:
                async with asyncio.timeout(rs.body_timeout_s):
                    await decoding.acquire()
            except TimeoutError:
                raise _busy(f"no decode slot free within {rs.body_timeout_s:g}s; retry") from None
            try:
                held = await _off_loop(len(body) > INLINE_CODEC_BYTES, samples_held_bytes, body)  # a JSON parse
                if held > decoded.limit:
                    held = 0  # decode_samples refuses it from its tensors (413); it holds nothing meanwhile
                decoded.take(held)  # 503 + Retry-After while other decodes hold the bound
                try:
                    return await _off_loop(len(body) > INLINE_CODEC_BYTES, decode_and_check, body)
                finally:
                    decoded.release(held)
            finally:
                decoding.release()
        finally:
            bodies.release(len(body))

    async def admit(request: Request, wait_s: float) -> dict[str, Any]:
        ctype = request.headers.get("content-type", "")
        if ctype.startswith(("application/json", "text/")):
            raise reject(400, f"expected a {CONTENT_TYPE} body (toolrl.protocol.encode_samples), got {ctype}")
        try:
            samples = await receive(request)
            # On the loop, after any await: the learner's version as of admission.
            check_versions(samples, queue.core.learner_version, version_known[0])
        except HTTPException as exc:
            if exc.status_code == 503:
                raise busy("uploads_busy", str(exc.detail)) from None
            raise reject(exc.status_code, str(exc.detail), headers=exc.headers) from None
        except AheadOfLearner as exc:
            raise busy("uploads_ahead_of_learner", str(exc)) from None
        except Refused as exc:
            raise reject(400, f"refused upload: {exc}", field=exc.field) from None
        except PayloadTooLarge as exc:
            raise reject(413, str(exc)) from None
        except WireFormatError as exc:
            raise reject(400, f"malformed upload ({type(exc).__name__}): {exc}") from None
        except ValueError as exc:
            raise reject(400, f"unusable upload: {exc}") from None
        try:
            adm = await queue.put(samples, wait_s)
        except GroupTooLarge as exc:
            raise reject(413, str(exc)) from None
        except QueueFull as exc:
            raise _busy(str(exc)) from None
        if adm.dropped_stale:
            log.info("upload: dropped %d stale samples (learner at v%d, max_staleness %d)", adm.dropped_stale,
                     queue.core.learner_version, rs.max_staleness)
        return {"accepted": adm.accepted, "dropped_stale": adm.dropped_stale,
                "queue_samples": queue.core.samples, "learner_version": queue.core.learner_version}

    @app.get("/batch", dependencies=auth)
    async def batch(request: Request, max_samples: int = Query(64, ge=1, le=1 << 20),
                    max_tokens: int = Query(1 << 20, ge=1), min_samples: int = Query(1, ge=1),
                    wait_s: float | None = Query(None, ge=0, le=300),
                    request_id: str | None = Query(None, max_length=128),
                    version: int | None = Query(None, ge=0)):
        if version is not None:  # the learner's version, so a restarted server learns it without a push
            announce(version, forward_only=True)
        superseded = asyncio.Event()
        if request_id is not None:
            if request_id in retried_batches:
                # A retry while the first is still waiting: its client is gone (the answer was lost).
                # The first leaves at once taking nothing, unless it already took (then its answer is
                # kept for this retry); a 503 here made the learner's retries run out (found in review).
                retried_batches[request_id].set()
                queue.notify()
                try:
                    async with asyncio.timeout(rs.body_timeout_s):
                        while request_id in retried_batches:
                            await asyncio.sleep(0.005)
                except TimeoutError:
                    raise _busy(f"batch request {request_id} is still being answered; retry") from None
            if (done := batches.get(request_id)) is not None:
                return Response(done, media_type=CONTENT_TYPE)
            retried_batches[request_id] = superseded
        try:
            entries = await queue.take_batch(max_samples, max_tokens, min_samples,
                                             rs.batch_wait_s if wait_s is None else wait_s,
                                             client_gone=request.is_disconnected, abandoned=superseded.is_set)
            if not entries:
                return Response(status_code=204, headers={"X-Queue-Samples": str(queue.core.samples)})
            now = time.monotonic()
            extra = {"learner_version": queue.core.learner_version, "queue_samples": queue.core.samples,
                     "compute_s": [round(e.compute_s, 6) for e in entries],
                     "queue_s": [round(now - e.enqueued_at, 6) for e in entries]}
            big = sum(e.tokens for e in entries) > INLINE_CODEC_BYTES // 16  # ~16 wire bytes per token
            try:
                body = await _off_loop(big, lambda: encode_samples([e.sample for e in entries], ref_server=extra))
            except BaseException:  # nothing was delivered: the samples go back, not lost (nor counted out)
                queue.untake(entries)
                raise
            if request_id is not None:
                batches.put(request_id, body)
            return Response(body, media_type=CONTENT_TYPE)
        finally:
            if request_id is not None and retried_batches.get(request_id) is superseded:
                del retried_batches[request_id]

    def announce(v: int, forward_only: bool = False) -> tuple[int, int]:
        """The learner's version is `v` -> (previous, dropped stale)."""
        old, version_known[0] = queue.core.learner_version, True
        if v == old or (forward_only and v < old):
            return old, 0
        if v < old:
            log.warning("learner version went back from %d to %d (resumed from a checkpoint?)", old, v)
        dropped = queue.set_version(v)
        if dropped:
            log.info("learner v%d: dropped %d stale samples", v, dropped)
        return old, dropped

    @app.post("/version", dependencies=auth)
    async def set_version(body: VersionBody):
        old, dropped = announce(body.version)
        if body.restart:
            queue.core.restart_version()
            queue.notify()
        if body.finished != finished[0]:
            finished[0] = body.finished
            log.info("the learner %s at v%d", "finished training: no more groups start" if body.finished
                     else "trains again: groups may start", body.version)
            queue.notify()  # grant requests waiting for room look again
        return {"version": body.version, "previous": old, "dropped_stale": dropped, "finished": finished[0]}

    @app.post("/workers", dependencies=auth)
    async def register(body: RegisterBody):
        registry.expire()
        again = body.id in registry  # a live worker registers only once forgotten: this is a restart
        try:
            w = registry.register(body.id, body.url, body.capabilities, body.policy_version)
        except RegistryError as exc:
            raise HTTPException(status_code=exc.status, detail=str(exc)) from None
        if again and grants is not None and (n := grants.release_worker(body.id)):
            # the earlier incarnation's groups died with it: their grants would hold room for
            # grant_lease_s, stalling every worker when they filled the bound
            log.info("worker %s registered again: released the %d grants of its earlier run", body.id, n)
            queue.notify()
        log.info("worker %s registered at %s (policy v%d)", w.id, w.url, w.policy_version)
        return {**w.public(time.monotonic()), "ttl_s": rs.worker_ttl_s,
                "learner_version": queue.core.learner_version, "training_over": finished[0],
                **handed_back(w.id)}

    @app.post("/workers/{worker_id}/heartbeat", dependencies=auth)
    async def heartbeat(worker_id: str, body: HeartbeatBody | None = None):
        try:
            w = registry.heartbeat(worker_id, body.policy_version if body else None, body.state if body else None)
        except RegistryError as exc:
            raise HTTPException(status_code=exc.status, detail=str(exc)) from None
        if w is None:
            raise HTTPException(status_code=404, detail=f"unknown or expired worker {worker_id!r}; register again")
        if body is not None and body.resume_applied:
            registry.applied_resume(w.id, body.resume_applied)
        return {"ok": True, "ttl_s": rs.worker_ttl_s, "learner_version": queue.core.learner_version,
                "training_over": finished[0], **handed_back(w.id)}

    def handed_back(worker_id: str) -> dict[str, Any]:
        """The answer's resume_state and resume_id: the worker's state from the checkpoint, until it
        says it applied it."""
        held = registry.resume_state(worker_id)
        if held is None:
            return {"resume_state": None, "resume_id": None}
        log.info("worker %s: handed back its producer state from the checkpoint", worker_id)
        return {"resume_state": held[1], "resume_id": held[0]}

    @app.post("/workers/resume", dependencies=auth)
    async def resume(body: ResumeBody):
        try:
            pending = registry.set_resume_states(body.states)
        except RegistryError as exc:
            raise HTTPException(status_code=exc.status, detail=str(exc)) from None
        log.info("resume: %d producer states wait for their workers", pending)
        return {"ok": True, "pending": pending}

    @app.delete("/workers/{worker_id}", dependencies=auth)
    async def deregister(worker_id: str):
        if grants is not None and grants.release_worker(worker_id):
            queue.notify()
        return {"removed": registry.remove(worker_id)}

    @app.post("/grants", dependencies=auth)
    async def grant(body: GrantBody):
        """Room to start one group (toolrl.refserver.flow), waiting up to wait_s for it; 204 without.
        With flow control off every request is granted; once the learner has finished, none is."""
        if finished[0]:
            return Response(status_code=204, headers={"X-Flow-Capacity": "0"})
        if grants is None:
            return {"grant_id": None, "n": body.n}
        core = queue.core
        got: list[str | None] = [None]

        def answered() -> bool:  # room for the group, or the learner finished while we waited
            if finished[0]:
                return True
            got[0] = grants.take(body.worker_id, body.n, core.samples, core.delivered_since_version,
                                 body.request_id)
            return got[0] is not None
        if not await queue.wait_until(answered, body.wait_s) or finished[0]:
            grants.refused_total += 1
            room_left = 0 if finished[0] else grants.capacity(core.samples, core.delivered_since_version)
            return Response(status_code=204, headers={"X-Flow-Capacity": str(room_left)})
        return {"grant_id": got[0], "n": body.n}

    @app.delete("/grants/{grant_id}", dependencies=auth)
    async def give_back(grant_id: str):
        released = grants.release(grant_id) if grants is not None else False
        if released:
            queue.notify()
        return {"released": released}

    @app.get("/workers", dependencies=auth)
    async def workers():
        return {"workers": registry.live(), "learner_version": queue.core.learner_version}

    @app.get("/health")
    async def health():
        alive = bool(tasks) and not tasks[0].done()
        forward_s = reference.forward_running_s()
        stalled = forward_s > cfg.ref_server.forward_stall_s
        status = ("reference loop stopped" if not alive else f"reference forward running for {forward_s:.0f} s "
                  f"(ref_server.forward_stall_s {cfg.ref_server.forward_stall_s:g})" if stalled else "ok")
        alive = alive and not stalled
        body = {"status": status,
                "reference": cfg.model.name if reference.enabled else "disabled",
                "uptime_s": round(time.monotonic() - started, 3)}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/stats", dependencies=auth)
    async def get_stats():
        return stats()

    @app.get("/metrics", dependencies=auth)
    async def get_metrics():
        return Response(metrics.render(registry_metrics), media_type="text/plain; version=0.0.4")

    return app
