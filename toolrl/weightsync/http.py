"""HTTP weight sync, the learner's side: ordered safetensors buckets streamed to a worker.

`push_weights` splits named tensors into buckets of about `bucket_mb` and POSTs them in order to
`{worker}/update_weights`, each streamed from the tensors' own memory. It returns the worker's
answer to the last bucket, which comes only after the worker has loaded the weights. Every
request has a timeout; a failure raises `WeightSyncError` naming the worker and the bucket, never
passes silently. The worker's side is toolrl.weightsync.receiver. Works anywhere, CPU included.

With `learner.sync_fanout` the learner sends to the root of a tree of workers instead, with the
plan of the tree (`push_tree`; toolrl.weightsync.fanout), and the workers relay it
(toolrl.weightsync.relay).

A sync frames its update once (`prepare`: toolrl.weightsync.outgoing), and a push with `delta`
sends each bucket as a delta from the version the learner sent last, where one was made; a worker
that refuses a delta or cannot apply it (`need_full`) gets the full update at once.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Iterator

import httpx
import torch

from toolrl.net import auth_headers
from toolrl.protocol import CONTENT_TYPE
from toolrl.weightsync.egress import Egress
from toolrl.weightsync.fanout import PLAN_HEADER, PlanNode, outcomes_of, plan_for, reported_below
from toolrl.weightsync.outgoing import EncoderBusy, LastSent, Outgoing
from toolrl.weightsync.transport import WeightSyncError, confirm_loaded

log = logging.getLogger("learner")


class HttpTransport:
    """`learner.sync_transport: http`. All pushes share one `Egress`: the learner's link, counted
    and capped at `max_mb_s` (MiB/s) when set. Between `prepare` and `release` (one sync) every push
    of that version shares its framed buckets and deltas."""
    name = "http"

    def __init__(self, token: str | None, bucket_mb: int, timeout_s: float, max_mb_s: float | None = None):
        self.token, self.bucket_mb, self.timeout_s = token, bucket_mb, timeout_s
        self.egress = Egress(max_mb_s)
        self.last: LastSent | None = None  # the last version sent, kept for deltas
        self.out: Outgoing | None = None  # the update of the sync under way

    def prepare(self, named: list[tuple[str, torch.Tensor]], version: int, keep: bool) -> int | None:
        """Frame `version`'s update for the pushes of one sync. With `keep`, the learner keeps a copy
        of it for the next sync's deltas (one copy of the weights; without, a copy kept is dropped).
        Returns the version this sync's deltas apply to, or None: no deltas this time."""
        self.out = None
        if not keep and (self.last is None or self.last.version != version):
            self.last = None
        elif keep and self.last is None:
            self.last = LastSent()
        try:
            self.out = Outgoing(named, version, self.bucket_mb << 20, self.last, wait_s=self.timeout_s)
        except EncoderBusy as exc:  # never wait on it again: start over with a fresh copy
            log.warning("%s; keeping version %d afresh, no deltas this sync", exc, version)
            self.last = LastSent()
            self.out = Outgoing(named, version, self.bucket_mb << 20, self.last, wait_s=self.timeout_s)
        return self.out.base

    def release(self) -> Outgoing | None:
        """The sync is over: its deltas and the references to its weights go (the copy kept stays)."""
        out, self.out = self.out, None
        return out

    def _outgoing(self, named, version: int) -> Outgoing:
        out = self.out
        return out if out is not None and out.version == version else Outgoing(named, version, self.bucket_mb << 20)

    def push(self, worker: dict, named: list[tuple[str, torch.Tensor]], version: int, delta: bool = False) -> dict:
        return push_weights(worker["url"], named, version, token=self.token, timeout_s=self.timeout_s,
                            egress=self.egress, out=self._outgoing(named, version), delta=delta)

    def push_tree(self, root: PlanNode, named: list[tuple[str, torch.Tensor]], version: int,
                  delta: bool = False) -> dict[str, dict]:
        """Send an update once, to `root`, with the plan of its subtree. -> the outcome of every
        worker in the tree, by id: its answer to the last bucket, or {"error"} (with "need_full" when
        the worker refused the delta or could not apply it). A root whose own load failed still
        reports the workers below it; one that fails otherwise reports none of them."""
        plan = plan_for(root, self.timeout_s, self.egress.max_mb_s)
        try:  # the root's last answer heartbeats while its subtree finishes (toolrl.weightsync.relay)
            answer = push_weights(root.url, named, version, token=self.token, timeout_s=self.timeout_s,
                                  egress=self.egress, headers={PLAN_HEADER: plan.header()},
                                  out=self._outgoing(named, version), delta=delta)
        except WeightSyncError as exc:
            return {root.id: {"error": str(exc)}, **reported_below(root, exc.tree)}
        except Exception as exc:  # an answer that is not what a worker sends: the root failed, no more
            return {root.id: {"error": f"{root.url}: {type(exc).__name__}: {exc}"}}
        return outcomes_of(root, answer)

    def forget(self, live: set[tuple[str, str]]) -> None:
        pass  # nothing is kept per worker


def push_weights(url: str, named: list[tuple[str, torch.Tensor]], version: int, *, token: str | None = None,
                 bucket_mb: int = 64, timeout_s: float = 120.0, client: httpx.Client | None = None,
                 egress: Egress | None = None, headers: dict[str, str] | None = None,
                 out: Outgoing | None = None, delta: bool = False) -> dict:
    """Send a full set of weights to one worker; returns its final answer (with `reload_s`).

    Each bucket is streamed from the tensors' own memory (no serialised copy), framed once per sync
    (`out`, or here). With `delta`, each bucket goes as a delta from the version the learner sent
    last where `out` made one; if the worker refuses it or cannot apply it (`need_full`), the update
    starts again, whole. `egress` counts (and paces) the bytes; `headers` go with every bucket."""
    out = out or Outgoing(named, version, bucket_mb << 20)
    own = client is None
    client = client or httpx.Client(timeout=timeout_s)
    egress = egress or Egress()
    t0 = time.time()
    try:
        try:
            return confirm_loaded(url, _send(client, url, out, delta, token, timeout_s, egress, headers), version, t0)
        except WeightSyncError as exc:
            if not (delta and exc.need_full):
                raise
            log.warning("%s: %s; sending version %d whole", url, exc, version)
        return confirm_loaded(url, _send(client, url, out, False, token, timeout_s, egress, headers), version, t0)
    finally:
        if own:
            client.close()


def _send(client: httpx.Client, url: str, out: Outgoing, delta: bool, token: str | None, timeout_s: float,
          egress: Egress, headers: dict[str, str] | None) -> dict:
    """Every bucket of `out` in order -> the worker's answer to the last one. The next bucket is
    framed (its checksum computed) in a thread while this one is on the wire."""
    answer: dict = {}
    deltas = 0
    with cf.ThreadPoolExecutor(max_workers=1) as pool:
        for i in range(out.count):
            if i + 1 < out.count:
                pool.submit(out.full, i + 1)
            answer = _send_one(client, url, out, i, delta, token, timeout_s, egress, headers)
            deltas += answer.pop("_delta")
    answer["delta_buckets"] = deltas
    return answer


def _send_one(client: httpx.Client, url: str, out: Outgoing, i: int, delta: bool, token: str | None,
              timeout_s: float, egress: Egress, headers: dict[str, str] | None) -> dict:
    """Bucket i (as a delta where one was made and `delta`) -> the worker's answer."""
    framed = out.delta(i) if delta else None
    kind = "delta" if framed is not None else "full"
    header, views = framed or out.full(i)
    size = len(header) + sum(v.nbytes for v in views)
    try:
        resp = client.post(f"{url.rstrip('/')}/update_weights", content=_slices(header, views, egress),
                           timeout=timeout_s, headers={"Content-Type": CONTENT_TYPE, "Content-Length": str(size),
                                                       **auth_headers(token), **(headers or {})})
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"{url}: bucket {i + 1}/{out.count} of version {out.version}: "
                              f"{type(exc).__name__}: {exc}") from None
    finally:
        out.count_sent(kind, size)
    if resp.status_code != 200:
        raise refused(url, i, out.count, out.version, resp)
    return {**resp.json(), "_delta": kind == "delta"}


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
