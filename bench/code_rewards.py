"""Code-reward judging benchmark (not a test): HumanEval's 164 reference solutions through
`run_tests` (the harness, each assert task's program in a fresh interpreter of its own, and the
judge) on a real executor.

    python bench/code_rewards.py [--workers 2] [--passes 3]

Prints one line a pass, then one JSON line: wall seconds per pass, ms per sample, and how many of the
164 passed all their tests (all must). docs/BENCHMARKS.md (2026-11-29, eighth) has the figures against
the one-process harness before it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolrl.executor.client import ExecutorClient  # noqa: E402
from toolrl.executor.local import LocalExecutor  # noqa: E402
from toolrl.tasks.code.judge import TestSpec, run_tests  # noqa: E402
from toolrl.tasks.code.loaders import load_humaneval  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    problems = load_humaneval()
    programs, specs = [p.program for p in problems], [TestSpec.from_json(p.answer) for p in problems]
    walls, passed = [], 0
    with LocalExecutor(sets=[f"executor.workers={args.workers}"]) as ex, ExecutorClient(ex.url, timeout_s=120) as c:
        run_tests(c, programs[:8], specs[:8], per_test_timeout_s=3.0, max_timeout_s=20)  # warm-up
        for i in range(args.passes):
            t = time.perf_counter()
            res = run_tests(c, programs, specs, per_test_timeout_s=3.0, max_timeout_s=20)
            walls.append(time.perf_counter() - t)
            passed = sum(r.passed == r.total for r in res)
            print(f"pass {i + 1}: {walls[-1]:.2f} s for {len(programs)} programs, {passed} passed all", flush=True)
    print(json.dumps({"wall_s": [round(w, 2) for w in walls], "ms_per_sample": round(
        statistics.median(walls) / len(programs) * 1000, 1), "all_passed": passed, "programs": len(programs),
        "workers": args.workers}))


if __name__ == "__main__":
    main()
