"""Weight sync over a process group (`learner.sync_transport: process_group`): NCCL between GPUs,
gloo on CPU. The tensors go straight from the learner's memory into the worker engine's, with no
file in between; the HTTP endpoints of the worker only carry the control messages.

Each worker gets its own two-rank group (the learner is rank 0 and hosts the rendezvous store),
so workers can come and go without rebuilding anyone else's group:

1. `LearnerGroup(...)` opens a TCPStore on `learner.sync_host`, asks the worker to join
   (`POST /weight_group`: its engine process builds rank 1 of the group) and builds rank 0.
2. `LearnerGroup.push(named, version)` sends the names, dtypes and shapes
   (`POST /update_weights_broadcast`); the worker drains its rollouts and then receives every
   tensor by broadcast, feeding vLLM's layer-wise in-place reload as each arrives
   (toolrl.weightsync.vllm_ext); the learner broadcasts them in the same order. The HTTP answer comes after
   the load, as with the HTTP transport.

Every rendezvous and every broadcast has a timeout; a group that failed is dropped and rebuilt at
the next push.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import datetime
import itertools
import os
import queue
import threading
import time

import httpx
import torch
import torch.distributed as dist

from toolrl.net import auth_headers
from toolrl.weightsync.transport import WeightSyncError, confirm_loaded


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def make_group(backend: str, host: str, port: int, rank: int, world_size: int, group_id: str,
               timeout_s: float, store=None):
    """One side of a stateless process group (no global torch.distributed state is touched, so it
    lives beside DeepSpeed's group in the learner and vLLM's in the engine) -> (group, store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"toolrl/{group_id}", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), prefixed
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts), prefixed
    raise ValueError(f"unknown process-group backend {backend!r} (nccl or gloo)")


def ready_key(push_id: str) -> str:
    """Set by the worker when it is about to receive push `push_id`: the learner broadcasts only
    then, so a refused update never leaves a collective hanging (NCCL's watchdog would kill the
    process)."""
    return f"ready/{push_id}"


def broadcast(group, tensor: torch.Tensor, timeout_s: float, give_up=None) -> None:
    """Broadcast from rank 0. `give_up()` is polled while waiting: a worker that refused the update
    over HTTP will never join the broadcast, and the learner should not wait out the timeout."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    work = group.broadcast([tensor], opts)
    if give_up is None:
        work.wait(datetime.timedelta(seconds=timeout_s))
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if give_up():
            raise WeightSyncError("the worker refused the update")
        if time.monotonic() > deadline:
            raise TimeoutError(f"broadcast did not complete in {timeout_s:.0f}s")
        time.sleep(0.005)
    work.wait()  # raises the collective's own error, if any


def receive_weights(group, specs: list, device: str, timeout_s: float, ahead: int = 8):
    """Rank 1: (name, tensor) for each [name, dtype, shape] of `specs`, received in that order.
    A thread receives up to `ahead` tensors ahead of the consumer, so receiving overlaps the
    engine's loading (on CPU, 651 MB: 1.92 s, against 2.21 s received in line with loading)."""
    q: queue.Queue = queue.Queue(maxsize=ahead)
    stop = threading.Event()

    def receive():
        try:
            for name, dtype, shape in specs:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                broadcast(group, t, timeout_s)
                while not stop.is_set():
                    try:
                        q.put((name, t), timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            with contextlib.suppress(queue.Full):
                q.put(exc, timeout=timeout_s)

    thread = threading.Thread(target=receive, daemon=True, name="toolrl-receive-weights")
    thread.start()
    try:
        for _ in specs:
            item = q.get(timeout=timeout_s + 5)
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=timeout_s)


_ids = itertools.count()


class LearnerGroup:
    """Rank 0 of one worker's group, on the learner."""

    def __init__(self, worker: dict, host: str, token: str | None = None, backend: str | None = None,
                 timeout_s: float = 120.0):
        self.url, self.worker_id, self.token = worker["url"].rstrip("/"), worker["id"], token
        self.backend, self.timeout_s = backend or default_backend(), timeout_s
        self.device = f"cuda:{torch.cuda.current_device()}" if self.backend == "nccl" else "cpu"
        self.group_id = f"{os.getpid()}-{next(_ids)}-{time.time_ns()}"
        self.store = dist.TCPStore(host, 0, 2, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)  # port 0: the OS picks a free one
        port = self.store.port
        spec = {"group_id": self.group_id, "host": host, "port": port, "rank": 1, "world_size": 2,
                "backend": self.backend, "timeout_s": timeout_s}
        # Both ranks must be inside the rendezvous at once: rank 0 waits for it in a thread, and if
        # the worker cannot be asked to join (dead, refusing), nobody waits out the timeout.
        made: dict = {}

        def rank0():
            try:
                made["group"] = make_group(self.backend, host, port, 0, 2, self.group_id, timeout_s, self.store)
            except Exception as exc:
                made["error"] = exc

        t = threading.Thread(target=rank0, daemon=True, name=f"toolrl-group-{self.worker_id}")
        t.start()
        self._post("/weight_group", spec, timeout_s)
        t.join(timeout_s)
        if "group" not in made:
            raise WeightSyncError(f"{self.url}: process group {self.group_id}: "
                                  f"{made.get('error', 'rendezvous timed out')}")
        self.group, self.kv = made["group"]

    def _post(self, path: str, body: dict, timeout_s: float) -> dict:
        try:
            r = httpx.post(f"{self.url}{path}", json=body, timeout=timeout_s, headers=auth_headers(self.token))
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise WeightSyncError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def push(self, named: list[tuple[str, torch.Tensor]], version: int, drain_s: float = 300.0) -> dict:
        """Broadcast a full set of weights; returns the worker's answer once it has loaded them."""
        t0 = time.time()
        specs = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in named]
        push_id = f"{version}-{next(_ids)}"
        wait_s = self.timeout_s + drain_s  # the worker drains its rollouts before it receives
        with cf.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(self._post, "/update_weights_broadcast",
                                 {"group_id": self.group_id, "version": version, "push_id": push_id,
                                  "specs": specs}, wait_s)
            refused = lambda: answer.done() and answer.exception() is not None  # noqa: E731
            deadline = time.monotonic() + wait_s
            while not self.kv.check([ready_key(push_id)]):  # the worker drains first
                if refused():
                    raise answer.exception()
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"{self.url}: not ready to receive version {version} in {wait_s:.0f}s")
                time.sleep(0.01)
            try:
                for _, t in named:
                    broadcast(self.group, t.to(self.device).contiguous(), self.timeout_s, give_up=refused)
            except Exception as exc:
                if refused():
                    raise answer.exception() from None  # the worker's reason is the better one
                raise WeightSyncError(f"{self.url}: broadcast of version {version}: {exc}") from None
            res = answer.result()
        return confirm_loaded(self.url, res, version, t0)


class ProcessGroupTransport:
    """`learner.sync_transport: process_group`: one LearnerGroup per worker, built at its first push
    and rebuilt after any failure (it is out of step with the worker then)."""
    name = "process_group"

    def __init__(self, host: str, token: str | None, timeout_s: float, drain_s: float):
        self.host, self.token, self.timeout_s, self.drain_s = host, token, timeout_s, drain_s
        self.groups: dict[tuple[str, str], LearnerGroup] = {}

    def push(self, worker: dict, named: list[tuple[str, torch.Tensor]], version: int) -> dict:
        key = (worker["id"], worker["url"])
        try:
            if key not in self.groups:
                self.groups[key] = LearnerGroup(worker, self.host, token=self.token, timeout_s=self.timeout_s)
            return self.groups[key].push(named, version, drain_s=self.drain_s)
        except Exception as exc:
            self.groups.pop(key, None)
            raise exc if isinstance(exc, WeightSyncError) else WeightSyncError(f"{worker['url']}: {exc}") from None

    def forget(self, live: set[tuple[str, str]]) -> None:
        self.groups = {k: g for k, g in self.groups.items() if k in live}
