"""The bounded sample queue between uploads, the reference model and the learner.

Every sample held (waiting for reference logprobs, being computed, or ready for the learner)
counts against both bounds: `max_samples` and `max_bytes` (an estimate of its resident Python
size, not its wire size, since memory is what the bound protects). A group is admitted whole or
not at all. Samples leave only by delivery, by the staleness rule or by a reference failure, and
each way is counted.

Order: "fifo" delivers in upload order; "newest" delivers the newest upload first. The reference
loop takes windows of pending samples in that same order and completes a window all at once, so
the ready set never holds a later sample while an earlier one is still computing.

`SampleQueue` is the synchronous core (no locks: it is only touched from the event loop thread).
`AsyncSampleQueue` adds the waits: uploads that wait their turn for space (fair, first come first
served, a bounded number of waiters) and learners that wait for ready samples, each with a timeout.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from toolrl.protocol import Sample, held_bytes


def sample_nbytes(s: Sample) -> int:
    """Estimated resident bytes of a Sample once decoded and held, ref_logprobs included: an upper bound
    on what tracemalloc measures (tests/refserver/test_ref_server_queue.py), within ~3x of it.

    Every field counts, since whatever a client can make the server hold must count against the bound:
    per token the protocol's held_bytes (~40 B for an id held in a list, 8 B for a mask entry, 32 B
    per float: logprobs, then ref_logprobs); strings at their stored size (sys.getsizeof is O(1) for
    a str and knows 1, 2 or 4 bytes per character); per reward and per tool call the dict entry, float
    and model-object overhead; per version run its tuple, two ints and list slot. The base covers the
    model object, its field dict, the empty lists, the fixed-size fields (FIXED_SIZE_FIELDS) and the
    queue entry."""
    p, c = len(s.prompt_ids), len(s.completion_ids)
    n = SAMPLE_BASE_BYTES + held_bytes(p, c)
    n += VERSION_RUN_BYTES * len(s.version_runs)
    n += _str_bytes(s.group_id) + _str_bytes(s.sample_id) + _str_bytes(s.text) + _str_bytes(s.stop_reason)
    n += sum(_str_bytes(k) + REWARD_ENTRY_BYTES for k in s.rewards)
    n += sum(TOOL_CALL_BYTES + _str_bytes(t.code) + _str_bytes(t.status) + _str_bytes(t.output) for t in s.tool_calls)
    return n


SAMPLE_BASE_BYTES = 3072
REWARD_ENTRY_BYTES = 128  # dict slot and index (~40 B grown), the float (24 B), the key's pointer
TOOL_CALL_BYTES = 640  # a ToolCall: the object, its __dict__ and fields-set, its list slot
# A (first token, version) run: the 2-tuple (56 B), two ints (32 B each below 2**60: indices are below
# the completion's length and versions at most the learner's by the time a sample is queued) and its
# list slot. tracemalloc measured 115-122 B a run.
VERSION_RUN_BYTES = 128
# How sample_nbytes counts each field of Sample; the two sets must cover Sample.model_fields exactly
# (tests/refserver/test_ref_server_queue.py fails otherwise), so that a new field cannot go uncounted
# unnoticed. Fixed-size fields are in SAMPLE_BASE_BYTES: floats, a bounded int, one of a few literals.
FIXED_SIZE_FIELDS = frozenset({"reward", "advantage", "policy_version", "source"})
SIZED_FIELDS = frozenset({"prompt_ids", "completion_ids", "loss_mask", "logprobs", "ref_logprobs", "rewards",
                          "group_id", "sample_id", "version_runs", "stop_reason", "tool_calls", "text"})
_str_bytes = sys.getsizeof


class QueueFull(Exception):
    """No room for the group now; retry later (HTTP 503)."""


class GroupTooLarge(Exception):
    """The group can never fit in this queue (HTTP 413)."""


@dataclass
class Entry:
    seq: int
    group: int  # upload number: groups are admitted, computed and (in order) delivered whole
    sample: Sample
    nbytes: int
    tokens: int
    enqueued_at: float
    compute_s: float = 0.0  # reference time of the window this sample was computed in
    leases: int = 0  # times a reference replica leased it (toolrl.refserver.replicas)


@dataclass
class Admission:
    accepted: int
    dropped_stale: int


@dataclass
class Counters:
    samples_in: int = 0
    samples_out: int = 0
    dropped_stale: int = 0
    dropped_failed: int = 0
    policy_in: int = 0  # policy samples received (the only kind that can go stale)
    groups_in: int = 0
    rejected_full: int = 0  # uploads answered "full" (503)
    waited_full: int = 0  # uploads that found the queue full and waited for space
    high_water_samples: int = 0
    high_water_bytes: int = 0
    staleness: dict[int, int] = field(default_factory=dict)  # learner_version - policy_version at delivery


class SampleQueue:
    def __init__(self, max_samples: int, max_bytes: int, order: str = "fifo", max_staleness: int = 4,
                 clock: Callable[[], float] = time.monotonic):
        if order not in ("fifo", "newest"):
            raise ValueError(f"order must be fifo or newest, got {order!r}")
        self.max_samples, self.max_bytes, self.order = max_samples, max_bytes, order
        self.max_staleness = max_staleness
        self.learner_version = 0
        self.clock = clock
        self.counters = Counters()
        self._seq = itertools.count()
        self._groups = itertools.count()
        self._pending: deque[list[Entry]] = deque()  # whole groups, ascending upload number
        self._npending = 0
        self._computing: dict[int, Entry] = {}
        self._ready: list[tuple[tuple[int, ...], Entry]] = []  # heap keyed by delivery priority
        self.samples = 0
        self.nbytes = 0
        self._out_at_version = 0  # samples_out when the learner's version last moved

    @property
    def delivered_since_version(self) -> int:
        """Samples the learner took since its version last moved (its current version's share)."""
        return self.counters.samples_out - self._out_at_version

    # -- capacity ----------------------------------------------------------------------------
    def fits(self, n: int, nbytes: int) -> bool:
        return self.samples + n <= self.max_samples and self.nbytes + nbytes <= self.max_bytes

    def check_admissible(self, n: int, nbytes: int) -> None:
        if n > self.max_samples or nbytes > self.max_bytes:
            raise GroupTooLarge(f"a group of {n} samples (~{nbytes} bytes held) can never fit in a queue of "
                                f"{self.max_samples} samples / {self.max_bytes} bytes; upload smaller groups")

    def is_stale(self, s: Sample) -> bool:
        # Teacher samples are off-policy by design; the staleness rule is about policy lag.
        return s.source == "policy" and s.policy_version < self.learner_version - self.max_staleness

    # -- in ----------------------------------------------------------------------------------
    def put(self, samples: list[Sample]) -> Admission:
        """Admit a group whole (minus stale samples, which are dropped and counted) or raise QueueFull."""
        fresh = [s for s in samples if not self.is_stale(s)]
        dropped = len(samples) - len(fresh)
        sizes = [sample_nbytes(s) for s in fresh]
        self.check_admissible(len(fresh), sum(sizes))
        if not self.fits(len(fresh), sum(sizes)):
            self.counters.rejected_full += 1
            raise QueueFull(f"queue full: {self.samples}/{self.max_samples} samples, "
                            f"{self.nbytes}/{self.max_bytes} bytes held")
        now = self.clock()
        if fresh:
            g = next(self._groups)
            self._pending.append([Entry(next(self._seq), g, s, nb, s.num_tokens, now) for s, nb in zip(fresh, sizes)])
            self._npending += len(fresh)
        self.samples += len(fresh)
        self.nbytes += sum(sizes)
        self.counters.samples_in += len(samples)  # received: in = out + dropped + held, always
        self.counters.policy_in += sum(s.source == "policy" for s in samples)
        self.counters.dropped_stale += dropped
        self.counters.groups_in += 1
        self.counters.high_water_samples = max(self.counters.high_water_samples, self.samples)
        self.counters.high_water_bytes = max(self.counters.high_water_bytes, self.nbytes)
        return Admission(len(fresh), dropped)

    # -- the reference loop ------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return self._npending

    def take_pending(self, max_tokens: int) -> list[Entry]:
        """The next window in delivery order: whole groups up to `max_tokens` (at least one group)."""
        self._drop_stale_pending()
        window, tokens = [], 0
        while self._pending:
            group = self._pending[0] if self.order == "fifo" else self._pending[-1]
            size = sum(e.tokens for e in group)
            if window and tokens + size > max_tokens:
                break
            (self._pending.popleft if self.order == "fifo" else self._pending.pop)()
            self._npending -= len(group)
            for e in group:
                self._computing[e.seq] = e
            window.extend(group)
            tokens += size
        return window

    def complete(self, entries: list[Entry], ref_logprobs: list[list[float]] | None, compute_s: float = 0.0) -> None:
        for i, e in enumerate(entries):
            del self._computing[e.seq]
            if ref_logprobs is not None:
                e.sample = e.sample.model_copy(update={"ref_logprobs": ref_logprobs[i]})
            e.compute_s = compute_s
            # newest: later uploads first, a group's own samples still in their order
            heapq.heappush(self._ready, ((e.seq,) if self.order == "fifo" else (-e.group, e.seq), e))

    def requeue(self, entries: list[Entry]) -> None:
        """A leased window back uncomputed (its replica died, or answered wrongly): its groups go back
        to the head of pending, in their order, to be taken next."""
        groups: dict[int, list[Entry]] = {}
        for e in sorted(entries, key=lambda e: e.seq):
            del self._computing[e.seq]
            groups.setdefault(e.group, []).append(e)
        ordered = [groups[g] for g in sorted(groups)]
        if self.order == "fifo":  # taken from the left, oldest first
            self._pending.extendleft(reversed(ordered))
        else:  # "newest": taken from the right
            self._pending.extend(ordered)
        self._npending += len(entries)

    def fail(self, entries: list[Entry]) -> None:
        """Samples the reference could not compute: removed and counted (the caller logs them)."""
        for e in entries:
            del self._computing[e.seq]
            self._release(e)
        self.counters.dropped_failed += len(entries)

    # -- out ---------------------------------------------------------------------------------
    @property
    def ready(self) -> int:
        return len(self._ready)

    def take_ready(self, max_samples: int, max_tokens: int) -> list[Entry]:
        """Up to `max_samples` ready samples whose tokens sum to at most `max_tokens`, in delivery order.
        A single sample larger than `max_tokens` is returned alone rather than blocking the queue."""
        out, tokens = [], 0
        while self._ready and len(out) < max_samples:
            e = self._ready[0][1]
            if self.is_stale(e.sample):
                heapq.heappop(self._ready)
                self._release(e)
                self.counters.dropped_stale += 1
                continue
            if out and tokens + e.tokens > max_tokens:
                break
            heapq.heappop(self._ready)
            self._release(e)
            out.append(e)
            tokens += e.tokens
            lag = max(0, self.learner_version - e.sample.policy_version)
            self.counters.staleness[lag] = self.counters.staleness.get(lag, 0) + 1
        self.counters.samples_out += len(out)
        return out

    def untake(self, entries: list[Entry]) -> None:
        """Samples taken but never delivered (their batch could not be sent): ready again, first in
        line, and no longer counted out."""
        for e in entries:
            heapq.heappush(self._ready, ((e.seq,) if self.order == "fifo" else (-e.group, e.seq), e))
            self.samples += 1
            self.nbytes += e.nbytes
            lag = max(0, self.learner_version - e.sample.policy_version)
            self.counters.staleness[lag] -= 1
        self.counters.samples_out -= len(entries)

    # -- the learner's version ---------------------------------------------------------------
    def restart_version(self) -> None:
        """A learner (re)started at the current version: nothing delivered so far counts as its share."""
        self._out_at_version = self.counters.samples_out

    def set_version(self, version: int) -> int:
        """Record the learner's policy version and drop what it makes stale. Returns the number dropped."""
        before = self.counters.dropped_stale
        if version != self.learner_version:
            self._out_at_version = self.counters.samples_out
        self.learner_version = version
        self._drop_stale_pending()
        keep = [(k, e) for k, e in self._ready if not self.is_stale(e.sample)]
        for _, e in self._ready:
            if self.is_stale(e.sample):
                self._release(e)
                self.counters.dropped_stale += 1
        heapq.heapify(keep)
        self._ready = keep
        return self.counters.dropped_stale - before

    def _drop_stale_pending(self) -> None:
        if not any(self.is_stale(e.sample) for g in self._pending for e in g):
            return
        keep: deque[list[Entry]] = deque()
        for group in self._pending:
            fresh = [e for e in group if not self.is_stale(e.sample)]
            for e in group:
                if self.is_stale(e.sample):
                    self._release(e)
                    self.counters.dropped_stale += 1
                    self._npending -= 1
            if fresh:
                keep.append(fresh)
        self._pending = keep

    def _release(self, e: Entry) -> None:
        self.samples -= 1
        self.nbytes -= e.nbytes

    def stats(self) -> dict:
        c = self.counters
        return {"samples": self.samples, "bytes": self.nbytes, "pending": self._npending,
                "computing": len(self._computing), "ready": len(self._ready),
                "max_samples": self.max_samples, "max_bytes": self.max_bytes, "order": self.order,
                "max_staleness": self.max_staleness, "learner_version": self.learner_version,
                "samples_in": c.samples_in, "samples_out": c.samples_out, "groups_in": c.groups_in,
                "dropped_stale": c.dropped_stale, "dropped_failed": c.dropped_failed, "policy_in": c.policy_in,
                "stale_drop_fraction": round(c.dropped_stale / max(1, c.policy_in), 4),
                "rejected_full": c.rejected_full, "waited_full": c.waited_full,
                "high_water_samples": c.high_water_samples, "high_water_bytes": c.high_water_bytes,
                "staleness_at_delivery": {str(k): v for k, v in sorted(c.staleness.items())}}


class AsyncSampleQueue:
    """`SampleQueue` plus timed waits. Every method runs on the event loop thread."""

    def __init__(self, core: SampleQueue, max_upload_waiters: int = 64, max_waiting_bytes: int | None = None):
        self.core = core
        self.max_upload_waiters = max_upload_waiters
        # Waiting uploads hold their decoded groups too: bound them, so held + waiting <= 1.5 x max_bytes.
        self.max_waiting_bytes = core.max_bytes // 2 if max_waiting_bytes is None else max_waiting_bytes
        self._waiting_bytes = 0
        self._changed = asyncio.Event()
        self._waiters: deque[object] = deque()  # upload tickets, first come first served

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (no polling) until `pred()` holds or `timeout_s` passes; returns pred()."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not pred():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                return pred()
        return True

    async def put(self, samples: list[Sample], wait_s: float = 0.0) -> Admission:
        """Admit a group, waiting up to `wait_s` for space behind earlier waiters; QueueFull after that."""
        core = self.core
        n, nbytes = len(samples), sum(sample_nbytes(s) for s in samples)
        core.check_admissible(n, nbytes)
        if not self._waiters and core.fits(n, nbytes):
            return self._put(samples)
        if (wait_s <= 0 or len(self._waiters) >= self.max_upload_waiters
                or self._waiting_bytes + nbytes > self.max_waiting_bytes):
            core.counters.rejected_full += 1
            raise QueueFull(f"queue full: {core.samples}/{core.max_samples} samples, "
                            f"{core.nbytes}/{core.max_bytes} bytes held, {len(self._waiters)} uploads waiting")
        ticket = object()
        self._waiters.append(ticket)
        self._waiting_bytes += nbytes
        core.counters.waited_full += 1
        self.notify()  # a learner waiting for more than the queue can hold now takes what is ready
        try:
            ok = await self.wait_until(lambda: self._waiters[0] is ticket and core.fits(n, nbytes), wait_s)
            if not ok:
                core.counters.rejected_full += 1
                raise QueueFull(f"queue still full after waiting {wait_s:.1f}s: {core.samples}/{core.max_samples} "
                                f"samples, {core.nbytes}/{core.max_bytes} bytes held")
            return self._put(samples)
        finally:
            self._waiters.remove(ticket)
            self._waiting_bytes -= nbytes
            self.notify()  # the next waiter in line may fit now

    def _put(self, samples: list[Sample]) -> Admission:
        adm = self.core.put(samples)
        self.notify()
        return adm

    @property
    def upload_waiters(self) -> int:
        return len(self._waiters)

    async def take_window(self, max_tokens: int, timeout_s: float) -> list[Entry]:
        """For the reference loop: the next window, or [] after `timeout_s` with nothing pending."""
        if not await self.wait_until(lambda: self.core.pending > 0, timeout_s):
            return []
        window = self.core.take_pending(max_tokens)
        self.notify()  # stale drops may have freed space
        return window

    def complete(self, entries: list[Entry], ref_logprobs: list[list[float]] | None, compute_s: float = 0.0) -> None:
        self.core.complete(entries, ref_logprobs, compute_s)
        self.notify()

    def fail(self, entries: list[Entry]) -> None:
        self.core.fail(entries)
        self.notify()

    def requeue(self, entries: list[Entry]) -> None:
        self.core.requeue(entries)
        self.notify()

    def untake(self, entries: list[Entry]) -> None:
        self.core.untake(entries)
        self.notify()

    async def take_batch(self, max_samples: int, max_tokens: int, min_samples: int = 1,
                         wait_s: float = 10.0,
                         client_gone: Callable[[], Awaitable[bool]] | None = None,
                         abandoned: Callable[[], bool] = lambda: False) -> list[Entry]:
        """Wait up to `wait_s` for `min_samples` ready samples (capped by max_samples), then take what is
        ready; [] if nothing is. `client_gone` is checked before taking, so a gone client takes nothing;
        `abandoned` (a retry took over the request: call notify() when it turns true) ends the wait
        at once, taking nothing.

        The wait ends early when `min_samples` can never be reached by waiting: an upload is waiting
        for space and everything held is fewer than needed. Space frees only by delivery, so the
        queue is stuck until this call takes what is ready (e.g. a 24-sample queue holding 20 after
        a stale drop, with a 6-sample group waiting, and a learner that wants 24)."""
        need = max(1, min(min_samples, max_samples))
        core = self.core

        def enough() -> bool:
            return (abandoned() or core.ready >= need
                    or (bool(self._waiters) and 0 < core.ready and core.samples < need))
        await self.wait_until(enough, wait_s)
        if not core.ready or abandoned() or (client_gone is not None and await client_gone()):
            return []
        out = core.take_ready(max_samples, max_tokens)
        self.notify()  # space freed for waiting uploads
        return out

    def set_version(self, version: int) -> int:
        dropped = self.core.set_version(version)
        self.notify()
        return dropped
