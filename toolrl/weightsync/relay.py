"""A worker's side of the fan-out tree: it relays the update it receives to its children.

One ordered sender per child forwards bucket i as soon as it is whole here, while later buckets
still arrive: the bytes this worker received (header and body: its slot file, or for a delta bucket
the delta as received), so the child checks version, order and checksum again with the normal
receiver. A delta goes down as it came: the learner plans a delta tree only of workers that loaded
its base, and a child that does not hold it refuses it (`need_full`, reported up with its error)
and gets the full update from the learner. All the senders share one `Egress` capped at the plan's
`max_mb_s`: this worker's link.

A child that fails (refuses a bucket, cannot be reached, or is silent past the hop timeout) is
reported failed, and this worker serves the child's children itself, from bucket 0 of the update:
the slot files hold the whole update until the next one. What a failed child reported about its
subtree (its own load failed but its relay finished) is kept, and those workers are not served
again.

The answer to this worker's last bucket waits for its load and for the relay, which may take a
while below (a child given up after a hop timeout, its children then served from bucket 0). So it
is a 200 whose body starts with a space every few seconds (`heartbeats`; whitespace is valid before
JSON) and ends with the answer: every sender's read timeout then catches a worker that is silent,
not a subtree that is slow, at any depth. The answer says whether this worker loaded (or its
error), and under "tree" the outcome of each worker below it.
"""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import AsyncIterator

import httpx

from toolrl.net import auth_headers
from toolrl.protocol import CONTENT_TYPE
from toolrl.weightsync.egress import Egress
from toolrl.weightsync.fanout import PLAN_HEADER, FanoutPlan, PlanNode, outcomes_of, plan_for, reported_below
from toolrl.weightsync.http import refused
from toolrl.weightsync.receiver import Update
from toolrl.weightsync.transport import WeightSyncError

log = logging.getLogger("gen_worker")


class UpstreamStopped(Exception):
    """This worker's own update stopped arriving (cut short, superseded, or silent): there is
    nothing more to relay, and this worker's parent serves its children instead."""


class Relay:
    """Relays one update (`update`, being received here) down `plan`. Started at its first bucket;
    `bucket_whole(i)` is called as each bucket lands; `report()` after the last one."""

    def __init__(self, update: Update, plan: FanoutPlan, token: str | None, name: str = ""):
        self.update, self.plan, self.token, self.name = update, plan, token, name or "worker"
        self.egress = Egress(plan.max_mb_s)
        self.whole = 0  # buckets of the update whole (verified) in their slot files here
        self.outcomes: dict[str, dict] = {}  # worker id -> its answer to the last bucket, or {"error"}
        self._changed = asyncio.Event()
        update.on_abort.append(self._notify)
        self._client = httpx.AsyncClient(timeout=plan.timeout_s)
        self.task = asyncio.create_task(self._run())

    def bucket_whole(self, index: int) -> None:
        self.whole = max(self.whole, index + 1)
        self._notify()

    def stop(self) -> None:
        """A newer update supersedes this one: stop reading its slots (before they are overwritten)."""
        self.task.cancel()

    async def report(self) -> dict[str, dict]:
        """The outcome of every worker below this one, once the relay is done. Every hop has its
        timeout, so it ends; past a last-resort bound (as the engine's load: a hop timeout per bucket,
        here per level) those not served yet are reported failed and the relay stops."""
        limit = self.plan.timeout_s * (self.update.count + 1) * (self.plan.height + 1)
        done, _ = await asyncio.wait({self.task}, timeout=limit)
        why = "a newer update superseded this one" if self.task.cancelled() else f"not within {limit:.0f}s"
        if not done:
            self.stop()
        out = dict(self.outcomes)
        for n in (n for c in self.plan.children for n in c.walk()):
            out.setdefault(n.id, {"error": f"{self.name} did not finish serving it: {why}"})
        return out

    # -- the senders ----------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await asyncio.gather(*(self._serve(c) for c in self.plan.children))
        finally:
            await self._client.aclose()

    async def _serve(self, node: PlanNode) -> None:
        """Send the whole update to `node`; if it fails, report it and serve its children instead."""
        try:
            answer = await self._send(node)
        except UpstreamStopped:
            return
        except Exception as exc:  # refused, unreachable, silent past the timeout: route around it
            self.outcomes[node.id] = {"error": str(exc), **({"need_full": True} if getattr(exc, "need_full", False)
                                                            else {})}
            reported = reported_below(node, getattr(exc, "tree", None))
            self.outcomes.update(reported)
            orphans = [c for c in node.children if c.id not in reported]
            log.warning("relay to %s failed (%s)%s", node.id, exc,
                        f"; serving its children {[c.id for c in orphans]} from here" if orphans else "")
            await asyncio.gather(*(self._serve(c) for c in orphans))
            return
        self.outcomes.update(outcomes_of(node, answer))

    async def _send(self, node: PlanNode) -> dict:
        """Every bucket of the update to one child, in order, each once it is whole here."""
        plan = plan_for(node, self.plan.timeout_s, self.plan.max_mb_s)
        u, t = self.update, self.plan.timeout_s
        answer: dict = {}
        for i in range(u.count):
            await self._whole(i)
            path = u.received[i]
            headers = {"Content-Type": CONTENT_TYPE, "Content-Length": str(path.stat().st_size),
                       PLAN_HEADER: plan.header(), **auth_headers(self.token)}
            try:  # every read and write has the hop timeout (the last answer heartbeats while it waits)
                resp = await self._client.post(f"{node.url}/update_weights", content=self._bucket_bytes(path),
                                               headers=headers, timeout=t)
            except httpx.HTTPError as exc:
                raise WeightSyncError(f"{node.id}: bucket {i + 1}/{u.count} of version {u.version}: "
                                      f"{type(exc).__name__}: {exc}") from None
            if resp.status_code != 200:
                raise refused(node.id, i, u.count, u.version, resp)
            answer = resp.json()
        if not answer.get("loaded") or answer.get("version") != u.version:
            raise WeightSyncError(f"{node.id}: did not load version {u.version}: {answer.get('error', answer)}",
                                  tree=answer.get("tree"))
        return answer

    async def _whole(self, index: int) -> None:
        """Wait until bucket `index` is whole here: at most a hop timeout without a byte of the
        update arriving (a slow, steady upstream link is waited for)."""
        loop, t = asyncio.get_running_loop(), self.plan.timeout_s
        while self.whole <= index:
            if self.update.aborted:
                raise UpstreamStopped(f"the update was cut short before bucket {index} was whole here")
            changed, idle = self._changed, loop.time() - self.update.last_byte  # both monotonic clocks
            if idle > t:
                raise UpstreamStopped(f"bucket {index} did not arrive here: no byte of the update in {t:.0f}s")
            try:
                await asyncio.wait_for(changed.wait(), t - idle)
            except asyncio.TimeoutError:
                pass  # bytes may have come meanwhile: the idle time says

    async def _bucket_bytes(self, path: Path) -> AsyncIterator[bytes]:
        """What is forwarded for a bucket: its bytes as received (Update.received), in paced chunks.
        Read through its own file handle (not the slot's mapping, which the next update may resize)."""
        with open(path, "rb") as f:
            while chunk := f.read(self.egress.chunk):
                await self.egress.apace(len(chunk))
                yield chunk

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


async def heartbeats(answer: asyncio.Future, timeout_s: float) -> AsyncIterator[bytes]:
    """The body of the answer to a relayed update's last bucket: a space every quarter of the hop
    timeout (at most 10 s) while `answer` is pending, then its JSON."""
    every = min(10.0, max(0.2, timeout_s / 4))
    while not (await asyncio.wait({answer}, timeout=every))[0]:
        yield b" "
    yield json.dumps(answer.result()).encode()
