"""Weight sync over HTTP: the learner streams ordered safetensors buckets, a worker assembles them.

Sender: `push_weights` splits named tensors into buckets of about `bucket_mb`, POSTs them in order
to `{worker}/update_weights`, and returns the worker's answer to the last bucket, which comes only
after the worker has loaded the weights. Every request has a timeout; a failure raises
`WeightSyncError` naming the worker and the bucket, never passes silently.

Receiver: `WeightAssembler` checks the order and the version of each bucket and, when the last one
arrives, writes one safetensors file (atomically) that vLLM's in-place reload reads.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from .protocol import CONTENT_TYPE, WeightBucket, bucketize, encode_weight_bucket
from .service import auth_headers


class WeightSyncError(RuntimeError):
    pass


class BucketOrderError(ValueError):
    pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_weight_dirs(parent: str | Path, prefix: str = "toolrl-weights-") -> list[Path]:
    """Remove assembly directories (`{prefix}{worker}-{pid}`) whose process is gone.

    They live in /dev/shm, which is RAM: a worker killed with SIGKILL leaves its last full set of
    weights behind (0.6 GB for SmolLM2 in fp32), and a dozen such runs were enough to make the
    kernel OOM-kill the learner. Every worker sweeps them at start."""
    import shutil

    removed = []
    for d in Path(parent).glob(f"{prefix}*"):
        pid = d.name.rsplit("-", 1)[-1]
        if d.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class WeightAssembler:
    """Receives a version's buckets in order and writes them as one safetensors file in `out_dir`
    (name it `...-{pid}` so `remove_stale_weight_dirs` can tell when its owner is gone)."""

    def __init__(self, out_dir: str | Path, max_bytes: int = 64 << 30):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._reset(None)

    def _reset(self, version: int | None) -> None:
        self.version = version
        self.count = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.next_index = 0
        self.bytes = 0

    def add(self, bucket: WeightBucket) -> bool:
        """Take one bucket; True when the set is complete and written to `path`."""
        if bucket.index == 0:
            self._reset(bucket.version)  # a new update supersedes any half-received one
            self.count = bucket.count
        elif bucket.version != self.version or bucket.index != self.next_index or bucket.count != self.count:
            raise BucketOrderError(
                f"expected bucket {self.next_index}/{self.count} of version {self.version}, "
                f"got {bucket.index}/{bucket.count} of version {bucket.version}")
        for name, t in bucket.tensors:
            if name in self.tensors:
                raise BucketOrderError(f"tensor {name!r} sent twice in version {bucket.version}")
            self.bytes += t.numel() * t.element_size()
            self.tensors[name] = t
        if self.bytes > self.max_bytes:
            self._reset(None)
            raise BucketOrderError(f"weight update is over the limit of {self.max_bytes} bytes")
        self.next_index += 1
        if not bucket.last:
            return False
        tmp = self.out_dir / f".model.safetensors.{os.getpid()}.tmp"
        save_file(self.tensors, str(tmp))
        os.replace(tmp, self.path)
        self.tensors = {}
        return True

    @property
    def path(self) -> Path:
        return self.out_dir / "model.safetensors"

    def close(self) -> None:
        """Remove the directory and the weights in it (RAM, when it is in /dev/shm)."""
        import shutil

        self.tensors = {}
        shutil.rmtree(self.out_dir, ignore_errors=True)


def push_weights(url: str, named: list[tuple[str, torch.Tensor]], version: int, *, token: str | None = None,
                 bucket_mb: int = 64, timeout_s: float = 120.0, client: httpx.Client | None = None) -> dict:
    """Send a full set of weights to one worker; returns its final answer (with `reload_s`)."""
    buckets = bucketize(named, bucket_mb << 20)
    own = client is None
    client = client or httpx.Client(timeout=timeout_s)
    t0 = time.time()
    try:
        answer: dict = {}
        for i, bucket in enumerate(buckets):
            body = encode_weight_bucket(bucket, version, i, len(buckets))
            try:
                resp = client.post(f"{url.rstrip('/')}/update_weights", content=body, timeout=timeout_s,
                                   headers={"Content-Type": CONTENT_TYPE, **auth_headers(token)})
            except httpx.HTTPError as exc:
                raise WeightSyncError(f"{url}: bucket {i + 1}/{len(buckets)} of version {version}: "
                                      f"{type(exc).__name__}: {exc}") from None
            if resp.status_code != 200:
                raise WeightSyncError(f"{url}: bucket {i + 1}/{len(buckets)} of version {version}: "
                                      f"HTTP {resp.status_code}: {resp.text[:300]}")
            answer = resp.json()
        if answer.get("version") != version or not answer.get("loaded"):
            raise WeightSyncError(f"{url}: worker did not confirm loading version {version}: {answer}")
        answer["push_s"] = time.time() - t0
        return answer
    finally:
        if own:
            client.close()
