"""The one interface every weight-sync transport implements, and what they share.

    transport.push(worker, named, version) -> the worker's answer, after it has loaded `version`
    transport.forget(live)                 -> drop what is kept for workers no longer in `live`

`worker` is a registry entry ({"id", "url", ...}); `named` is [(name, tensor)] in the order the
engine loads them. A push either returns a confirmed answer or raises WeightSyncError: a sync is
confirmed, never assumed. Transports: `http` (toolrl.weightsync.http, any machine) and
`process_group` (toolrl.weightsync.process_group, NCCL between GPUs, gloo on CPU).
"""
from __future__ import annotations

import time
from typing import Protocol

import torch


class WeightSyncError(RuntimeError):
    """A sender could not bring a worker to a version (it names the worker and the step). `tree`:
    what the worker reported about the workers below it in a fan-out tree, when it did.
    `need_full`: the worker refused a delta update, or could not apply it; a full update will do."""

    def __init__(self, message: str, tree: dict | None = None, need_full: bool = False):
        super().__init__(message)
        self.tree, self.need_full = tree, need_full


class BucketOrderError(ValueError):
    """The worker refuses an update part that is out of place (order, version, group)."""


class BaseMissing(BucketOrderError):
    """A delta bucket for a base this worker does not hold whole (it is new, its last update failed,
    or the layout changed): refused before its body is read. `holds`: the version its slots do hold
    whole, or None."""
    need_full = True

    def __init__(self, message: str, holds: int | None):
        super().__init__(message)
        self.holds = holds


class UpdateAborted(RuntimeError):
    """A weight update superseded by a newer one, or cut short by a bad bucket."""


class Transport(Protocol):
    name: str

    def push(self, worker: dict, named: list[tuple[str, torch.Tensor]], version: int) -> dict: ...

    def forget(self, live: set[tuple[str, str]]) -> None: ...


def confirm_loaded(url: str, answer: dict, version: int, t0: float) -> dict:
    """A worker's answer to the last part of an update, whatever the transport: it must say it
    loaded `version`. Adds the push's wall time. (A fan-out root that failed itself still reports
    the workers below it: they stay on the error.)"""
    if answer.get("version") != version or not answer.get("loaded"):
        said = answer.get("error") or {k: v for k, v in answer.items() if k != "tree"}
        raise WeightSyncError(f"{url}: worker did not confirm loading version {version}: {said}",
                              tree=answer.get("tree"))
    answer["push_s"] = time.time() - t0
    return answer
