"""A gen worker's real weight receiver with a stand-in for its engine: for the fan-out and delta
tests, bench/fanout.py and bench/delta.py, where eight vLLM engines do not fit one machine.

    python -m toolrl.worker.standin --id w1 --port 8301 [--token T] [--timeout-s S]

It serves the worker's own HTTP API (toolrl.worker.app: POST /update_weights through the real
WeightGate, WeightAssembler and relay, slot files in /dev/shm) and `GET /loaded`: the version
loaded, a digest of every tensor and the bytes received in all. The stand-in engine reads each
bucket's slot file as soon as it is ready, through the real loader's reader
(toolrl.weightsync.vllm_ext.iter_bucket_files), as vLLM's in-place reload does, and records the
digests instead of loading them on a device.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path

import torch
import xxhash

from toolrl.config import Config
from toolrl.net import LocalService, serve
from toolrl.weightsync.gate import WeightGate
from toolrl.weightsync.receiver import WeightAssembler, remove_stale_weight_dirs
from toolrl.weightsync.vllm_ext import iter_bucket_files
from toolrl.worker.app import build_app


class FixedRegistry:
    """The worker registry as the learner's pusher reads it (`workers()`, `set_version()`), for a
    fixed set of stand-in workers and no reference server."""

    def __init__(self, workers: list[dict]):
        self.list, self.versions = list(workers), []

    def workers(self) -> list[dict]:
        return [dict(w) for w in self.list]

    def set_version(self, v: int) -> None:
        self.versions.append(v)


def standin_service(worker_id: str, port: int, token: str, log_path: str | Path,
                    timeout_s: float = 120.0) -> LocalService:
    """A stand-in worker as a child process (`.start()` waits for its /health), and its registry entry
    as `.worker`."""
    svc = LocalService("toolrl.worker.standin", ["--id", worker_id, "--port", str(port), "--token", token,
                                                 "--timeout-s", str(timeout_s)],
                       f"http://127.0.0.1:{port}", log_path=log_path, startup_timeout_s=300)
    svc.worker = {"id": worker_id, "url": svc.url, "policy_version": 0}
    return svc


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-64 of a tensor's dtype, shape and bytes: equal digests, bit-exact equal tensors."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    h = xxhash.xxh3_64(f"{t.dtype}{tuple(t.shape)}".encode())
    if flat.numel():
        h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


class RecordingEngine:
    """Loads an update as the worker's engine would (bucket by bucket, each as soon as it is
    ready) and records what it read. Nothing is generated, so aborts have nothing to stop."""

    def __init__(self):
        self.digests: dict[str, str] = {}
        self.loads = 0

    async def load_buckets(self, weights_dir: str, update_id: int, count: int, timeout_s: float) -> float:
        t0 = time.time()

        def read() -> dict[str, str]:
            return {n: tensor_digest(t) for n, t in iter_bucket_files(weights_dir, update_id, count, timeout_s)}

        self.digests = await asyncio.to_thread(read)
        self.loads += 1
        return time.time() - t0

    async def abort(self, request_ids: list[str]) -> None:
        pass

    async def abort_all(self) -> int:
        return 0


class StandinWorker:
    """What toolrl.worker.app.build_app reads of a GenWorker, for weight updates."""

    def __init__(self, worker_id: str, token: str | None, timeout_s: float):
        self.cfg = Config.model_validate({"rollout": {"token": token}, "learner": {"sync_timeout_s": timeout_s}})
        self.worker_id = worker_id
        self.engine = RecordingEngine()
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
        remove_stale_weight_dirs(shm)
        assembler = WeightAssembler(shm / f"toolrl-weights-{worker_id}-{os.getpid()}", wait_s=timeout_s)
        self.gate = WeightGate(self.engine, assembler, drain_timeout_s=timeout_s, sync_timeout_s=timeout_s,
                               name=worker_id, token=token)

    @property
    def version(self) -> int:
        return self.gate.version

    def stats_dict(self) -> dict:
        return {"worker_id": self.worker_id, "policy_version": self.gate.version, "loads": self.engine.loads}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--id", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--token")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per relayed bucket otherwise
    worker = StandinWorker(args.id, args.token, args.timeout_s)
    app = build_app(worker)

    @app.get("/loaded")
    async def loaded():
        return {"worker_id": worker.worker_id, "version": worker.gate.version, "weights_ok": worker.gate.weights_ok,
                "loads": worker.engine.loads, "digests": worker.engine.digests,
                "received_bytes": worker.gate.assembler.received_bytes}

    # uvicorn re-raises SIGTERM once it has shut down, so a `finally` here would never run
    app.router.on_shutdown.append(worker.gate.assembler.close)
    serve(app, args.host, args.port, args.token, "rollout")


if __name__ == "__main__":
    main()
