"""Reference replicas: more processes (one per GPU, on any node) computing reference logprobs for one
reference server, which keeps everything else (the HTTP API, the queue, the registry, versions, flow
control). At beta > 0 the reference forward, not the server, is what runs out first
(docs/BENCHMARKS.md, the reference server's capacity): replicas scale it.

A replica (`ref_server.py --replica-of URL`) loads the same frozen model and loops: lease the next
window of pending samples (POST /reference/lease), compute it (`Reference.compute_all`, as the
server's own loop does), post the logprobs back (POST /reference/lease/{id}). A window is whole
groups, as the server's own loop takes them. The server keeps computing windows itself unless
`ref_server.local_reference` is false (then it loads no model: a front for many reference GPUs).

Nothing is lost or delivered twice:
- a lease not answered within `ref_server.replica_lease_s` (a dead or stuck replica) goes back to
  the head of pending for the next taker; a late answer to it is refused (409) and changes nothing;
- a wrong answer (how many samples, how many logprobs each, values outside the upload checks) is
  refused (400) and its window goes back the same way;
- a sample leased MAX_LEASES times without an answer is dropped and counted (`dropped_failed`), so
  a window that kills every replica that takes it cannot circulate for ever.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from toolrl.config import Config
from toolrl.net import read_body_capped
from toolrl.protocol import CONTENT_TYPE, WireFormatError, decode_ref_logprobs, encode_samples
from toolrl.refserver.checks import Refused, check_logprobs
from toolrl.refserver.queue import AsyncSampleQueue, Entry
from toolrl.refserver.reference import WINDOW_BUDGETS, Reference

MAX_LEASES = 3  # leases of one sample without an answer before it is dropped (and counted)
MAX_LEASE_WAIT_S = 60.0  # how long POST /reference/lease may wait for pending samples


class LeaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replica_id: str = Field(min_length=1, max_length=128)
    max_tokens: int = Field(ge=1)
    wait_s: float = Field(0.0, ge=0, le=MAX_LEASE_WAIT_S)
    request_id: str | None = Field(None, min_length=1, max_length=128)  # a retry gets the first answer's lease


@dataclass
class Lease:
    id: str
    replica: str
    entries: list[Entry]
    deadline: float
    request_id: str | None = None


class Leases:
    """The server's side: windows out on lease, by lease id, and each replica's counts."""

    def __init__(self, queue: AsyncSampleQueue, reference: Reference, lease_s: float, log: logging.Logger):
        self.queue, self.reference, self.lease_s, self.log = queue, reference, lease_s, log
        self.active: dict[str, Lease] = {}
        self._by_request: dict[str, str] = {}  # an active lease's request id -> its lease id
        self.replicas: dict[str, dict] = {}
        self.expired = self.refused = self.late = 0

    def _replica(self, rid: str) -> dict:
        if rid not in self.replicas and len(self.replicas) >= 1024:  # ids are client-chosen: bound them
            oldest = min(self.replicas, key=lambda k: self.replicas[k]["last_seen"])
            del self.replicas[oldest]
        r = self.replicas.setdefault(rid, {"leases": 0, "samples": 0, "tokens": 0, "compute_s": 0.0,
                                           "failed": 0, "expired": 0, "refused": 0, "last_seen": 0.0})
        r["last_seen"] = time.monotonic()
        return r

    async def take(self, replica_id: str, max_tokens: int, wait_s: float,
                   request_id: str | None = None) -> Lease | None:
        """The next window on lease. A request repeated under the same `request_id` (its answer was
        lost) gets the lease it already holds: a second one would leave the first's window idle until
        its lease ran out, and count a lease against each of its samples."""
        self._replica(replica_id)
        if (held := self._held(request_id, replica_id)) is not None:
            return held
        window = await self.queue.take_window(max_tokens, wait_s)
        if not window:
            return None
        if (held := self._held(request_id, replica_id)) is not None:  # the first try took one meanwhile
            self.queue.requeue(window)
            return held
        for e in window:
            e.leases += 1
        lease = Lease(uuid.uuid4().hex, replica_id, window, time.monotonic() + self.lease_s, request_id)
        self.active[lease.id] = lease
        if request_id is not None:
            self._by_request[request_id] = lease.id
        self._replica(replica_id)["leases"] += 1
        return lease

    def _held(self, request_id: str | None, replica_id: str) -> Lease | None:
        lease = self.active.get(self._by_request.get(request_id, "")) if request_id is not None else None
        return lease if lease is not None and lease.replica == replica_id else None

    def _end(self, lease_id: str) -> Lease:
        lease = self.active.pop(lease_id)
        if lease.request_id is not None:
            self._by_request.pop(lease.request_id, None)
        return lease

    def answer(self, lease_id: str, rows: list[list[float] | None], compute_s: float) -> dict:
        """A replica's logprobs for its lease. Raises KeyError for a lease that is not out (expired,
        answered), Refused for a wrong answer (its window goes back to pending)."""
        lease = self._end(lease_id)
        rep = self._replica(lease.replica)
        try:
            if len(rows) != len(lease.entries):
                raise Refused(0, "samples", f"{len(rows)} answers for a lease of {len(lease.entries)} samples")
            for i, (e, r) in enumerate(zip(lease.entries, rows)):
                if r is None:
                    continue
                if len(r) != len(e.sample.completion_ids):
                    raise Refused(i, "ref_logprobs", f"{len(r)} values for {len(e.sample.completion_ids)} tokens")
                check_logprobs(i, "ref_logprobs", r)
        except Refused:
            self._refuse(lease)
            raise
        done, failed = self.reference.settle(self.queue, lease.entries, rows, compute_s)
        rep["samples"] += done
        rep["failed"] += failed
        rep["tokens"] += sum(e.tokens for e, r in zip(lease.entries, rows) if r is not None)
        rep["compute_s"] += compute_s
        return {"completed": done, "failed": failed}

    def refuse(self, lease_id: str) -> None:
        """An answer that cannot be read: counted, and its window goes back."""
        self._refuse(self._end(lease_id))

    def _refuse(self, lease: Lease) -> None:
        self.refused += 1
        self._replica(lease.replica)["refused"] += 1
        self._back(lease)

    def _back(self, lease: Lease) -> None:
        """An unanswered window: back to pending, but samples leased MAX_LEASES times are dropped."""
        spent = [e for e in lease.entries if e.leases >= MAX_LEASES]
        again = [e for e in lease.entries if e.leases < MAX_LEASES]
        if spent:
            self.log.error("dropping %d samples leased %d times without an answer (groups %s)", len(spent),
                           MAX_LEASES, sorted({e.sample.group_id for e in spent})[:5])
            self.reference.failed_total += len(spent)
            self.queue.fail(spent)
        if again:
            self.queue.requeue(again)

    def expire(self) -> int:
        now = time.monotonic()
        gone = [lease for lease in self.active.values() if lease.deadline <= now]
        for lease in gone:
            self._end(lease.id)
            self.expired += 1
            self._replica(lease.replica)["expired"] += 1
            self.log.warning("lease %s of replica %s (%d samples) ran out after %gs: back to pending",
                             lease.id, lease.replica, len(lease.entries), self.lease_s)
            self._back(lease)
        return len(gone)

    async def sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.lease_s / 4))
            self.expire()

    def stats(self) -> dict:
        now = time.monotonic()
        return {"leases_out": len(self.active), "leases_expired": self.expired, "answers_refused": self.refused,
                "answers_late": self.late, "lease_s": self.lease_s,
                "replicas": {k: {**{n: x for n, x in v.items() if n != "last_seen"},
                                 "compute_s": round(v["compute_s"], 3),
                                 "last_seen_s_ago": round(now - v["last_seen"], 1)}
                             for k, v in self.replicas.items()}}


def router(leases: Leases, cfg: Config) -> APIRouter:
    """POST /reference/lease and POST /reference/lease/{id} (the app adds the bearer token check)."""
    rs = cfg.ref_server
    api = APIRouter()

    @api.post("/reference/lease")
    async def lease(body: LeaseBody):
        if not leases.reference.enabled:
            raise HTTPException(status_code=409, detail="this server needs no reference logprobs (grpo.beta = 0)")
        got = await leases.take(body.replica_id, body.max_tokens, body.wait_s, body.request_id)
        if got is None:
            return Response(status_code=204)
        # The replica needs the tokens only: leave the text and tool calls behind.
        samples = [e.sample.model_copy(update={"text": "", "tool_calls": []}) for e in got.entries]
        payload = await asyncio.to_thread(encode_samples, samples, lease={"id": got.id, "lease_s": leases.lease_s})
        return Response(payload, media_type=CONTENT_TYPE)

    @api.post("/reference/lease/{lease_id}")
    async def answer(lease_id: str, request: Request):
        out = leases.active.get(lease_id)
        if out is None:
            leases.late += 1
            raise HTTPException(status_code=409, detail=f"lease {lease_id!r} is not out (ran out after "
                                f"{leases.lease_s:g}s, or already answered): its window went to another taker")
        limit = 64 * sum(len(e.sample.completion_ids) for e in out.entries) + (64 << 10)
        body = await read_body_capped(request, limit, timeout_s=rs.body_timeout_s)
        try:
            rows, meta = decode_ref_logprobs(body, limit)
        except WireFormatError as exc:
            if lease_id in leases.active:
                leases.refuse(lease_id)
            raise HTTPException(status_code=400, detail=f"malformed answer ({type(exc).__name__}), its window "
                                f"goes back: {exc}") from None
        if lease_id not in leases.active:  # ran out while the body arrived
            leases.late += 1
            raise HTTPException(status_code=409, detail=f"lease {lease_id!r} ran out while its answer arrived")
        compute_s = meta.get("compute_s", 0.0)
        # a replica's own report: only a finite, non-negative number of seconds counts (a NaN broke
        # /stats for good and the next batch's encoding; found in review)
        ok = isinstance(compute_s, (int, float)) and not isinstance(compute_s, bool) and 0 <= compute_s < 1e9
        try:
            return leases.answer(lease_id, rows, float(compute_s) if ok else 0.0)
        except Refused as exc:
            raise HTTPException(status_code=400, detail=f"refused answer, its window goes back: {exc}") from None

    return api


# -- the replica process ----------------------------------------------------------------------------
def _check_server(cfg: Config, url: str, stop: threading.Event, log: logging.Logger) -> None:
    """Before the model loads: the server takes our token and computes what we would, the same
    model at the same temperature. A replica configured otherwise sent wrong reference logprobs
    that no check could see, and a wrong token was a traceback after the model had loaded (found in
    review). A server not up yet is waited for."""
    from toolrl.refserver.client import RefServerClient, RefServerError, RefServerUnavailable

    with RefServerClient(url, token=cfg.ref_server.token) as client:
        while not stop.is_set():
            try:
                theirs = client.stats()["reference"]
                break
            except RefServerUnavailable as exc:
                log.warning("server unreachable: %s; trying again", exc)
                stop.wait(2.0)
            except RefServerError as exc:
                raise SystemExit(f"reference replica: the server at {url} refuses us: {exc}") from None
        else:
            return
    if not theirs.get("enabled"):
        raise SystemExit(f"reference replica: the server at {url} computes no reference logprobs (grpo.beta 0 there)")
    mine = {"model": cfg.model.name, "temperature": cfg.rollout.temperature}
    if {k: theirs.get(k) for k in mine} != mine:
        raise SystemExit(f"reference replica: the server at {url} computes with model {theirs.get('model')!r} at "
                         f"temperature {theirs.get('temperature')}, this replica with {mine['model']!r} at "
                         f"{mine['temperature']}: start it with the server's config")


def run_replica(cfg: Config, url: str, replica_id: str | None = None, stop: threading.Event | None = None,
                log: logging.Logger | None = None) -> None:
    """Lease, compute, answer, until `stop` is set. The server being away is waited out (retried, and
    logged), never fatal: a replica outlives a restart of its server."""
    from toolrl.refserver.client import RefServerClient, RefServerError, RefServerUnavailable

    log = log or logging.getLogger("ref_replica")
    if cfg.grpo.beta <= 0:
        raise SystemExit("a reference replica computes reference logprobs: it needs grpo.beta > 0")
    stop = stop or threading.Event()
    replica_id = replica_id or f"replica-{uuid.uuid4().hex[:8]}"
    _check_server(cfg, url, stop, log)
    reference = Reference(cfg.model_copy(update={"ref_server": cfg.ref_server.model_copy(
        update={"local_reference": True})}), log=log)
    max_tokens = WINDOW_BUDGETS * reference.token_budget
    log.info("reference replica %s of %s: %s, windows of up to %d tokens", replica_id, url, cfg.model.name, max_tokens)
    with RefServerClient(url, token=cfg.ref_server.token) as client:
        while not stop.is_set():
            try:
                got = client.lease_window(replica_id, max_tokens, wait_s=5.0)
            except RefServerUnavailable as exc:
                log.warning("server unreachable: %s; trying again", exc)
                stop.wait(2.0)
                continue
            if got is None:
                continue
            lease_id, samples = got
            t0 = time.perf_counter()
            rows = reference.compute_all(samples)
            try:
                client.answer_lease(lease_id, rows, time.perf_counter() - t0)
            except (RefServerError, RefServerUnavailable) as exc:  # 409: it ran out; the window went elsewhere
                log.warning("answer to lease %s not taken: %s", lease_id, exc)
