"""HTTP weight sync, the learner's side: ordered safetensors buckets streamed to a worker.

`push_weights` splits named tensors into buckets of about `bucket_mb` and POSTs them in order to
`{worker}/update_weights`, each streamed from the tensors' own memory. It returns the worker's
answer to the last bucket, which comes only after the worker has loaded the weights. Every
request has a timeout; a failure raises `WeightSyncError` naming the worker and the bucket, never
passes silently. The worker's side is toolrl.weightsync.receiver. Works anywhere, CPU included.

With `learner.sync_fanout` the learner sends to the root of a tree of workers instead, with the
plan of the tree (`push_tree`; toolrl.weightsync.fanout), and the workers relay it
(toolrl.weightsync.relay).
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
from toolrl.weightsync.egress import Egress
from toolrl.weightsync.fanout import PLAN_HEADER, PlanNode, outcomes_of, plan_for, reported_below
from toolrl.weightsync.transport import WeightSyncError, confirm_loaded


class HttpTransport:
    """`learner.sync_transport: http`. All pushes share one `Egress`: the learner's link, counted
    and capped at `max_mb_s` (MiB/s) when set."""
    name = "http"

    def __init__(self, token: str | None, bucket_mb: int, timeout_s: float, max_mb_s: float | None = None):
        self.token, self.bucket_mb, self.timeout_s = token, bucket_mb, timeout_s
        self.egress = Egress(max_mb_s)

    def push(self, worker: dict, named: list[tuple[str, torch.Tensor]], version: int) -> dict:
        return push_weights(worker["url"], named, version, token=self.token, bucket_mb=self.bucket_mb,
                            timeout_s=self.timeout_s, egress=self.egress)

    def push_tree(self, root: PlanNode, named: list[tuple[str, torch.Tensor]], version: int) -> dict[str, dict]:
        """Send an update once, to `root`, with the plan of its subtree. -> the outcome of every
        worker in the tree, by id: its answer to the last bucket, or {"error"}. A root whose own load
        failed still reports the workers below it; one that fails otherwise reports none of them."""
        plan = plan_for(root, self.timeout_s, self.egress.max_mb_s)
        try:  # the root's last answer heartbeats while its subtree finishes (toolrl.weightsync.relay)
            answer = push_weights(root.url, named, version, token=self.token, bucket_mb=self.bucket_mb,
                                  timeout_s=self.timeout_s, egress=self.egress, headers={PLAN_HEADER: plan.header()})
        except WeightSyncError as exc:
            return {root.id: {"error": str(exc)}, **reported_below(root, exc.tree)}
        return outcomes_of(root, answer)

    def forget(self, live: set[tuple[str, str]]) -> None:
        pass  # nothing is kept per worker


def push_weights(url: str, named: list[tuple[str, torch.Tensor]], version: int, *, token: str | None = None,
                 bucket_mb: int = 64, timeout_s: float = 120.0, client: httpx.Client | None = None,
                 egress: Egress | None = None, headers: dict[str, str] | None = None) -> dict:
    """Send a full set of weights to one worker; returns its final answer (with `reload_s`).

    Each bucket is streamed from the tensors' own memory (no serialised copy); the next bucket's
    header and checksum are computed in a thread while this one is on the wire. `egress` counts
    (and paces) the bytes; `headers` go with every bucket."""
    # The worker loads each bucket as the next one arrives: send the smallest first, so loading
    # starts soonest, then the biggest, so what is left after the last byte is a small load.
    by_size = sorted(bucketize(named, bucket_mb << 20), key=lambda b: sum(t.numel() * t.element_size() for _, t in b))
    buckets = by_size[:1] + by_size[:0:-1]
    own = client is None
    client = client or httpx.Client(timeout=timeout_s)
    egress = egress or Egress()
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
                resp = client.post(f"{url.rstrip('/')}/update_weights", content=_slices(header, views, egress),
                                   timeout=timeout_s, headers={"Content-Type": CONTENT_TYPE,
                                                               "Content-Length": str(size),
                                                               **auth_headers(token), **(headers or {})})
            except httpx.HTTPError as exc:
                raise WeightSyncError(f"{url}: bucket {i + 1}/{len(buckets)} of version {version}: "
                                      f"{type(exc).__name__}: {exc}") from None
            if resp.status_code != 200:
                raise refused(url, i, len(buckets), version, resp)
            answer = resp.json()
        return confirm_loaded(url, answer, version, t0)
    finally:
        pool.shutdown(cancel_futures=True)
        if own:
            client.close()


def refused(who: str, index: int, count: int, version: int, resp: httpx.Response) -> WeightSyncError:
    """A worker's non-200 answer to a bucket as an error, with the worker's reason."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    detail = body["detail"] if isinstance(body, dict) and "detail" in body else resp.text
    return WeightSyncError(f"{who}: bucket {index + 1}/{count} of version {version}: HTTP {resp.status_code}: "
                           f"{str(detail)[:300]}", need_full=isinstance(body, dict) and body.get("need_full") is True)


def _slices(header: bytes, views: list[memoryview], egress: Egress) -> Iterator[bytes | memoryview]:
    """A bucket's bytes in pieces (a big embedding is not handed over whole), counted and paced."""
    step = egress.chunk
    egress.pace(len(header))
    yield header
    for v in views:
        for a in range(0, v.nbytes, step):
            piece = v[a:a + step]
            egress.pace(piece.nbytes)
            yield piece
