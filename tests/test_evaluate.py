import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from toolrl.config import DataConfig
from toolrl.tasks import load_task
from toolrl.worker.evaluate import pass_at_k, resolve_eval_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (5, 2), (10, 3), (10, 10), (7, 0)])
def test_pass_at_k_is_the_unbiased_estimator(n, c):
    # brute force: the fraction of k-subsets of the n samples that contain a correct one
    outcomes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="at least"):
        pass_at_k(n, c, n + 1)


def test_run_directory_means_its_export(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    assert resolve_eval_model(str(tmp_path)) == str(tmp_path / "export")
    assert resolve_eval_model("smollm2-135m-instruct") == "smollm2-135m-instruct"
    with pytest.raises(FileNotFoundError, match="run directory"):
        resolve_eval_model(str(tmp_path.parent))


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


@pytest.mark.slow
def test_inference_cli_shows_the_tool_loop():
    p = subprocess.run([sys.executable, "inference.py", "--config", "configs/cpu_tiny.yaml", "--model", "tiny-random",
                        "What is 6 times 7?"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "print(6 * 7)" in p.stdout and "42" in p.stdout and "answer:" in p.stdout
    assert "1 tool call(s)" in p.stdout


def test_bad_arguments_fail_clearly():
    p = subprocess.run([sys.executable, "evaluate.py", "--model", "tiny-random", "--task", "chess:x"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown task" in p.stderr


def test_summary_breaks_mixed_levels_down():
    from toolrl.worker.evaluate import summarize
    from toolrl.protocol import Sample, ToolCall

    problems = load_task("arithmetic:1-2", 4, 3, DataConfig())

    def s(correct, fmt, call):
        calls = [ToolCall(code="print(1)", status=call, output="1")] if call else []
        return Sample(prompt_ids=[1], completion_ids=[2, 3], loss_mask=[1, 1], logprobs=[-1.0, -1.0],
                      rewards={"correct": correct, "format": fmt}, group_id="g", tool_calls=calls)

    groups = {problems[0].id: [s(1.0, 1.0, "ok")], problems[2].id: [s(0.0, 1.0, "error")],
              problems[1].id: [s(0.0, 0.0, None)], problems[3].id: [s(0.0, 1.0, None)]}
    out = summarize(problems, groups, [1])
    assert out["accuracy"] == 0.25 and out["format_rate"] == 0.75
    l1, l2 = out["by_level"]["1"], out["by_level"]["2"]
    assert (l1["accuracy"], l1["code_written_rate"], l1["code_executed_rate"]) == (0.5, 1, 0.5)
    assert l1["tool_error_rate"] == 0.5
    assert (l2["accuracy"], l2["format_rate"], l2["code_written_rate"]) == (0.0, 0.5, 0.0)
