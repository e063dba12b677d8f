"""The gen-worker registry: who is alive and where the learner pushes weights.

A worker registers (id, url, capabilities, policy version) and heartbeats; one that has not been
heard from for `ttl_s` is dropped (checked on every access, and by a periodic sweep so expiry is
logged even when nobody asks). Registering again with the same id and URL replaces the entry, so a
restarted worker simply registers anew; the id of a live worker cannot be taken by another URL (409)
until that worker expires, or the learner would push weights to whoever asked. The registry is
bounded (`max_workers`).

A worker's heartbeats may carry its producer state (where its problem stream and curriculum stand),
which the learner saves in its checkpoints. A run resumed from one hands those states back
(`set_resume_states`) and each worker gets its own in register and heartbeat answers until it says
it applied it.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
MAX_CAPABILITIES_BYTES = 16 << 10
MAX_STATE_BYTES = 16 << 10
MAX_JSON_DEPTH = 32  # nesting of a kept object: deeper ones break encoders and pickling downstream
MAX_WORKERS = 1024  # live workers, and resume states a resumed learner may hand back


class RegistryError(ValueError):
    """A registration that cannot be accepted (HTTP 400), or a conflict: a full registry, a live id
    at another URL (HTTP 409)."""

    def __init__(self, msg: str, status: int = 400):
        super().__init__(msg)
        self.status = status


@dataclass
class Worker:
    id: str
    url: str
    capabilities: dict[str, Any]
    policy_version: int
    registered_at: float  # wall clock, for people
    last_seen: float  # wall clock, for people
    seen_mono: float = field(repr=False, default=0.0)  # monotonic, for expiry
    heartbeats: int = 0
    state: dict[str, Any] | None = None  # the producer state of its last heartbeat that carried one

    def public(self, now_mono: float) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "capabilities": self.capabilities,
                "policy_version": self.policy_version, "last_seen": self.last_seen,
                "age_s": round(now_mono - self.seen_mono, 3), "registered_at": self.registered_at,
                "heartbeats": self.heartbeats, "state": self.state}


def _check_id(worker_id: str) -> None:
    if not isinstance(worker_id, str) or not _ID_RE.match(worker_id):
        raise RegistryError(f"worker id {worker_id!r} must be 1-128 characters of [A-Za-z0-9._:@-]")


def _check_object(what: str, value: Any, limit: int) -> None:
    """A JSON object of at most `limit` bytes serialised: what a worker may make the server keep."""
    if not isinstance(value, dict):
        raise RegistryError(f"{what} must be a JSON object")
    if _depth(value) > MAX_JSON_DEPTH:
        raise RegistryError(f"{what}: nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        size = len(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise RegistryError(f"{what}: not JSON-serialisable: {exc}") from None
    if size > limit:
        raise RegistryError(f"{what}: {size} bytes serialised, over the limit of {limit}")


def _depth(value: Any) -> int:
    """Nesting depth of lists and dicts, without recursion (stops a little past the limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:
                stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def validate(worker_id: str, url: str, capabilities: dict[str, Any], policy_version: int) -> None:
    _check_id(worker_id)
    if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+", url) or len(url) > 2048:
        raise RegistryError(f"worker url {url!r} must be an http(s) URL")
    _check_object("capabilities", capabilities, MAX_CAPABILITIES_BYTES)
    if not isinstance(policy_version, int) or policy_version < 0:
        raise RegistryError(f"policy_version must be a non-negative integer, got {policy_version!r}")


class WorkerRegistry:
    def __init__(self, ttl_s: float, max_workers: int = MAX_WORKERS, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, on_expire: Callable[[Worker], None] | None = None):
        self.ttl_s, self.max_workers = ttl_s, max_workers
        self.clock, self.wall, self.on_expire = clock, wall, on_expire
        self._workers: dict[str, Worker] = {}
        self._resume: dict[str, dict[str, Any]] = {}  # from a resumed learner, until each worker takes its own
        self.registered_total = 0
        self.expired_total = 0

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def register(self, worker_id: str, url: str, capabilities: dict[str, Any] | None = None,
                 policy_version: int = 0) -> Worker:
        capabilities = capabilities or {}
        validate(worker_id, url, capabilities, policy_version)
        self.expire()
        old = self._workers.get(worker_id)
        if old is not None and old.url != url:
            left = self.ttl_s - (self.clock() - old.seen_mono)
            raise RegistryError(f"worker id {worker_id!r} is live at {old.url}: another URL may take it only after "
                                f"that worker expires (no heartbeat for {self.ttl_s:g}s; {left:.0f}s at the "
                                f"earliest), or use another id", status=409)
        if old is None and len(self._workers) >= self.max_workers:
            raise RegistryError(f"registry full ({self.max_workers} live workers)", status=409)
        now, wall = self.clock(), self.wall()
        w = Worker(worker_id, url, dict(capabilities), policy_version, wall, wall, now)
        self._workers[worker_id] = w
        self.registered_total += 1
        return w

    def heartbeat(self, worker_id: str, policy_version: int | None = None,
                  state: dict[str, Any] | None = None) -> Worker | None:
        """Refresh a live worker, keeping its producer state when it sends one; None if it is unknown
        or already expired (it should register again)."""
        self.expire()
        w = self._workers.get(worker_id)
        if w is None:
            return None
        if policy_version is not None and (not isinstance(policy_version, int) or policy_version < 0):
            raise RegistryError(f"policy_version must be a non-negative integer, got {policy_version!r}")
        if state is not None:
            _check_object("state", state, MAX_STATE_BYTES)
            w.state = state
        if policy_version is not None:
            w.policy_version = policy_version
        w.seen_mono, w.last_seen = self.clock(), self.wall()
        w.heartbeats += 1
        return w

    def set_resume_states(self, states: dict[str, dict[str, Any]]) -> int:
        """Replace the states waiting for workers to take them (a resumed run's, by worker id); returns
        how many wait. All or nothing: one bad entry refuses the whole set."""
        if not isinstance(states, dict):
            raise RegistryError("states must be a JSON object of worker id -> state")
        if len(states) > self.max_workers:
            raise RegistryError(f"{len(states)} resume states are more than max_workers ({self.max_workers})")
        for worker_id, state in states.items():
            _check_id(worker_id)
            _check_object(f"state of {worker_id}", state, MAX_STATE_BYTES)
        rid = uuid.uuid4().hex[:12]  # one id per resume: a worker applies each once
        self._resume = {worker_id: (rid, state) for worker_id, state in states.items()}
        return len(self._resume)

    def resume_state(self, worker_id: str) -> tuple[str, dict[str, Any]] | None:
        """(id, state) waiting for this worker: handed over in every answer until the worker says it
        applied it (`applied_resume`). Taken at the first hand-over, a retry after a lost answer got
        nothing and the worker re-drew problems already trained (found in review)."""
        return self._resume.get(worker_id)

    def applied_resume(self, worker_id: str, resume_id: str) -> None:
        if (held := self._resume.get(worker_id)) is not None and held[0] == resume_id:
            del self._resume[worker_id]

    def remove(self, worker_id: str) -> bool:
        return self._workers.pop(worker_id, None) is not None

    def expire(self) -> list[Worker]:
        now = self.clock()
        gone = [w for w in self._workers.values() if now - w.seen_mono > self.ttl_s]
        for w in gone:
            del self._workers[w.id]
            self.expired_total += 1
            if self.on_expire:
                self.on_expire(w)
        return gone

    def live(self) -> list[dict[str, Any]]:
        self.expire()
        now = self.clock()
        return [w.public(now) for w in sorted(self._workers.values(), key=lambda w: w.registered_at)]

    def __len__(self) -> int:
        return len(self._workers)

    def stats(self) -> dict[str, Any]:
        self.expire()
        return {"live": len(self), "registered_total": self.registered_total, "expired_total": self.expired_total,
                "ttl_s": self.ttl_s, "resume_states_pending": len(self._resume)}
