"""The front end's session bookkeeping: caps, LRU eviction of idle sessions, expiry, tombstones."""
from __future__ import annotations

import time

import pytest

from toolrl.executor.frontend.session_ids import SessionManager, SessionsFull
from toolrl.executor.ipc import EXECUTOR_CAUSED


class Killed(list):
    def __call__(self, index, note):
        self.append((index, note))


def test_sessions_cap_evicts_lru_idle_and_tombstones_say_why():
    killed = Killed()
    m = SessionManager(2, 60, killed)
    a = m.acquire("a")
    b = m.acquire("b")
    a.last_used -= 10  # a is older
    m.acquire("c")
    assert [k[0] for k in killed] == [a.index] and "evicted" in killed[0][1]
    assert b.alive and not a.alive
    again = m.acquire("a")  # at the cap again: b is now the least recently used
    assert again.fresh and "evicted" in again.pending_reset
    assert not b.alive and killed[-1][0] == b.index


def test_sessions_busy_ones_are_never_evicted():
    m = SessionManager(1, 60, Killed())
    s = m.acquire("only")
    s.busy = 1
    with pytest.raises(SessionsFull):
        m.acquire("other")


def test_sessions_expire_and_delete():
    killed = Killed()
    m = SessionManager(4, 0.05, killed)
    m.acquire("x")
    m.acquire("y").busy = 1
    time.sleep(0.1)
    assert m.expire() == 1  # y is executing: it does not expire under the block
    assert "expired" in m.acquire("x").pending_reset
    assert m.delete("y") is True and m.delete("y") is False
    assert m.acquire("y").pending_reset is None  # deleted on purpose: no reset note


def test_sessions_lost_and_restart():
    m = SessionManager(4, 60, Killed())
    s = m.acquire("p")
    m.lost(s, "the process was killed by SIGKILL")
    reset = m.acquire("p").pending_reset
    assert "SIGKILL" in reset and not reset.startswith(EXECUTOR_CAUSED)  # its own process: the code's doing
    m.reset_all("restarted")
    assert m.acquire("p").pending_reset == EXECUTOR_CAUSED + "restarted"


def test_tombstones_are_bounded():
    m = SessionManager(1, 60, Killed())
    for i in range(m.max_tombstones + 50):
        m.acquire(f"s{i}")
    assert len(m.tombstones) <= m.max_tombstones
