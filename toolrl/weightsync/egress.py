"""What one weight sender puts on its link: every byte counted, and paced to a cap when one is set.

One `Egress` per sender (the learner; each relaying worker, per update) is shared by all the
streams it sends at once, so the cap bounds the sender's whole link: with `learner.sync_max_mb_s`
a user leaves bandwidth for other traffic, and a benchmark on one host emulates one link per node
(without a cap every copy on loopback costs the same CPU, whatever the shape of the fan-out).
Thread-safe: the learner's pushes run in threads, a worker's relays in its event loop.
"""
from __future__ import annotations

import asyncio
import threading
import time

MIB = 1 << 20


class Egress:
    def __init__(self, max_mb_s: float | None = None):
        self.max_mb_s = max_mb_s  # MiB/s; None: uncapped
        self.rate = max_mb_s * MIB if max_mb_s else None  # bytes/s
        self.sent = 0  # bytes handed to the link, in all
        self._free_at = 0.0  # when the link has sent everything handed to it so far
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        """Count `n` bytes about to be sent; the seconds to wait before sending them. The link is
        modelled as busy for n / rate after each chunk: no burst beyond one chunk."""
        with self._lock:
            self.sent += n
            if self.rate is None:
                return 0.0
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + n / self.rate
            return start - now

    def pace(self, n: int) -> None:
        delay = self.take(n)
        if delay > 0:
            time.sleep(delay)

    async def apace(self, n: int) -> None:
        delay = self.take(n)
        if delay > 0:
            await asyncio.sleep(delay)

    @property
    def chunk(self) -> int:
        """How many bytes to hand over at a time: small enough under a cap that the pacing is smooth."""
        return MIB if self.rate else 4 * MIB
