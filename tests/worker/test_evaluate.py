"""evaluate.py end to end: pass@k and rates from real rollouts of the tiny model, clear errors."""
import json
import subprocess
import sys

import pytest

from procs import ROOT  # tests/ is on sys.path (conftest)


@pytest.mark.slow
def test_evaluate_cli_on_the_tiny_model(tmp_path):
    out = tmp_path / "eval.json"
    p = subprocess.run([sys.executable, "evaluate.py", "--config", "configs/cpu_tiny.yaml", "--model", "tiny-random",
                        "--task", "arithmetic:2", "--n-problems", "3", "--samples", "2", "--ks", "1,2,5",
                        "--out", str(out), "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["n_problems"] == 3 and res["n_samples"] == 6
    assert set(res["pass_at_k"]) == {"1", "2"}  # k=5 > samples is left out
    assert res["tool_calls_per_answer"] == pytest.approx(1.0)  # the tiny config's prefill runs one program
    assert res["code_executed_rate"] == 1.0 and res["accuracy"] == 0.0
    assert len(res["per_problem"]) == 3 and all(r["n"] == 2 for r in res["per_problem"])
    printed = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(printed) == {"accuracy", "pass_at_k", "format_rate", "tool_calls_per_answer"}
    assert "accuracy" in p.stderr  # the table
    assert res["temperature"] == 1.0 and "T=1" in p.stderr  # cpu_tiny samples at the default rollout temperature


def test_bad_arguments_fail_clearly():
    p = subprocess.run([sys.executable, "evaluate.py", "--model", "tiny-random", "--task", "chess:x"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown task" in p.stderr
    for flag, value in (("--samples", "0"), ("--n-problems", "0"), ("--ks", "0")):
        p = subprocess.run([sys.executable, "evaluate.py", "--model", "tiny-random", flag, value], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and f"{flag} 0: must be at least 1" in p.stderr, p.stderr[-500:]


def test_what_the_command_line_leaves_out_comes_from_the_configs_eval_section():
    """--set eval.samples=0 reaches the count check: evaluate.py reads the eval section (it ignored it)."""
    p = subprocess.run([sys.executable, "evaluate.py", "--model", "tiny-random", "--set", "eval.n_problems=0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "eval.n_problems" in p.stderr, p.stderr[-500:]  # refused by the config itself
    p = subprocess.run([sys.executable, "evaluate.py", "--model", "tiny-random", "--set", "eval.task=chess:x"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown task" in p.stderr, p.stderr[-500:]
