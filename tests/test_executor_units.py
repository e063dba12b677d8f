"""The executor's pure parts: capped capture, framing, session bookkeeping. No service needed."""
from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolrl.executor import ipc
from toolrl.executor.output import Capture
from toolrl.executor.sessions import SessionManager, SessionsFull


def test_capture_under_the_cap_is_exact():
    c = Capture(100)
    for part in (b"hello ", b"world\n"):
        c.feed(part)
    assert (c.text(), c.truncated, c.total) == ("hello world\n", False, 12)


def test_capture_keeps_head_and_tail_with_a_marker():
    c = Capture(100)
    c.feed(b"H" * 80)
    for _ in range(1000):
        c.feed(b"m" * 100)
    c.feed(b"T" * 30)
    text = c.text()
    assert c.truncated and text.startswith("H" * 75) and text.endswith("m" * 0 + "T" * 25)
    assert "bytes omitted" in text and str(80 + 100_000 + 30 - 75 - 25) in text


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=400), st.integers(min_value=8, max_value=120),
       st.integers(min_value=1, max_value=50))
def test_capture_never_splits_a_character(text, cap, chunk):
    data = text.encode()
    c = Capture(cap)
    for i in range(0, len(data), chunk):
        c.feed(data[i:i + chunk])
    out = c.text()
    assert "\ufffd" not in out  # a valid input never gains replacement characters from a cut
    if not c.truncated:
        assert out == text


def test_capture_replaces_invalid_utf8():
    c = Capture(100)
    c.feed(b"a\xffb")
    assert c.text() == "a\ufffdb"


def test_frames_roundtrip_in_pieces():
    r = ipc.FrameReader()
    blob = ipc.pack({"a": 1}) + ipc.pack({"s": "x\ud800y"}) + ipc.pack([1, 2])
    got = []
    for i in range(len(blob)):
        r.feed(blob[i:i + 1])
        got.extend(r.frames())
    assert got == [{"a": 1}, {"s": "x\ud800y"}, [1, 2]]


def test_frame_limits():
    r = ipc.FrameReader(limit=16)
    r.feed((1000).to_bytes(4, "big"))
    with pytest.raises(ipc.FrameError, match="over the limit"):
        list(r.frames())
    r = ipc.FrameReader(limit=16)
    r.feed((5).to_bytes(4, "big") + b"nope!")
    with pytest.raises(ipc.FrameError, match="not JSON"):
        list(r.frames())


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
    assert "SIGKILL" in m.acquire("p").pending_reset
    m.reset_all("restarted")
    assert m.acquire("p").pending_reset == "restarted"


def test_tombstones_are_bounded():
    m = SessionManager(1, 60, Killed())
    for i in range(m.max_tombstones + 50):
        m.acquire(f"s{i}")
    assert len(m.tombstones) <= m.max_tombstones
