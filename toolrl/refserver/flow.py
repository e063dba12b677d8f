"""Staleness-aware flow control: workers generate only what the learner can still use.

A sample started while the learner holds version v is trained at the latest when the learner holds
v + max_staleness (later it is dropped as stale). Before then the learner takes the rest of version
v's samples and `max_staleness` more versions' worth, so at most

    capacity = (max_staleness + 1) * samples_per_version - delivered since the last version

samples may be queued or being generated at once (AReaL bounds its rollouts the same way). A worker
asks for a grant of one group's samples before it starts the group; the grant ends when the group is
uploaded, when the worker gives it back (a group it left out), when the worker leaves the registry,
or when its lease runs out. Grants are counted across every worker, so the bound holds for all of
them together.

A group starts while any room is left, even when it is larger than the room: room left means the
learner still lacks samples that nothing queued or generating will bring (some were dropped as
stale or left out, so the version's share is not a whole number of groups), and refusing the group
would leave the learner waiting until its batch deadline. So the bound can be passed by at most one
group less one sample (and a group larger than the whole bound, a misconfiguration, still runs).
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Grant:
    worker_id: str
    n: int
    expires: float
    request_id: str | None = None


class Grants:
    def __init__(self, samples_per_version: int, max_staleness: int, lease_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.limit = (max_staleness + 1) * samples_per_version
        self.lease_s, self.clock = lease_s, clock
        self._held: dict[str, Grant] = {}
        self._by_request: dict[str, str] = {}  # a held grant's request id -> its grant id
        self.in_flight = 0
        self.granted_total = self.refused_total = self.released_total = self.expired_total = 0

    def capacity(self, queued: int, delivered_since_version: int) -> int:
        """Samples that may still be started now."""
        self.expire()
        return self.limit - delivered_since_version - queued - self.in_flight

    def take(self, worker_id: str, n: int, queued: int, delivered_since_version: int,
             request_id: str | None = None) -> str | None:
        """A grant id for `n` samples, or None when they do not fit now. A request repeated under the
        same `request_id` (a client retrying after its answer was lost) gets the grant it already
        holds, not a second one that would hold room until its lease ran out."""
        if n < 1:
            raise ValueError(f"a grant is for at least one sample, not {n}")
        if request_id is not None and (gid := self._by_request.get(request_id)) is not None:
            g = self._held[gid]
            if (g.worker_id, g.n) == (worker_id, n):
                return gid
        if self.capacity(queued, delivered_since_version) < 1:  # any room: see the module's doc
            return None  # counted in refused_total by the caller, once per request (a wait re-checks)
        gid = secrets.token_hex(8)
        self._held[gid] = Grant(worker_id, n, self.clock() + self.lease_s, request_id)
        if request_id is not None:
            self._by_request[request_id] = gid
        self.in_flight += n
        self.granted_total += 1
        return gid

    def release(self, grant_id: str) -> bool:
        g = self._held.pop(grant_id, None)
        if g is None:
            return False
        if g.request_id is not None:
            self._by_request.pop(g.request_id, None)
        self.in_flight -= g.n
        self.released_total += 1
        return True

    def release_worker(self, worker_id: str) -> int:
        """A worker that left: its groups will never be uploaded."""
        gone = [gid for gid, g in self._held.items() if g.worker_id == worker_id]
        for gid in gone:
            self.release(gid)
        return len(gone)

    def expire(self) -> None:
        now = self.clock()
        for gid in [gid for gid, g in self._held.items() if g.expires < now]:
            self.release(gid)
            self.expired_total += 1

    def stats(self) -> dict:
        self.expire()  # what is held now, not what ran out since the last request
        return {"limit": self.limit, "in_flight": self.in_flight, "grants": len(self._held),
                "granted_total": self.granted_total, "refused_total": self.refused_total,
                "released_total": self.released_total, "expired_total": self.expired_total}
