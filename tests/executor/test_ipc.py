"""Length-prefixed JSON frames between the executor's processes: pieces reassemble, limits hold."""
from __future__ import annotations

import pytest

from toolrl.executor import ipc


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
    with pytest.raises(ipc.FrameError, match="over the limit"):
        r.feed((1000).to_bytes(4, "big"))
    # many complete frames in one read are not one oversized frame: each is within the limit
    r = ipc.FrameReader(limit=16)
    r.feed(b"".join(ipc.pack({"i": i}) for i in range(100)))
    assert [f["i"] for f in r.frames()] == list(range(100))
    r = ipc.FrameReader(limit=16)
    r.feed((5).to_bytes(4, "big") + b"nope!")
    with pytest.raises(ipc.FrameError, match="not JSON"):
        list(r.frames())
