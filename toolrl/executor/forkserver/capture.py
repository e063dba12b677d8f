"""Capped capture of one output stream: keep the head and the tail, count the rest.

The tail matters as much as the head: a traceback's last line says what went wrong. The kept text is
decoded as UTF-8 with invalid bytes replaced, and cuts never split a character.
"""
from __future__ import annotations

MARKER = "\n[... truncated: {omitted} bytes omitted ...]\n"


class Capture:
    __slots__ = ("head_cap", "tail_cap", "head", "tail", "total")

    def __init__(self, cap: int):
        self.head_cap = cap - cap // 4
        self.tail_cap = cap // 4
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap + 65536:  # trim now and then, not on every chunk
                del self.tail[:-self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_cap + self.tail_cap

    def text(self) -> str:
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
        head = _cut_end(bytes(self.head))
        tail = _cut_start(bytes(self.tail[-self.tail_cap:]) if self.tail_cap else b"")
        omitted = self.total - len(head) - len(tail)
        return (head.decode("utf-8", "replace") + MARKER.format(omitted=omitted)
                + tail.decode("utf-8", "replace"))


def _cut_end(b: bytes) -> bytes:
    """Drop a multi-byte character that the cut left incomplete at the end."""
    for back in range(1, min(4, len(b)) + 1):
        c = b[-back]
        if c < 0x80:
            return b
        if c >= 0xC0:  # a lead byte: complete only if its sequence fits
            need = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            return b if back >= need else b[:-back]
    return b


def _cut_start(b: bytes) -> bytes:
    """Drop continuation bytes of a character that began before the cut."""
    i = 0
    while i < min(3, len(b)) and 0x80 <= b[i] < 0xC0:
        i += 1
    return b[i:]
