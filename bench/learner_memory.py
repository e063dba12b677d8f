"""Benchmark: the learner's peak memory and step time under the settings that trade one for the other.
Not a test.

    .venv/bin/python bench/learner_memory.py [--settings mbt4096,mbt2048,mbt1024,ckpt4096] [--steps 3]
    .venv/bin/python bench/learner_memory.py --config configs/cpu_code.yaml --settings mbt2048,lora2048 \
        --prompt-tokens 260 --completion-tokens 120      # full fine-tuning against LoRA on the code recipe

Each setting runs in a process of its own (so one peak cannot carry into the next): the DeepSpeed
learner (toolrl.learner.trainer.Trainer) on `--config`'s model and dtype (default configs/cpu_demo.yaml,
dtype auto), `--steps` GRPO steps on the same batch (`--samples`, default 24, in groups of 4 sharing a
`--prompt-tokens` prompt; the demo's batch is 16: 4 problems of 2 rollouts + 2 teacher traces),
`--completion-tokens` completions with a tool-output span; by default the
demo's shape, ~360 and ~250; bench/learner.py's make_batch). Reported: the
process's peak resident memory (ru_maxrss: weights, DeepSpeed's fp32 master copy, gradients and Adam
moments, activations, allocator slack) and resident memory right after the engine is built (before
any step: what the states alone take), and the median step time.

Settings: `mbtN` = learner.micro_batch_tokens N (the demo's is 4096; smaller micro-batches hold fewer
activations at once; the gradient is the same); `ckptN` = the same with gradient checkpointing
(recomputes activations in the backward; turns prompt sharing off); `loraN` = micro-batches of N
with learner.lora (the config's rank and target modules: only the adapter has gradients and Adam
moments).

Last line: JSON with `results[setting]` = {peak_rss_mb, states_rss_mb, step_s_median}.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SETTINGS = {"mbt4096": ["learner.micro_batch_tokens=4096"], "mbt2048": ["learner.micro_batch_tokens=2048"],
            "mbt1024": ["learner.micro_batch_tokens=1024"],
            "ckpt4096": ["learner.micro_batch_tokens=4096", "learner.gradient_checkpointing=true"],
            "lora2048": ["learner.micro_batch_tokens=2048", "learner.lora.enabled=true"]}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def one(setting: str, steps: int, config: str, prompt_tokens: int, completion_tokens: int,
        samples: int = 24) -> dict:
    from procs import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_learner", ROOT / "bench" / "learner.py")
    bench_learner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_learner)  # its make_batch: the batch shape bench/learner.py times
    from toolrl.config import load_config
    from toolrl.learner.trainer import Trainer
    from toolrl.models import resolve_model

    cfg = load_config(config, [*SETTINGS[setting], "logging.wandb_mode=disabled"])
    tr = Trainer(cfg, resolve_model(cfg.model.name))
    states = rss_mb()
    batch = bench_learner.make_batch(samples, prompt_tokens, completion_tokens, group=4)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tr.train_step(batch)
        times.append(time.perf_counter() - t0)
    return {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "states_rss_mb": round(states, 1), "step_s_median": round(statistics.median(times), 2),
            "step_s": [round(t, 2) for t in times], "tokens": sum(s.num_tokens for s in batch)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--config", default="configs/cpu_demo.yaml")
    ap.add_argument("--prompt-tokens", type=int, default=360)
    ap.add_argument("--completion-tokens", type=int, default=250)
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # run one setting in this process
    args = ap.parse_args()
    if args.samples < 1:
        ap.error(f"--samples must be at least 1, got {args.samples}")
    if args.one:
        result = one(args.one, args.steps, args.config, args.prompt_tokens, args.completion_tokens, args.samples)
        print(json.dumps(result), flush=True)
        return
    chosen = [s for s in args.settings.split(",") if s]
    unknown = [s for s in chosen if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    from toolrl.models import cpu_flags  # here: the parent process imports no torch otherwise

    flags = cpu_flags()
    print(f"{len(chosen)} settings, {args.steps} steps each, {os.cpu_count()} cores ({' '.join(flags)})", flush=True)
    results = {}
    for s in chosen:
        shape = ["--config", args.config, "--prompt-tokens", str(args.prompt_tokens),
                 "--completion-tokens", str(args.completion_tokens), "--samples", str(args.samples)]
        p = subprocess.run([sys.executable, __file__, "--one", s, "--steps", str(args.steps), *shape], cwd=ROOT,
                           capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{s} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        results[s] = json.loads(p.stdout.strip().splitlines()[-1])
        r = results[s]
        print(f"{s:>9}: peak {r['peak_rss_mb']:.0f} MB (states alone {r['states_rss_mb']:.0f} MB), "
              f"step {r['step_s_median']} s median of {r['step_s']}", flush=True)
    print(json.dumps({"cpu_flags": flags, "config": args.config, "steps": args.steps,
                      "samples": args.samples, "prompt_tokens": args.prompt_tokens,
                      "completion_tokens": args.completion_tokens,
                      "results": results}), flush=True)


if __name__ == "__main__":
    main()
