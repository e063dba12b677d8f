"""The fork server's capped capture of a run's output: head and tail kept, never a split character."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from toolrl.executor.forkserver.capture import Capture


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
