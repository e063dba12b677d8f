"""Benchmark: how to split this machine's cores between the vLLM engine and the learner. Not a test.

    .venv/bin/python bench/placement.py [--placements default,split,adaptive,engine-both] [--budget-s 240]
        [--repeats 1] [--task tool|plain]

Each placement runs `launch.sh` on configs/cpu_demo.yaml for the same training budget, one after the
other, in turn, `--repeats` times; only the placement differs. `--task tool` (the default) runs the
recipe as shipped (the tool task: teacher traces, GRPO, one gen worker); `--task plain` runs it as
bench/e2e_vs_trl.py's side of the comparison with TRL does (plain GRPO on the think/answer prompt,
4 prompts x 4 samples, its defaults). Per run (measured as bench/e2e_vs_trl.py measures its runs: the window from
the worker's first rollout to the learner's last step): policy samples trained per hour (the goal's
figure), all samples per hour (teacher traces included), generated tokens per second of the engine's
busy time, the learner's tokens per second of its compute, and peak PSS of the process tree.

Placements (on an N-core machine; the names say what they do on 2 cores):
- default: nothing pinned: vLLM's own default (it reserves one core and runs one thread on the
  other), the learner unpinned with torch's default thread count (one per core), fixed;
- split: the engine on core 0 (`rollout.cpu_threads_bind=0`), the learner on the other cores
  (`learner.cpu_cores`, one torch thread each);
- adaptive (the CPU recipes' setting): as default, but the learner's torch threads follow the rest
  of the machine's load (`learner.adaptive_threads`): one per core the engine leaves idle, re-measured
  twice a second;
- engine-both: the engine on every core (`rollout.cpu_threads_bind=0-(N-1)`), the learner unpinned.

Last line: JSON with `results[placement]` (a list of runs), the mean policy samples per hour of each,
and `best`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_vs_trl import ROOT, log, plain_sets, run_ours  # noqa: E402

sys.path.insert(0, str(ROOT))
from toolrl.models import cpu_flags, resolve_dtype  # noqa: E402


def placements(ncpu: int) -> dict[str, list[str]]:
    rest = list(range(1, ncpu))
    fixed = "learner.adaptive_threads=false"  # the CPU recipes' setting since 2026-11-28 is true
    return {"default": [fixed],
            "split": ["rollout.cpu_threads_bind=0", f"learner.cpu_cores={json.dumps(rest)}", fixed],
            "adaptive": ["learner.adaptive_threads=true"],
            "engine-both": [f"rollout.cpu_threads_bind=0-{ncpu - 1}", fixed]}


def plain_task() -> list[str]:
    """bench/e2e_vs_trl.py's plain think/answer sets, with its default arguments."""
    return plain_sets(argparse.Namespace(prompts_per_step=4, group_size=4, max_new_tokens=256, temperature=0.8,
                                         lr=1e-5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--placements", default="default,split,adaptive,engine-both")
    ap.add_argument("--task", choices=["tool", "plain"], default="tool")
    ap.add_argument("--budget-s", type=float, default=240.0, help="each run's learner.time_budget_s")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None, help="default: runs/placement-TIMESTAMP")
    args = ap.parse_args()
    ncpu = os.cpu_count() or 1
    known = placements(ncpu)
    chosen = [p for p in args.placements.split(",") if p]
    if ncpu < 2 or any(p not in known for p in chosen):
        ap.error(f"placements of {list(known)} on a machine of at least 2 cores (this one has {ncpu})")
    out = Path(args.out or ROOT / "runs" / f"placement-{time.strftime('%Y%m%d-%H%M%S')}")
    dtype = resolve_dtype("auto")
    flags = cpu_flags()
    log(f"{len(chosen)} placements x {args.repeats} on {ncpu} cores ({' '.join(flags)}), {dtype}, "
        f"{args.budget_s:.0f} s of training each, in {out}")
    results: dict[str, list[dict]] = {p: [] for p in chosen}
    task = plain_task() if args.task == "plain" else []
    for r in range(args.repeats):
        for p in chosen:
            res = run_ours(f"{p}-{r + 1}", task + known[p], args.budget_s, out / f"{p}-{r + 1}", dtype)
            keep = ("policy_samples_per_hour", "samples_trained", "policy_samples_trained", "window_s", "steps",
                    "gen_tok_s", "learner_tok_s", "peak_pss_mb", "host_gflops", "stale_drop_fraction")
            results[p].append({k: res[k] for k in keep} | {
                "samples_per_hour": round(res["samples_trained"] / res["window_s"] * 3600, 1)})
            log(f"{p} run {r + 1}: {res['policy_samples_per_hour']:.0f} policy samples/h, "
                f"{results[p][-1]['samples_per_hour']:.0f} samples/h, gen {res['gen_tok_s']} tok/s, "
                f"learner {res['learner_tok_s']} tok/s")
    mean = {p: round(statistics.mean(x["policy_samples_per_hour"] for x in rows), 1) for p, rows in results.items()}
    summary = {"cpus": ncpu, "cpu_flags": flags, "dtype": dtype, "task": args.task, "budget_s": args.budget_s,
               "repeats": args.repeats, "placements": {p: known[p] for p in chosen}, "results": results,
               "policy_samples_per_hour": mean, "best": max(mean, key=mean.get)}
    (out / "placement.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
