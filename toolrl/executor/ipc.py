"""Length-prefixed JSON frames: front end <-> fork server <-> runners.

JSON, never pickle: runner frames come from untrusted code and are only ever parsed as data.
Every reader has a size bound, so a corrupt or hostile length cannot make anyone allocate without limit.
"""
from __future__ import annotations

import errno
import json
import os
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: the fork server and the runners need not load asyncio
    import asyncio

_LEN = struct.Struct(">I")
# A session's state lost, or a block killed, for the service's reasons and not its code's (evicted to
# make room or to bound memory held by others, expired, a fork server restart, a session that could
# not start): the reason passed between the processes starts with this, and the front end's result
# says `executor_fault` (api.ExecResult).
EXECUTOR_CAUSED = "by the executor: "
MAX_FRAME = 64 << 20  # front end <-> fork server; a batch never gets near this (requests are capped)


class FrameError(ValueError):
    pass


def pack(obj) -> bytes:
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Feed bytes as they arrive; `frames()` yields each complete decoded frame."""

    __slots__ = ("buf", "limit")

    def __init__(self, limit: int = MAX_FRAME):
        self.buf = bytearray()
        self.limit = limit

    def feed(self, data: bytes) -> None:
        """Add bytes; FrameError as soon as the next frame says it is over the limit (so at most one
        read's worth of complete frames and one partial frame within the limit are ever held)."""
        self.buf += data
        if len(self.buf) >= 4 and _LEN.unpack_from(self.buf)[0] > self.limit:
            raise FrameError(f"frame of {_LEN.unpack_from(self.buf)[0]} bytes is over the limit of {self.limit}")

    def frames(self):
        while len(self.buf) >= 4:
            (n,) = _LEN.unpack_from(self.buf)
            if n > self.limit:
                raise FrameError(f"frame of {n} bytes is over the limit of {self.limit}")
            if len(self.buf) < 4 + n:
                return
            body = bytes(self.buf[4:4 + n])
            del self.buf[:4 + n]
            try:
                yield json.loads(body)
            except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." from a runner
                raise FrameError(f"frame is not JSON: {type(exc).__name__}: {exc}") from None


def read_frame_blocking(fd: int, limit: int = MAX_FRAME):
    """One frame from a blocking fd; None on a clean EOF before the frame starts."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise FrameError(f"frame of {n} bytes is over the limit of {limit}")
    body = _read_exact(fd, n)
    if body is None:
        raise FrameError("EOF inside a frame")
    return json.loads(body)


async def read_frame_async(reader: asyncio.StreamReader, limit: int = MAX_FRAME):
    """One frame from an asyncio stream (the front end's end of the fork server's socket)."""
    (n,) = _LEN.unpack(await reader.readexactly(4))
    if n > limit:
        raise FrameError(f"frame of {n} bytes is over the limit of {limit}")
    return json.loads(await reader.readexactly(n))


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        try:
            chunk = os.read(fd, n - got)
        except InterruptedError:
            continue
        if not chunk:
            if got == 0:
                return None
            raise FrameError("EOF inside a frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class OutBuffer:
    """Non-blocking writes to one fd with a bounded backlog; the owner polls for POLLOUT while `pending`."""

    __slots__ = ("fd", "chunks", "size", "limit", "broken")

    def __init__(self, fd: int, limit: int = 256 << 20):
        self.fd = fd
        self.chunks: list[memoryview] = []
        self.size = 0
        self.limit = limit
        self.broken = False

    @property
    def pending(self) -> bool:
        return bool(self.chunks)

    def write(self, data: bytes) -> None:
        if self.broken:
            return
        if self.size + len(data) > self.limit:
            raise FrameError(f"write backlog over {self.limit} bytes: the reader is not reading")
        self.chunks.append(memoryview(data))
        self.size += len(data)
        self.flush()

    def flush(self) -> None:
        while self.chunks and not self.broken:
            chunk = self.chunks[0]
            try:
                n = os.write(self.fd, chunk)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.EBADF):
                    self.broken = True
                    self.chunks.clear()
                    self.size = 0
                    return
                raise
            self.size -= n
            if n == len(chunk):
                self.chunks.pop(0)
            else:
                self.chunks[0] = chunk[n:]


def executor_caused(reason: str) -> str:
    return EXECUTOR_CAUSED + reason
