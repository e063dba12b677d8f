"""The learner's side of one weight update: its buckets framed once for every push of a sync and,
for the workers that hold the last version sent, encoded once as deltas against it.

The learner keeps the last version it sent (`LastSent`): one copy of the weights in the sync dtype
(a 7B model in bf16: 14 GB of host RAM on the learner's rank 0; SmolLM2-135M: 0.3 GB), bucket by
bucket in the layout they were sent in. Each new version is encoded against it by a background
thread, bucket after bucket in the order they are sent (so the first delta goes out while later
ones are still encoded), and the encoder copies the new bytes over the old as it goes
(toolrl.weightsync.delta). A bucket whose delta is not smaller than the bucket goes out whole.
The compressed deltas live as long as the sync (`HttpTransport.release`).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading

import numpy as np
import torch

from toolrl.protocol import read_header
from toolrl.weightsync.buckets import SCHEMA_WEIGHTS, bucketize, frame_delta_bucket, frame_weight_bucket
from toolrl.weightsync.delta import block_plan, encode, store

log = logging.getLogger("learner")
Frame = tuple[bytes, list[memoryview]]  # a bucket's header and its data region's pieces


def send_order(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Buckets in the order they are sent. The worker loads each bucket as the next one arrives: the
    smallest goes first, so loading starts soonest, then the biggest, so what is left after the last
    byte is a small load."""
    by_size = sorted(bucketize(named, bucket_bytes), key=lambda b: sum(t.numel() * t.element_size() for _, t in b))
    return by_size[:1] + by_size[:0:-1]


def layout(buckets: list[list[tuple[str, torch.Tensor]]]) -> list:
    """What a delta needs to be the same from one version to the next: each bucket's tensors,
    names, dtypes and shapes, in order."""
    return [[(n, t.dtype, tuple(t.shape)) for n, t in b] for b in buckets]


def _checksum(header: bytes) -> str:
    return read_header(header, len(header), SCHEMA_WEIGHTS)[2]["xxh3_64"]


class EncoderBusy(RuntimeError):
    """The last version's encoder is still writing the kept copy: it cannot be a base."""


class LastSent:
    """The last version the learner sent: each bucket's data region (uint8) and checksum. Written
    by one encoder at a time (`encoder`); between syncs it holds one version whole."""

    def __init__(self):
        self.version: int | None = None  # None: nothing whole (never filled, or an encoder failed)
        self.layout: list | None = None
        self.data: list[np.ndarray] = []
        self.xxh3: list[str] = []
        self.encoder: threading.Thread | None = None

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.data)


class Outgoing:
    """One version's update as the learner sends it: `full(i)` and `delta(i)` give bucket i (of
    `count`, in send order) framed, each computed once whatever the number of pushes. With `last`,
    a background encoder makes the deltas against it (`base`: the version they apply to; None: no
    deltas this time, the layout changed or nothing was kept) and leaves `last` holding this version."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], version: int, bucket_bytes: int,
                 last: LastSent | None = None, threads: int | None = None, wait_s: float = 600.0):
        self.version, self.wait_s = version, wait_s
        self.buckets = send_order(named, bucket_bytes)
        self.count = len(self.buckets)
        self.copy_bytes = sum(t.numel() * t.element_size() for _, t in named)  # one copy of the weights
        self._full: list[Frame | None] = [None] * self.count
        self._locks = [threading.Lock() for _ in range(self.count)]
        self._deltas: list[cf.Future] = [cf.Future() for _ in range(self.count)]
        self.sent = {"delta": 0, "full": 0}  # bytes handed to the link, by kind
        self._sent_lock = threading.Lock()
        self.base: int | None = None
        if last is not None and last.encoder is not None:  # the last version's encoder has bounded work left
            last.encoder.join(wait_s)
            if last.encoder.is_alive():
                raise EncoderBusy(f"encoding the last version did not finish within {wait_s:.0f}s")
        if last is None or last.version == version:  # nothing to keep, or kept already (a catch-up)
            for f in self._deltas:
                f.set_result(None)
            return
        lay = layout(self.buckets)
        if last.version is not None and last.version < version and last.layout == lay:
            self.base = last.version
        else:  # the first version kept, or another layout: this one is only stored, for the next
            last.version, last.layout, last.xxh3 = None, lay, [""] * self.count
            last.data = [np.empty(sum(t.numel() * t.element_size() for _, t in b), dtype=np.uint8)
                         for b in self.buckets]
        self._last = last
        last.encoder = threading.Thread(target=self._encode, args=(threads or min(4, os.cpu_count() or 1),),
                                        name=f"delta-encoder-v{version}", daemon=True)
        last.encoder.start()

    def full(self, i: int) -> Frame:
        with self._locks[i]:
            if self._full[i] is None:
                self._full[i] = frame_weight_bucket(self.buckets[i], self.version, i, self.count)
            return self._full[i]

    def delta(self, i: int) -> Frame | None:
        """Bucket i as a delta from `base`, or None: send it whole (no base, or the delta is no smaller)."""
        try:
            return self._deltas[i].result(timeout=self.wait_s)
        except Exception as exc:  # a bug or a timeout in the encoder: a full bucket is always right
            log.error("no delta for bucket %d/%d of version %d (%s); sending it whole", i + 1, self.count,
                      self.version, exc)
            return None

    def count_sent(self, kind: str, n: int) -> None:
        with self._sent_lock:
            self.sent[kind] += n

    # -- the encoder (its own thread) --------------------------------------------------------------
    def _encode(self, threads: int) -> None:
        last, base = self._last, self.base
        try:
            with cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="delta-block") as pool:
                for i in range(self.count):
                    header, views = self.full(i)
                    if base is None:
                        store(views, last.data[i])
                        self._deltas[i].set_result(None)
                    else:
                        table = read_header(header, len(header), SCHEMA_WEIGHTS)[1]
                        blocks, _ = block_plan({k: v for k, v in table.items() if k != "__metadata__"})
                        body = encode(views, last.data[i], blocks, pool.map)
                        delta = frame_delta_bucket(header, body, [n for n, _ in self.buckets[i]], self.version, i,
                                                   self.count, base, last.xxh3[i])
                        small = len(delta[0]) + sum(v.nbytes for v in delta[1]) < \
                            len(header) + sum(v.nbytes for v in views)
                        self._deltas[i].set_result(delta if small else None)
                    last.xxh3[i] = _checksum(header)
            last.version = self.version
        except BaseException as exc:
            last.version = None  # half old, half new: no delta is made from it
            for f in self._deltas:
                if not f.done():
                    f.set_exception(exc)
            log.exception("encoding version %d failed; the next sync sends full weights", self.version)
