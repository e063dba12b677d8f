"""The front end's side of sessions: which index each session id holds, and why a session ended.

Sessions keep state between the successive code blocks of one rollout, like a notebook. A session
id maps to an index: its lane in the fork server (forkserver/session_runners.py), a long-lived
runner process with its own uid. Sessions end on DELETE, after `ttl_s` idle, when evicted to make
room (least recently used idle session first), or when their process dies (time limit, os._exit,
OOM). Whatever the cause, the next block on that id is told: `session_reset: true` and the reason.
Tombstones that remember those reasons are bounded too.
"""
from __future__ import annotations

import asyncio
import collections
import time

from toolrl.executor.ipc import executor_caused


class SessionsFull(RuntimeError):
    """Every session slot is executing right now; none can be evicted."""


class Session:
    __slots__ = ("id", "index", "last_used", "lock", "busy", "fresh", "pending_reset", "alive")

    def __init__(self, sid: str, index: int, pending_reset: str | None):
        self.id, self.index = sid, index
        self.last_used = time.monotonic()
        self.lock = asyncio.Lock()  # one block at a time, in arrival order
        self.busy = 0
        self.fresh = True  # the fork server must start a new process for the next block
        self.pending_reset = pending_reset
        self.alive = True


class SessionManager:
    def __init__(self, max_sessions: int, ttl_s: float, kill):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.kill = kill  # kill(index, note): tell the fork server to end that session's process
        self.active: dict[str, Session] = {}
        self.free = list(range(max_sessions - 1, -1, -1))
        self.tombstones: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.max_tombstones = 4 * max_sessions + 1024

    def __len__(self) -> int:
        return len(self.active)

    def acquire(self, sid: str, continues: bool = False) -> Session:
        """The session of `sid`, started if it has none. `continues`: the caller ran an earlier block
        in it, so an id with neither a session nor a tombstone lost its state to this executor (a
        restart, or a tombstone dropped at the cap)."""
        s = self.active.get(sid)
        if s is not None:
            s.last_used = time.monotonic()
            return s
        if not self.free:
            self._evict_one()
        reset = self.tombstones.pop(sid, None)
        if reset is None and continues:
            reset = executor_caused("this executor holds no record of the session (it was restarted, or the "
                                    "record was dropped): its earlier state is gone")
        s = self.active[sid] = Session(sid, self.free.pop(), reset)
        return s

    def _evict_one(self) -> None:
        idle = [s for s in self.active.values() if s.busy == 0]
        if not idle:
            raise SessionsFull(f"all {self.max_sessions} sessions are executing")
        victim = min(idle, key=lambda s: s.last_used)
        self._end(victim, executor_caused(f"evicted to make room (executor.max_sessions={self.max_sessions} reached)"))

    def _end(self, s: Session, reason: str | None, tell_forkserver: bool = True) -> None:
        if self.active.get(s.id) is s:
            del self.active[s.id]
        s.alive = False
        self.free.append(s.index)
        if reason is not None:
            self._tombstone(s.id, reason)
        if tell_forkserver:
            self.kill(s.index, reason or "session deleted")

    def _tombstone(self, sid: str, reason: str) -> None:
        self.tombstones[sid] = reason
        self.tombstones.move_to_end(sid)
        while len(self.tombstones) > self.max_tombstones:
            self.tombstones.popitem(last=False)

    def lost(self, s: Session, reason: str) -> None:
        """The fork server reports that the session's process is gone (it cleans up by itself)."""
        if s.alive:
            self._end(s, reason, tell_forkserver=False)

    def refused(self, s: Session, reset: str | None) -> None:
        """The fork server had no memory to start the session's process: the id is let go as if it had
        never started, keeping the reason its earlier state is gone (if any) for its next block."""
        if s.alive:
            self._end(s, reset, tell_forkserver=False)

    def delete(self, sid: str) -> bool:
        self.tombstones.pop(sid, None)
        s = self.active.get(sid)
        if s is None:
            return False
        self._end(s, None)  # the client asked for it: a later block on this id is simply a new session
        return True

    def expire(self) -> int:
        cutoff = time.monotonic() - self.ttl_s
        old = [s for s in self.active.values() if s.busy == 0 and s.last_used < cutoff]
        for s in old:
            self._end(s, executor_caused(f"expired after {self.ttl_s:g} s idle (executor.session_ttl_s)"))
        return len(old)

    def reset_all(self, reason: str) -> None:
        """The fork server was replaced: every session process is gone."""
        for s in list(self.active.values()):
            self._end(s, executor_caused(reason), tell_forkserver=False)
