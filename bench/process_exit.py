"""Benchmark: what a process pays to end once vLLM, DeepSpeed or a model is loaded. Not a test.

    .venv/bin/python bench/process_exit.py [--repeats 3]

Side by side, in turn, the same work on both sides: a fresh Python imports a library (or starts
inference.py's engine on the tiny model and asks it one question), prints the time, and exits. The
figure is the time from that print to the process's end, and the CPU it used meanwhile, with
toolrl's exit hook (`toolrl/__init__.py`: skip the last garbage collection) and without it
(`gc.freeze` made a no-op for the run). For inference.py the whole command's wall time and CPU are
reported too: its engine core ends on vLLM's SIGTERM, or is killed after vLLM's 5 s.

Last line: JSON with `results[workload][side]` (median exit seconds, median CPU seconds of the exit).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Without the hook: gc.freeze does nothing in that process (toolrl's hook calls it at exit).
NO_HOOK = "import gc; gc.freeze = lambda: None; "
IMPORTS = {"vllm": "import toolrl, vllm", "deepspeed": "import toolrl, deepspeed",
           "transformers model": "import toolrl; from transformers import AutoModelForCausalLM; "
                                 "from toolrl.models import resolve_model; "
                                 "m = AutoModelForCausalLM.from_pretrained(resolve_model('smollm2-135m-instruct'))"}


def cpu_flags() -> str:
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    return ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def one_import(code: str, hook: bool) -> tuple[float, float]:
    """(seconds from the last print to the end, CPU seconds of the children in that window)."""
    prog = ("" if hook else NO_HOOK) + code + "; import time, os; t = os.times(); " \
        "print(time.time(), t.user + t.system, flush=True)"
    before = os.times()
    out = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, capture_output=True, text=True, check=True)
    end = time.time()
    after = os.times()
    printed, cpu_then = map(float, out.stdout.split()[-2:])
    cpu_total = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    return end - printed, cpu_total - cpu_then


def one_inference(hook: bool) -> dict:
    """inference.py on the tiny model, one question, --verbose: wall, CPU (its engine core included:
    a child it waits for), and whether vLLM had to kill the engine core."""
    env = dict(os.environ)
    if not hook:
        shim = ROOT / "runs" / "bench-no-exit-hook"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "sitecustomize.py").write_text(NO_HOOK + "\n")
        env["PYTHONPATH"] = f"{shim}:{env.get('PYTHONPATH', '')}"
    before = os.times()
    t0 = time.time()
    p = subprocess.run([sys.executable, "inference.py", "--config", "configs/cpu_tiny.yaml", "--model", "tiny-random",
                        "--verbose", "What is 6 times 7?"], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=600)
    wall = time.time() - t0
    after = os.times()
    if p.returncode != 0:
        raise SystemExit(f"inference.py failed:\n{p.stderr[-3000:]}")
    cpu = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    return {"wall_s": wall, "cpu_s": cpu, "engine_killed": "force killing" in p.stdout + p.stderr}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results: dict = {}
    for name, code in IMPORTS.items():
        runs = {"hook": [], "no_hook": []}
        for _ in range(args.repeats):
            for side in ("no_hook", "hook"):
                runs[side].append(one_import(code, side == "hook"))
        results[name] = {side: {"exit_s": round(statistics.median(r[0] for r in rs), 3),
                                "exit_cpu_s": round(statistics.median(r[1] for r in rs), 3)}
                         for side, rs in runs.items()}
        print(f"{name:20s} exit without the hook {results[name]['no_hook']['exit_s']:.2f} s, "
              f"with it {results[name]['hook']['exit_s']:.2f} s", flush=True)
    runs = {"hook": [], "no_hook": []}
    for _ in range(args.repeats):
        for side in ("no_hook", "hook"):
            runs[side].append(one_inference(side == "hook"))
    results["inference.py"] = {side: {"wall_s": round(statistics.median(r["wall_s"] for r in rs), 2),
                                      "cpu_s": round(statistics.median(r["cpu_s"] for r in rs), 2),
                                      "engine_killed": sum(r["engine_killed"] for r in rs)}
                               for side, rs in runs.items()}
    print(f"inference.py         without the hook {results['inference.py']['no_hook']}, "
          f"with it {results['inference.py']['hook']}", flush=True)
    print(json.dumps({"bench": "process_exit", "host": {"cpu": platform.processor() or platform.machine(),
                                                        "flags": cpu_flags(), "cores": os.cpu_count()},
                      "repeats": args.repeats, "results": results}))


if __name__ == "__main__":
    main()
