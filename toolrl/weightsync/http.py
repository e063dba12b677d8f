"""HTTP weight sync, the learner's side: ordered safetensors buckets streamed to a worker.

`push_weights` splits named tensors into buckets of about `bucket_mb` and POSTs them in order to
`{worker}/update_weights`, each streamed from the tensors' own memory. It returns the worker's
answer to the last bucket, which comes only after the worker has loaded the weights. Every
request has a timeout; a failure raises `WeightSyncError` naming the worker and the bucket, never
passes silently. The worker's side is toolrl.weightsync.receiver. Works anywhere, CPU included.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Iterator

import httpx
import torch

from toolrl.net import auth_headers
from toolrl.protocol import CONTENT_TYPE
from toolrl.weightsync.buckets import bucketize, frame_weight_bucket
from toolrl.weightsync.transport import WeightSyncError, confirm_loaded


class HttpTransport:
    """`learner.sync_transport: http`."""
    name = "http"

    def __init__(self, token: str | None, bucket_mb: int, timeout_s: float):
        self.token, self.bucket_mb, self.timeout_s = token, bucket_mb, timeout_s

    def push(self, worker: dict, named: list[tuple[str, torch.Tensor]], version: int) -> dict:
        return push_weights(worker["url"], named, version, token=self.token, bucket_mb=self.bucket_mb,
                            timeout_s=self.timeout_s)

    def forget(self, live: set[tuple[str, str]]) -> None:
        pass  # nothing is kept per worker


def push_weights(url: str, named: list[tuple[str, torch.Tensor]], version: int, *, token: str | None = None,
                 bucket_mb: int = 64, timeout_s: float = 120.0, client: httpx.Client | None = None) -> dict:
    """Send a full set of weights to one worker; returns its final answer (with `reload_s`).

    Each bucket is streamed from the tensors' own memory (no serialised copy); the next bucket's
    header and checksum are computed in a thread while this one is on the wire."""
    # The worker loads each bucket as the next one arrives: send the smallest first, so loading
    # starts soonest, then the biggest, so what is left after the last byte is a small load.
    by_size = sorted(bucketize(named, bucket_mb << 20), key=lambda b: sum(t.numel() * t.element_size() for _, t in b))
    buckets = by_size[:1] + by_size[:0:-1]
    own = client is None
    client = client or httpx.Client(timeout=timeout_s)
    t0 = time.time()
    pool = cf.ThreadPoolExecutor(max_workers=1)
    try:
        answer: dict = {}
        framed = pool.submit(frame_weight_bucket, buckets[0], version, 0, len(buckets))
        for i in range(len(buckets)):
            header, views = framed.result()
            if i + 1 < len(buckets):
                framed = pool.submit(frame_weight_bucket, buckets[i + 1], version, i + 1, len(buckets))
            size = len(header) + sum(v.nbytes for v in views)
            try:
                resp = client.post(f"{url.rstrip('/')}/update_weights", content=_slices(header, views),
                                   timeout=timeout_s, headers={"Content-Type": CONTENT_TYPE,
                                                               "Content-Length": str(size), **auth_headers(token)})
            except httpx.HTTPError as exc:
                raise WeightSyncError(f"{url}: bucket {i + 1}/{len(buckets)} of version {version}: "
                                      f"{type(exc).__name__}: {exc}") from None
            if resp.status_code != 200:
                raise WeightSyncError(f"{url}: bucket {i + 1}/{len(buckets)} of version {version}: "
                                      f"HTTP {resp.status_code}: {resp.text[:300]}")
            answer = resp.json()
        return confirm_loaded(url, answer, version, t0)
    finally:
        pool.shutdown(cancel_futures=True)
        if own:
            client.close()


def _slices(header: bytes, views: list[memoryview], step: int = 4 << 20) -> Iterator[bytes | memoryview]:
    """A bucket's bytes in pieces of at most `step` (a big embedding is not handed over whole)."""
    yield header
    for v in views:
        for a in range(0, v.nbytes, step):
            yield v[a:a + step]
