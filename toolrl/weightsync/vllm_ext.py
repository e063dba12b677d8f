"""Runs inside vLLM's worker process (a `worker_extension_cls`): loads a weight update bucket by
bucket while the rest is still arriving.

The gen worker's HTTP side (toolrl.weightsync.receiver.WeightAssembler) streams bucket i of update u into the
slot file `bucket-{i:05d}.safetensors` and, once it is whole and its checksum holds, creates the
marker `ready-{u}-{i:05d}`. `toolrl_load_buckets` feeds vLLM's in-place, layer-wise reload from
the slots in order, waiting for each marker, so the reload of the first layers overlaps the
transfer of the last.

If the update stops arriving (a timeout, or the `abort-{u}` marker the HTTP side writes when a
bucket is bad or superseded), this raises and the model is left half-loaded: the gen worker then
refuses to generate until a whole update loads.
"""
from __future__ import annotations

import time
from pathlib import Path

from safetensors import safe_open

from toolrl.weightsync.process_group import make_group, ready_key, receive_weights
from toolrl.weightsync.receiver import abort_file, bucket_file, progress_file, ready_file


def iter_bucket_files(weights_dir: str, update_id: int, count: int, timeout_s: float, poll_s: float = 0.002):
    """(name, tensor) from buckets 0..count-1 of an update, each read as soon as it is ready. A
    bucket is given up on after `timeout_s` in which no byte of the update arrived (progress_file),
    not `timeout_s` in all: a large bucket on a slow, steady link takes longer (found in review:
    a 1 GB embedding bucket at 6 MiB/s failed every load, and with it every worker's generation)."""

    d = Path(weights_dir)
    for i in range(count):
        deadline = time.monotonic() + timeout_s
        while True:
            if (d / abort_file(update_id)).exists():  # checked first: a superseded update reads no more
                raise RuntimeError(f"weight update {update_id} was aborted before bucket {i}/{count}")
            if (d / ready_file(update_id, i)).exists():
                break
            if time.monotonic() > deadline:
                try:
                    idle = time.time() - (d / progress_file(update_id)).stat().st_mtime
                except OSError:
                    idle = float("inf")
                if idle > timeout_s:
                    raise TimeoutError(f"bucket {i}/{count} of weight update {update_id} did not arrive: no byte "
                                       f"of the update in {timeout_s:.0f}s")
                deadline = time.monotonic() + timeout_s - idle
            time.sleep(poll_s)
        with safe_open(d / bucket_file(i), framework="pt") as f:  # validates the tensor table
            for name in f.keys():
                yield name, f.get_tensor(name)


class WeightLoaderExtension:
    """Mixed into vLLM's Worker class by `worker_extension_cls`; called through `collective_rpc`.
    Two ways in: bucket files streamed over HTTP (`toolrl_load_buckets`) and a process group the
    learner broadcasts on (`toolrl_join_group`, `toolrl_load_broadcast`; toolrl.weightsync.process_group)."""

    def toolrl_load_buckets(self, weights_dir: str, update_id: int, count: int, timeout_s: float) -> float:
        t0 = time.time()
        self.reload_weights(weights_iterator=iter_bucket_files(weights_dir, update_id, count, timeout_s),
                            is_checkpoint_format=True)
        return time.time() - t0

    def toolrl_join_group(self, group_id: str, host: str, port: int, rank: int, world_size: int, backend: str,
                          timeout_s: float) -> None:
        groups = self.__dict__.setdefault("_toolrl_groups", {})
        groups.clear()  # one learner at a time: a new group replaces the old one
        groups[group_id] = make_group(backend, host, port, rank, world_size, group_id, timeout_s)

    def toolrl_load_broadcast(self, group_id: str, push_id: str, specs: list, timeout_s: float) -> float:
        group, store = self.__dict__.get("_toolrl_groups", {}).get(group_id, (None, None))
        if group is None:
            raise RuntimeError(f"no process group {group_id!r}: join it first")
        store.set(ready_key(push_id), "1")
        device = str(self.device) if hasattr(self, "device") else "cpu"
        t0 = time.time()
        try:
            self.reload_weights(weights_iterator=receive_weights(group, specs, device, timeout_s),
                                is_checkpoint_format=True)
        except BaseException:
            self._toolrl_groups.pop(group_id, None)  # out of step with the learner now: never reuse it
            raise
        return time.time() - t0
