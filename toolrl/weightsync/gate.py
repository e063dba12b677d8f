"""The worker's side of weight sync: the gate between rollouts and weight updates.

Two kinds of work pass the gate:
- Training rollouts are interruptible: each generation request runs inside `gate.segment()`. When
  an update arrives the gate closes, the requests in flight are aborted at once (each keeps the
  tokens it has, tagged with the version that generated them), the new weights load, and the
  rollouts send their next request under the new version (toolrl.worker.rollout). No update waits
  for a rollout to finish, and every token's version is recorded (toolrl.protocol.Sample.version_runs).
- Whole rollouts (held-out evaluation, inference) run inside `gate.rollout()` and are drained:
  they finish on the weights they started under; only after `drain_timeout_s` are they aborted
  and discarded.
Tokens are only ever generated with the gate open, so no token's recorded version is wrong.

If a load fails part-way the weights are a mix: `weights_ok` turns false, the gate stays closed and
/health says so until a whole update loads. Updates arrive as HTTP buckets (`receive_bucket`,
streamed into slot files by toolrl.weightsync.receiver while the engine loads them; with a fan-out
plan the worker also relays them to its children, toolrl.weightsync.relay) or by broadcast on a
joined process group (`join_group`, `receive_broadcast`; toolrl.weightsync.process_group).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from toolrl.net import wait_for
from toolrl.weightsync.fanout import FanoutPlan
from toolrl.weightsync.receiver import Update, WeightAssembler
from toolrl.weightsync.relay import Relay
from toolrl.weightsync.transport import BucketOrderError, UpdateAborted

log = logging.getLogger("gen_worker")


@dataclass
class Segment:
    """One generation request of an interruptible rollout: the version it runs under, and whether
    a weight update cut it short (its output then ends with finish_reason "abort")."""
    request_id: str
    version: int
    interrupted: bool = False


class WeightGate:
    """`engine` needs load_buckets, load_broadcast, join_group, abort and abort_all (toolrl.worker.engine).
    `token`: the rollout token, sent to the workers this one relays updates to."""

    def __init__(self, engine, assembler: WeightAssembler, drain_timeout_s: float, sync_timeout_s: float,
                 on_loaded: Callable[[int, float], None] = lambda version, reload_s: None, name: str = "",
                 token: str | None = None):
        self.engine, self.assembler, self.name, self.token = engine, assembler, name, token
        self.relay: Relay | None = None  # the current update's, when its plan names children
        self.drain_timeout_s, self.sync_timeout_s = drain_timeout_s, sync_timeout_s
        self.on_loaded = on_loaded
        self.version = 0
        self.weights_ok = True  # False after a load failed part-way: the weights are a mix
        self.phase: str | None = None  # "draining" | "loading" while an update is under way
        self.group: str | None = None  # the learner's process group joined
        self.inflight = 0  # whole rollouts
        self.segments: dict[str, Segment] = {}  # requests of interruptible rollouts, by request id
        self.interrupted = 0  # requests cut short by an update, in all
        self.tasks: set[asyncio.Task] = set()  # rollout tasks, cancelled when a drain times out
        self._idle = asyncio.Event()
        self._idle.set()
        self._no_segments = asyncio.Event()
        self._no_segments.set()
        self._open = asyncio.Event()  # cleared while an update drains and loads
        self._open.set()
        self._lock = asyncio.Lock()

    # -- the rollouts' side ----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def rollout(self, wait_s: float | None = None) -> AsyncIterator[int]:
        """Run rollouts inside this: held back while an update loads, drained before it loads.
        Yields the policy version they run under. `wait_s`: the longest to be held back (then
        TimeoutError); None: as long as it takes."""
        await asyncio.wait_for(self._open.wait(), wait_s)
        self.inflight += 1
        self._idle.clear()
        try:
            yield self.version
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def segment(self, request_id: str) -> AsyncIterator[Segment]:
        """One request of an interruptible rollout: waits while an update is under way, then runs
        under the version loaded; an update that arrives meanwhile aborts it and waits for it to leave."""
        await self._open.wait()
        seg = self.segments[request_id] = Segment(request_id, self.version)
        self._no_segments.clear()
        try:
            yield seg
        finally:
            del self.segments[request_id]
            if not self.segments:
                self._no_segments.set()

    def track(self, task: asyncio.Task) -> None:
        """A task whose rollouts should be cancelled, not awaited, when a drain times out."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- HTTP buckets ---------------------------------------------------------------------------
    async def receive_bucket(self, chunks: AsyncIterator[bytes],
                             plan: FanoutPlan | None = None) -> dict | asyncio.Future:
        """One bucket of an update (POST /update_weights), streamed to a file as it arrives. The
        first bucket starts the load (and, when `plan` names children, the relay to them); the
        answer to the last one waits for the load. For a relayed update that answer is a future
        (the route heartbeats while it waits; toolrl.weightsync.relay.heartbeats)."""
        bucket, update = await self.assembler.receive(chunks, lambda: self.version, lambda u: self._start(u, plan),
                                                      tag=plan.tag if plan else None)
        relay = self.relay if self.relay is not None and self.relay.update is update else None
        if relay is not None:
            relay.bucket_whole(bucket.index)
        if not bucket.last:
            return {"version": bucket.version, "loaded": False, "received": bucket.index + 1, "of": bucket.count}
        if update.task is None:
            raise UpdateAborted(f"version {bucket.version} has no load under way")
        if relay is None:
            return await asyncio.shield(update.task)  # a dropped connection must not cancel the load
        return asyncio.ensure_future(self._answer_with_tree(update, relay))

    async def _answer_with_tree(self, update: Update, relay: Relay) -> dict:
        """This worker's answer (or its error) and, under "tree", the outcomes below it: those go up
        even when this worker's own load failed, since its slots were whole for the relay."""
        try:
            answer = await asyncio.shield(update.task)
        except Exception as exc:
            log.error("loading version %d failed: %s", update.version, exc)
            answer = {"version": update.version, "loaded": False, "worker_id": self.name,
                      "error": f"loading the weight update failed: {type(exc).__name__}: {exc}"}
        return {**answer, "tree": await relay.report()}

    def _start(self, update: Update, plan: FanoutPlan | None) -> None:
        """A new update: it supersedes what is left of the last one's relay, which must stop reading
        the slot files before this update overwrites them."""
        if self.relay is not None:
            self.relay.stop()
        self.relay = Relay(update, plan, self.token, self.name) if plan is not None and plan.children else None
        self._start_load(update)

    def _start_load(self, update: Update) -> None:
        async def load() -> float:
            return await self.engine.load_buckets(str(update.dir), update.id, update.count, self.sync_timeout_s)

        async def run() -> dict:
            try:
                return await self.swap(update.version, load, lambda: update.aborted)
            except BaseException:
                update.abort()
                raise
            finally:
                self.assembler.discard(update)

        update.task = asyncio.create_task(run())
        update.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # errors reach the last bucket

    # -- a process group ------------------------------------------------------------------------
    async def join_group(self, spec: dict) -> None:
        """Join the learner's process group; it replaces any other."""
        self.group = None
        await self.engine.join_group(spec)
        self.group = spec["group_id"]

    async def receive_broadcast(self, group_id: str, version: int, push_id: str, specs: list) -> dict:
        """A whole update by broadcast on the joined group; answers after the load."""
        if version < self.version:
            raise BucketOrderError(f"version {version} is older than the loaded {self.version}")
        if group_id != self.group:  # refused before the drain: the weights stay whole
            raise BucketOrderError(f"not a member of process group {group_id!r}: join it first")

        async def load() -> float:
            return await self.engine.load_broadcast(group_id, push_id, specs, self.sync_timeout_s)

        return await self.swap(version, load)

    # -- the swap -------------------------------------------------------------------------------
    async def _interrupt(self) -> int:
        """Abort every interruptible request in flight and wait until each has left its segment
        (the engine answers an abort with the tokens so far). Aborts are repeated, and each round
        marks what is in flight then: a request that had not reached the engine yet is missed by the
        first, and one whose wait on the gate ended just before it closed enters its segment late."""
        cut: set[str] = set()
        deadline = time.time() + self.drain_timeout_s
        while self.segments:
            for seg in self.segments.values():
                seg.interrupted = True
            cut.update(self.segments)
            await self.engine.abort(list(self.segments))
            try:
                await asyncio.wait_for(self._no_segments.wait(), 0.25)
            except asyncio.TimeoutError:
                if time.time() > deadline:
                    raise TimeoutError(f"{len(self.segments)} generation requests did not stop within "
                                       f"{self.drain_timeout_s:.0f}s of being aborted") from None
        self.interrupted += len(cut)
        return len(cut)

    async def swap(self, version: int, load: Callable[[], Awaitable[float]], aborted=lambda: False) -> dict:
        """Close the gate, interrupt the interruptible requests and drain the whole rollouts in
        flight, `load()` the new weights in place and move the version. If the load fails part-way
        the gate stays closed until a whole update loads."""
        async with self._lock:  # an earlier update, superseded, finishes failing first
            self._open.clear()
            t0, loading = time.time(), False
            self.phase = "draining"
            try:
                if aborted():
                    raise UpdateAborted(f"version {version} was superseded")
                interrupted = await self._interrupt()
                try:
                    await asyncio.wait_for(self._idle.wait(), self.drain_timeout_s)
                except asyncio.TimeoutError:
                    for task in list(self.tasks):  # rollouts between segments would resubmit
                        task.cancel()
                    n = await self.engine.abort_all()
                    log.warning("drain timed out after %.0fs; aborted %d groups (%d requests)",
                                time.time() - t0, len(self.tasks), n)
                    await wait_for(self._idle.wait(), 60, "aborting in-flight rollouts")
                drain_s = time.time() - t0
                if aborted():
                    raise UpdateAborted(f"version {version} was superseded")
                loading, self.weights_ok, self.phase = True, False, "loading"
                reload_s = await load()
                self.version, self.weights_ok = version, True
                self.on_loaded(version, reload_s)
                log.info("loaded policy version %d (drain %.2fs, %d requests interrupted; load %.2fs)",
                         version, drain_s, interrupted, reload_s)
                return {"version": version, "loaded": True, "drain_s": drain_s, "reload_s": reload_s,
                        "interrupted": interrupted, "worker_id": self.name}
            except BaseException as exc:
                if loading:
                    log.error("loading version %d failed part-way (%s); no rollouts until a whole update loads",
                              version, exc)
                raise
            finally:
                self.phase = None
                if self.weights_ok:
                    self._open.set()
