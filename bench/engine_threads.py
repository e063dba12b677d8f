"""Engine threads benchmark (not a test): the demo's held-out evaluation on one engine thread against
every bound core, alternating on one live engine.

    python bench/engine_threads.py [--model runs/RUN] [--rounds 2] [--config configs/cpu_demo.yaml]

One vLLM engine (the config's model, or `--model`: a run directory's export), bound to every core
(`rollout.cpu_threads_bind=all`), runs the config's `eval` section (the demo's 64 held-out problems,
all in flight, decoded as its `eval.temperature` says: greedy for the demo) through `Agent.evaluate`,
the code a gen worker runs for the learner, alternating `VllmEngine.set_threads(1)` (the threads a
demo's training rollouts use beside the learner) and `set_threads(None)` (every bound core: what an
evaluation now gets). The same problems and decoding on both sides; sampled answers differ only by
sampling. Needs the executor at executor.url; if
none answers, a private one is started.

Last line: JSON with one_thread_s, all_threads_s (each round's wall), threads and speedup (the ratio
of the medians).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolrl.config import load_config  # noqa: E402
from toolrl.executor.local import executor_available  # noqa: E402
from toolrl.models import cpu_flags, resolve_run_model  # noqa: E402
from toolrl.tasks import load_task, task_seed  # noqa: E402
from toolrl.worker.agent import Agent  # noqa: E402


async def alternate(cfg, rounds: int) -> dict:
    e = cfg.eval
    problems = load_task(e.task, e.n_problems, task_seed(cfg.data, e.task, e.seed), cfg.data)
    agent = Agent(cfg, "bench")
    out: dict = {"one_thread_s": [], "all_threads_s": [], "one_thread_tok_s": [], "all_threads_tok_s": [],
                 "accuracy_one": [], "accuracy_all": []}
    try:
        for r in range(rounds):
            for side, n in (("one_thread", 1), ("all_threads", None)):
                got = await agent.engine.set_threads(n)
                res = await agent.evaluate(problems, e.samples, e.ks, e.concurrency, temperature=e.temperature)
                tok_s = res["mean_completion_tokens"] * res["n_samples"] / res["wall_s"]
                out[f"{side}_s"].append(round(res["wall_s"], 1))
                out[f"{side}_tok_s"].append(round(tok_s, 1))
                out["accuracy_" + ("one" if n == 1 else "all")].append(res["accuracy"])
                if n is None:
                    out["threads"] = got
                print(f"round {r + 1} {side} ({got} thread{'s' * (got != 1)}): {res['wall_s']:.1f} s, "
                      f"{tok_s:.1f} generated tok/s, accuracy {res['accuracy']:.3f}", flush=True)
    finally:
        await agent.aclose()
    out["speedup"] = round(statistics.median(out["one_thread_s"]) / statistics.median(out["all_threads_s"]), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/cpu_demo.yaml")
    ap.add_argument("--model", default=None, help="a model name or path, or a run directory (its export)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sets = ["rollout.cpu_threads_bind=all"] + ([f"model.name={resolve_run_model(args.model)}"] if args.model else [])
    cfg = load_config(args.config, sets)
    flags = cpu_flags()
    print(f"{cfg.model.name}, {cfg.eval.n_problems} problems of {cfg.eval.task}, cpu flags {' '.join(flags)}",
          flush=True)
    with executor_available(cfg) as cfg2:
        res = asyncio.run(alternate(cfg2, args.rounds))
    print(json.dumps({"cpu_flags": flags, "model": cfg.model.name, **res}), flush=True)


if __name__ == "__main__":
    main()
