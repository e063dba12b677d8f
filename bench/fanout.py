"""Weight updates to 1, 2, 4 and 8 receivers: the learner pushing to every one (fanout 0) against a
fan-out tree (fanout 2), each sender under the same egress cap.

    python bench/fanout.py [--receivers 1,2,4,8] [--fanout 2] [--mb 128] [--bucket-mb 8]
                           [--max-mb-s 64] [--repeats 2]

Receivers are real gen-worker weight receivers, one process each (toolrl.worker.standin: the
worker's HTTP API, gate, assembler and relay), with a STAND-IN for the engine's load: it reads
every bucket's slot file as vLLM's loader does and records tensor digests, which are checked after
every sync, but loads nothing into an engine. The learner is the real WeightSync over the HTTP
transport. On one host every copy costs the same CPU whatever the tree, so each sender's egress is
capped (--max-mb-s, MiB/s) to emulate one link per node.

Last line: JSON with egress_ratio (the learner's bytes per sync over one copy, tree, at the largest
receiver count), direct_egress_ratio, and sync_s per receiver count for both modes (medians).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolrl.config import load_config  # noqa: E402
from toolrl.net import free_port  # noqa: E402
from toolrl.weightsync.fanout import make_plans  # noqa: E402
from toolrl.weightsync.pusher import WeightSync  # noqa: E402
from toolrl.worker.standin import FixedRegistry, standin_service, tensor_digest  # noqa: E402

TOKEN = "bench-fanout"


def weights(mb: int) -> list[tuple[str, torch.Tensor]]:
    """`mb` MiB of bf16 in 8-MiB matrices (a 1B-class model's shapes), and a step counter."""
    g = torch.Generator().manual_seed(0)
    n = max(1, mb // 8)
    return [(f"model.layers.{i}.mlp.weight", torch.randn(1024, 4096, generator=g).to(torch.bfloat16))
            for i in range(n)] + [("model.step", torch.zeros(1, dtype=torch.int64))]


class Receivers:
    """Stand-in receivers as child processes (toolrl.worker.standin), stopped with SIGTERM."""

    def __init__(self, n: int, log_dir: Path):
        self.services = []
        try:
            for i in range(n):
                self.services.append(standin_service(f"r{i}", free_port(), TOKEN, log_dir / f"r{i}.log").start())
        except BaseException:
            self.stop()
            raise
        self.workers = [svc.worker for svc in self.services]

    def stop(self) -> None:
        for svc in self.services:
            svc.stop()


def sync(workers, named, version: int, fanout: int, args) -> dict:
    """One timed push of `named` at `version` to `workers`; every receiver's digests are checked."""
    named[-1][1].fill_(version)  # each version's weights differ
    cfg = load_config(ROOT / "configs/cpu_tiny.yaml", [
        "logging.wandb_mode=disabled", f"rollout.token={TOKEN}", f"learner.sync_fanout={fanout}",
        f"learner.sync_bucket_mb={args.bucket_mb}", f"learner.sync_max_mb_s={args.max_mb_s}",
        "learner.sync_timeout_s=120", "learner.sync_retries=0"])
    res = WeightSync(cfg, FixedRegistry(workers)).push(named, version)
    if res["failed"]:
        raise RuntimeError(f"sync of version {version} failed: {res['failed']}")
    want = {n: tensor_digest(t) for n, t in named}
    for w in workers:
        got = httpx.get(f"{w['url']}/loaded", timeout=30).json()
        if got["version"] != version or got["digests"] != want:
            raise RuntimeError(f"{w['id']} does not hold version {version} bit-exact")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--receivers", default="1,2,4,8")
    ap.add_argument("--fanout", type=int, default=2)
    ap.add_argument("--mb", type=int, default=128, help="MiB of weights")
    ap.add_argument("--bucket-mb", type=int, default=8)
    ap.add_argument("--max-mb-s", type=float, default=64.0, help="egress cap per sender, MiB/s")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    counts = [int(x) for x in args.receivers.split(",")]
    named = weights(args.mb)
    size_mb = sum(t.numel() * t.element_size() for _, t in named) / 2**20
    print(f"weights: {size_mb:.0f} MiB bf16 in {len(named)} tensors, {args.bucket_mb}-MiB buckets; egress cap "
          f"{args.max_mb_s:g} MiB/s per sender; fanout {args.fanout} against direct pushes", flush=True)
    print("receivers: real gen-worker receivers (HTTP API, gate, assembler, relay), one process each; "
          "engine load: STAND-IN (reads the slot files as vLLM's loader does, records digests; no vLLM)", flush=True)
    load0 = os.getloadavg()[0]
    version = 0
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as logs:
        rx = Receivers(max(counts), Path(logs))
        try:
            version += 1  # warm-up: slot files created, connections and code paths warm
            copy = sync(rx.workers[:1], named, version, 0, args)["egress_bytes"]
            version += 1
            sync(rx.workers, named, version, args.fanout, args)
            times = {"direct": {}, "tree": {}}
            egress = {"direct": {}, "tree": {}}
            for n in counts:
                for _ in range(args.repeats):
                    for mode, k in (("direct", 0), ("tree", args.fanout)):  # alternated: the host drifts
                        version += 1
                        res = sync(rx.workers[:n], named, version, k, args)
                        times[mode].setdefault(n, []).append(res["sync_s"])
                        egress[mode][n] = res["egress_bytes"] / copy
                depth = make_plans(rx.workers[:n], args.fanout)[0].height
                print(f"{n} receiver(s): direct {statistics.median(times['direct'][n]):6.2f} s "
                      f"(egress {egress['direct'][n]:.2f} copies) | tree {statistics.median(times['tree'][n]):6.2f} s "
                      f"(egress {egress['tree'][n]:.2f} copies, depth {depth})  "
                      f"runs: {[round(x, 2) for x in times['direct'][n]]} {[round(x, 2) for x in times['tree'][n]]}",
                      flush=True)
        finally:
            rx.stop()
    one = size_mb / args.max_mb_s  # one copy through one capped link
    largest = max(counts)
    med = {m: {n: round(statistics.median(v), 3) for n, v in times[m].items()} for m in times}
    growth = {m: med[m][largest] / med[m][min(counts)] for m in med}
    print(f"one copy through one capped link: {one:.2f} s; at {largest} receivers the tree takes "
          f"{growth['tree']:.2f}x its time at {min(counts)} (log2 {largest} = {math.log2(largest):.0f}), "
          f"direct pushes {growth['direct']:.2f}x")
    print(json.dumps({"egress_ratio": round(egress["tree"][largest], 4),
                      "direct_egress_ratio": round(egress["direct"][largest], 4),
                      "sync_s": med, "fanout": args.fanout, "weights_mb": round(size_mb, 1),
                      "bucket_mb": args.bucket_mb, "max_mb_s": args.max_mb_s, "repeats": args.repeats,
                      "one_copy_s": round(one, 3), "engine": "stand-in (no vLLM)",
                      "loadavg_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)]}))


if __name__ == "__main__":
    main()
