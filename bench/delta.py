"""Delta weight updates against full ones: bytes per sync and sync time over a rate-limited link.

    python bench/delta.py [--weights runs/proof-warm/export/model.safetensors] [--lr 2e-4]
                          [--max-mb-s 25,100,400] [--bucket-mb 64] [--repeats 2]
                          [--pair A B] [--pair C D] ...

Weights: the SmolLM2-135M export of a real run (bf16, read only), moved by synthetic training
steps like the demo's: an fp32 master behind each bf16 weight (the export plus a residual drawn
uniformly within half a bf16 ulp, which the export does not keep), moved by lr × sign(noise) per
step, the size of Adam's first step (later ones are smaller), and rounded to bf16 again. The
receiver is one real gen-worker weight receiver (toolrl.worker.standin: HTTP API, gate,
assembler, slot files in /dev/shm) with a STAND-IN engine load (reads the slots as vLLM's loader
does, records digests, checked bit-exact after every sync). The learner is the real WeightSync
over HTTP, its egress capped at each --max-mb-s (MiB/s) to emulate a link. Each repeat is a full
push of one step (a fresh learner keeps nothing) then a delta push of the next.

`--pair A B` (safetensors files or DeepSpeed mp_rank_00_model_states.pt) also reports the size of
the delta from A to B, encoded by the learner's own code without sending it: e.g. two real
checkpoints of a run, or the base model against a trained export (an upper bound for one step).

Last line: JSON with, per cap, the median sync time and bytes of full and delta pushes, and the
delta's share of the full bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolrl.config import load_config  # noqa: E402
from toolrl.net import free_port  # noqa: E402
from toolrl.weightsync.outgoing import LastSent, Outgoing  # noqa: E402
from toolrl.weightsync.pusher import WeightSync  # noqa: E402
from toolrl.worker.standin import FixedRegistry, standin_service, tensor_digest  # noqa: E402

TOKEN = "bench-delta"


def load_weights(path: str) -> list[tuple[str, torch.Tensor]]:
    """A safetensors file, or a DeepSpeed model-states file (its module's weights), as named tensors."""
    if path.endswith(".pt"):
        sd = torch.load(path, map_location="cpu", weights_only=False, mmap=True)["module"]
        return [(n, t.clone()) for n, t in sd.items()]  # in memory: encode_s times the CPU, not the disk
    from safetensors.torch import load_file
    return list(load_file(path).items())


class Steps:
    """Consecutive versions of the weights under synthetic training steps (see the module's doc)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], lr: float, seed: int = 0):
        self.lr, self.gen = lr, torch.Generator().manual_seed(seed)
        self.names = [n for n, _ in named]
        self.master = []
        for _, t in named:
            x = t.float()
            ulp = torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126))) - 7)
            self.master.append(x + (torch.rand(x.shape, generator=self.gen) - 0.5) * ulp * (x != 0))
        self.dtype = named[0][1].dtype
        self.current = [(n, t.clone()) for n, t in named]

    def next(self) -> list[tuple[str, torch.Tensor]]:
        for m in self.master:
            m.add_(torch.randn(m.shape, generator=self.gen).sign_().mul_(self.lr))
        self.current = [(n, m.to(self.dtype)) for n, m in zip(self.names, self.master)]
        return self.current


def changed_fraction(a, b) -> float:
    n = sum(t.numel() for _, t in a)
    return sum(int((x.view(torch.int16) != y.view(torch.int16)).sum()) if x.element_size() == 2 else
               int((x != y).sum()) for (_, x), (_, y) in zip(a, b)) / n


def learner(worker: dict, cap: float, bucket_mb: int) -> WeightSync:
    """A fresh learner: it keeps nothing yet, so its first push is full and its second a delta."""
    cfg = load_config(ROOT / "configs/cpu_tiny.yaml", [
        "logging.wandb_mode=disabled", f"rollout.token={TOKEN}", "learner.sync_delta=on",
        f"learner.sync_bucket_mb={bucket_mb}", f"learner.sync_max_mb_s={cap}", "learner.sync_timeout_s=120",
        "learner.sync_retries=0"])
    return WeightSync(cfg, FixedRegistry([worker]))


def push(s: WeightSync, worker: dict, named, version: int) -> dict:
    res = s.push(named, version)
    if res["failed"]:
        raise RuntimeError(f"sync of version {version} failed: {res['failed']}")
    got = httpx.get(f"{worker['url']}/loaded", timeout=60).json()
    if got["version"] != version or got["digests"] != {n: tensor_digest(t) for n, t in named}:
        raise RuntimeError(f"the receiver does not hold version {version} bit-exact")
    return res


def encoded_ratio(a, b, bucket_mb: int) -> dict:
    """The delta from `a` to `b` as the learner encodes it, against the full buckets: nothing sent.
    Only the tensors both hold alike count (a base model may lack the tied lm_head an export has)."""
    da = dict(a)
    b = [(n, t) for n, t in b if n in da and da[n].shape == t.shape and da[n].dtype == t.dtype]
    a = [(n, da[n]) for n, _ in b]
    last = LastSent()
    first = Outgoing(a, 1, bucket_mb << 20, last)
    first.delta(0)
    last.encoder.join(600)
    t0 = time.time()
    out = Outgoing(b, 2, bucket_mb << 20, last)
    full = delta = 0
    for i in range(out.count):
        h, v = out.full(i)
        size = len(h) + sum(x.nbytes for x in v)
        d = out.delta(i)
        full += size
        delta += len(d[0]) + sum(x.nbytes for x in d[1]) if d is not None else size
    last.encoder.join(600)
    return {"tensors": len(b), "full_bytes": full, "delta_bytes": delta, "ratio": round(delta / full, 4),
            "changed_frac": round(changed_fraction(a, b), 4), "encode_s": round(time.time() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default=str(ROOT / "runs/proof-warm/export/model.safetensors"))
    ap.add_argument("--lr", type=float, default=2e-4, help="the demo's (configs/cpu_demo.yaml)")
    ap.add_argument("--max-mb-s", default="25,100,400", help="egress caps to measure, MiB/s")
    ap.add_argument("--bucket-mb", type=int, default=64, help="learner.sync_bucket_mb (its default)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pair", nargs=2, action="append", default=[], metavar=("A", "B"))
    args = ap.parse_args()
    caps = [float(x) for x in args.max_mb_s.split(",")]
    t_start, load0 = time.time(), os.getloadavg()[0]
    named = load_weights(args.weights)
    size_mb = sum(t.numel() * t.element_size() for _, t in named) / 2**20
    print(f"weights: {args.weights}: {size_mb:.0f} MiB in {len(named)} tensors ({named[0][1].dtype}), "
          f"{args.bucket_mb}-MiB buckets; synthetic steps of lr {args.lr:g} (sign of noise, fp32 master "
          f"behind each bf16 weight); egress caps {caps} MiB/s", flush=True)
    print("receiver: a real gen-worker receiver (HTTP API, gate, assembler); engine load: STAND-IN "
          "(reads the slot files as vLLM's loader does, records digests; no vLLM)", flush=True)
    steps = Steps(named, args.lr)
    prev = [(n, t.clone()) for n, t in steps.current]
    ver = 0
    runs: dict[float, dict[str, list]] = {c: {"full_s": [], "delta_s": [], "full_bytes": [], "delta_bytes": []}
                                          for c in caps}
    changed = []
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as logs:
        rx = standin_service("r0", free_port(), TOKEN, Path(logs) / "r0.log").start()
        try:
            current = steps.next()
            changed.append(changed_fraction(prev, current))
            for cap in caps:
                for _ in range(args.repeats):
                    s = learner(rx.worker, cap, args.bucket_mb)
                    ver += 1
                    full = push(s, rx.worker, current, ver)
                    prev, current = current, steps.next()
                    changed.append(changed_fraction(prev, current))
                    ver += 1
                    delta = push(s, rx.worker, current, ver)
                    if not delta["delta_bytes"]:
                        raise RuntimeError("the second push went out whole")
                    r = runs[cap]
                    r["full_s"].append(full["sync_s"])
                    r["delta_s"].append(delta["sync_s"])
                    r["full_bytes"].append(full["egress_bytes"])
                    r["delta_bytes"].append(delta["egress_bytes"])
                    print(f"cap {cap:g} MiB/s: full {full['sync_s']:.2f} s, {full['egress_bytes'] / 2**20:.1f} MiB | "
                          f"delta {delta['sync_s']:.2f} s, {delta['egress_bytes'] / 2**20:.1f} MiB "
                          f"({delta['egress_bytes'] / full['egress_bytes']:.3f} of full)", flush=True)
        finally:
            rx.stop()
    pairs = {}
    for a, b in args.pair:
        pairs[f"{a} -> {b}"] = got = encoded_ratio(load_weights(a), load_weights(b), args.bucket_mb)
        print(f"pair {a} -> {b}: {got}", flush=True)
    med = {str(c): {k: round(statistics.median(v), 3) if k.endswith("_s") else int(statistics.median(v))
                    for k, v in r.items()} for c, r in runs.items()}
    for m in med.values():
        m["delta_ratio"] = round(m["delta_bytes"] / m["full_bytes"], 4)
        m["speedup"] = round(m["full_s"] / m["delta_s"], 2)
    print(json.dumps({"per_cap": med, "changed_frac": round(statistics.median(changed), 4), "lr": args.lr,
                      "weights_mb": round(size_mb, 1), "bucket_mb": args.bucket_mb, "repeats": args.repeats,
                      "pairs": pairs, "engine": "stand-in (no vLLM)", "bit_exact": True,
                      "wall_s": round(time.time() - t_start, 1),
                      "loadavg_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)]}))


if __name__ == "__main__":
    main()
