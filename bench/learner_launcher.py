"""Benchmark: launch.sh's learner on one CPU rank, as itself or under deepspeed's launcher. Not a test.

    .venv/bin/python bench/learner_launcher.py [--repeats 2] [--config configs/cpu_tiny.yaml]

Side by side, in turn, the same run on both sides: `launch.sh --config CFG` trains its steps with
`launch.learner_launcher=auto` (one CPU rank: `python learner.py`, no launcher) and with
`launch.learner_launcher=deepspeed` (`deepspeed --num_gpus 1`, whose runner and launch.py import
torch before they start the rank). Reported per side: the seconds from launch.sh's start to the
learner's first step line, the run's wall time (launch.sh's report), and the peak PSS summed over
the run's processes, sampled every second, with the learner's launcher processes apart.

Last line: JSON with `results[side]` (medians over the repeats).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = ("deepspeed.launcher.launch", "bin/deepspeed")
ROLES = (*LAUNCHERS, "learner.py", "gen_worker.py", "VLLM::EngineCore", "spawn_main", "ref_server.py",
         "executor_service.py", "toolrl.executor.forkserver", "toolrl.learner.report")


def cpu_flags() -> str:
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    return ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def pss_by_role(run_dir: str) -> dict[str, float]:
    """MB of PSS of this run's processes (their command lines name its run directory or are their
    children: the engine core names nothing), by role."""
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            role = next((r for r in ROLES if r in cmd or r in comm), None)
            if role is None or (run_dir not in cmd and role not in ("VLLM::EngineCore", "spawn_main",
                                                                    "toolrl.executor.forkserver")):
                continue
            pss = next(int(x.split()[1]) for x in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                       if x.startswith("Pss:"))
        except (OSError, StopIteration):
            continue
        out[role] = out.get(role, 0.0) + pss / 1024
    return out


def one_run(config: str, launcher: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = f"{tmp}/run"
        cmd = ["bash", "launch.sh", "--config", config, "--run-dir", run_dir, "--set",
               f"launch.learner_launcher={launcher}", "--set", "eval.before_after=false"]
        peak = {"sum": 0.0, "launcher": 0.0}
        done = threading.Event()

        def sample():
            while not done.wait(1.0):
                by = pss_by_role(run_dir)
                peak["sum"] = max(peak["sum"], sum(by.values()))
                peak["launcher"] = max(peak["launcher"], sum(v for k, v in by.items() if k in LAUNCHERS))

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        t0 = time.time()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first_step = None
        for line in p.stdout:
            if first_step is None and line.strip().startswith("step 1/"):
                first_step = time.time() - t0
        p.wait()
        done.set()
        t.join()
        if p.returncode != 0 or first_step is None:
            raise SystemExit(f"launch.sh with learner_launcher={launcher} failed (exit {p.returncode})")
        return {"first_step_s": first_step, "launch_wall_s": time.time() - t0,
                "peak_pss_mb": peak["sum"], "launcher_pss_mb": peak["launcher"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--config", default="configs/cpu_tiny.yaml")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"auto": [], "deepspeed": []}
    for i in range(args.repeats):
        for side in ("auto", "deepspeed") if i % 2 == 0 else ("deepspeed", "auto"):
            r = one_run(args.config, side)
            runs[side].append(r)
            print(f"{side:9s} run {i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
    results = {side: {k: round(statistics.median(r[k] for r in rs), 1) for k in rs[0]} for side, rs in runs.items()}
    print(json.dumps({"bench": "learner_launcher", "config": args.config, "repeats": args.repeats,
                      "host": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
                      "ncpu": os.cpu_count(), "results": results}))


if __name__ == "__main__":
    sys.exit(main())
