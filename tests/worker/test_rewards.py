from pathlib import Path

import pytest

from toolrl.config import RewardConfig, RewardSchedule
from toolrl.protocol import ToolCall
from toolrl.format import extract_answer
from toolrl.worker.rewards import REWARDS, Completion, register_reward, score, weights_at


def comp(text, final=None, calls=()):
    return Completion(text=text, final_text=text if final is None else final, tool_calls=list(calls))


GOOD = "<think>\nlet me see\n</think>\n<answer>\nThe total is \\boxed{1,234}.\n</answer>\n"


def test_correct_uses_last_box_in_answer_only():
    cfg = RewardConfig(weights={"correct": 1.0})
    assert score(comp(GOOD), "1234", cfg)[0]["correct"] == 1.0
    # a box in the reasoning does not count, the one in <answer> does
    text = "<think>\\boxed{1234}</think><answer>\\boxed{99}</answer>"
    assert score(comp(text), "1234", cfg)[0]["correct"] == 0.0
    # no <answer> at all: a bare box is not an answer
    assert score(comp("<think>so \\boxed{1234}</think>"), "1234", cfg)[0]["correct"] == 0.0
    # nested braces
    assert extract_answer("<answer>\\boxed{\\frac{1}{2}}</answer>") == "\\frac{1}{2}"
    assert score(comp("<answer>\\boxed{\\frac{1}{2}}</answer>"), "0.5", cfg)[0]["correct"] == 1.0
    assert score(comp("<answer>\\boxed{\\frac{1}{3}}</answer>"), "0.5", cfg)[0]["correct"] == 0.0


def test_answer_printed_by_the_tool_does_not_count():
    # The program printed an answer block; the model's own final text has none.
    tool_out = "```output\n<answer>\\boxed{1234}</answer>\n```\n"
    text = "<think>\n<program>...</program>\n" + tool_out + "done\n</think>\n"
    cfg = RewardConfig(weights={"correct": 1.0, "format": 1.0})
    comps, _ = score(comp(text, final="done\n</think>\n"), "1234", cfg)
    assert comps == {"correct": 0.0, "format": 0.0}


def test_format_tolerates_whitespace_and_rejects_broken_structure():
    cfg = RewardConfig(weights={"format": 1.0})
    assert score(comp("  <think>x</think>\n\n  <answer>\\boxed{1}</answer>  \n"), "1", cfg)[1] == 1.0
    assert score(comp("<think>x</think> trailing <answer>\\boxed{1}</answer>"), "1", cfg)[1] == 0.0
    assert score(comp("<think>x</think><answer>no box</answer>"), "1", cfg)[1] == 0.0
    assert score(comp("<answer>\\boxed{1}</answer>"), "1", cfg)[1] == 0.0


def test_tool_bonus_only_for_clean_runs_and_capped():
    cfg = RewardConfig(weights={"tool": 1.0}, tool_bonus_cap=2)
    ok = ToolCall(code="print(1)", status="ok", output="1\n")
    bad = ToolCall(code="1/0", status="error", output="ZeroDivisionError\n")
    assert score(comp(GOOD, calls=[bad, bad]), "1", cfg)[1] == 0.0
    assert score(comp(GOOD, calls=[ok, bad]), "1", cfg)[1] == 0.5
    assert score(comp(GOOD, calls=[ok] * 5), "1", cfg)[1] == 1.0


def test_simple_recipe_rewards():
    cfg = RewardConfig(weights={"digit": 1.0, "mark": 1.0, "strict_format": 1.0})
    comps, total = score(comp(GOOD), "1234", cfg)
    assert comps == {"correct": 1.0, "format": 1.0, "digit": 1.0, "mark": 1.0, "strict_format": 1.0} and total == 3.0
    comps, _ = score(comp("<think>a</think><think>b</think><answer>\\boxed{x}</answer>"), "1", cfg)
    assert comps == {"correct": 0.0, "format": 1.0, "digit": 0.0, "mark": 0.5, "strict_format": 0.0}


def test_weighted_total_and_custom_reward():
    @register_reward("length_penalty")
    def length_penalty(c, answer, cfg):
        return -len(c.text) / 100

    try:
        cfg = RewardConfig(weights={"correct": 1.0, "format": 0.5, "length_penalty": 1.0})
        comps, total = score(comp(GOOD), "1234", cfg)
        assert total == pytest.approx(1.0 + 0.5 - len(GOOD) / 100)
        with pytest.raises(ValueError, match="unknown reward"):
            score(comp(GOOD), "1", RewardConfig(weights={"nope": 1.0}))
    finally:
        REWARDS.pop("length_penalty")


def test_schedule_moves_weights_linearly():
    cfg = RewardConfig(weights={"correct": 1.0, "format": 0.5},
                       schedule={"format": RewardSchedule(start=0.5, end=0.0, steps=10)})
    assert weights_at(cfg, 0)["format"] == 0.5
    assert weights_at(cfg, 5)["format"] == pytest.approx(0.25)
    assert weights_at(cfg, 50)["format"] == 0.0
    assert score(comp(GOOD), "1234", cfg, version=10)[1] == 1.0


def test_code_rewards_read_the_test_results():
    from toolrl.tasks.code.judge import TestResult, TestSpec

    spec = TestSpec("assert", tests=["assert f() == 1", "assert f() == 1", "assert f() == 1"]).to_json()
    cfg = RewardConfig(weights={"tests": 1.0, "correct": 0.5, "code_format": 0.1})
    text = "<think>\nplan\n</think>\n```python\ndef f():\n    return 1\n```\n"
    c = Completion(text, text, [], TestResult(2, 3, "ok"), grading="tests")
    comps, total = score(c, spec, cfg)
    assert comps == {"tests": pytest.approx(2 / 3), "correct": 0.0, "code_format": 1.0}
    assert total == pytest.approx(2 / 3 + 0.1)
    assert score(c, spec, RewardConfig(weights={"tests": 1.0}, code_mode="all"))[0]["tests"] == 0.0
    full = Completion(text, text, [], TestResult(3, 3, "ok"), grading="tests")
    assert score(full, spec, cfg)[0]["correct"] == 1.0
    two_blocks = text + "```python\nprint(1)\n```"
    assert score(Completion(two_blocks, two_blocks, [], TestResult(3, 3, "ok"), grading="tests"), spec,
                 cfg)[0]["code_format"] == 0.0
    with pytest.raises(ValueError, match="needs its test results"):
        score(Completion(text, text, grading="tests"), spec, cfg)
    assert score(comp(GOOD), "1234", RewardConfig(weights={"tests": 1.0}))[0]["tests"] == 0.0  # math: no tests
    assert score(comp(GOOD), spec, RewardConfig(weights={"tests": 1.0}))[0]["tests"] == 0.0  # the grading decides


@pytest.mark.parametrize("std", ["population", "sample"])
def test_the_agent_scores_a_group_with_the_configured_std(std):
    """grpo.std reaches the worker: Agent.score, where a group's advantages are made, divides by the
    population std (n) or the sample std (n - 1, as TRL), each checked against the formula."""
    import math

    from toolrl.config import load_config
    from toolrl.tasks import Problem
    from toolrl.worker.agent import Agent
    from toolrl.worker.rollout import Rollout

    cfg = load_config("configs/cpu_tiny.yaml", [f"grpo.std={std}", "rewards.weights={correct: 1.0}",
                                                "logging.wandb_mode=disabled"])
    agent = Agent(cfg, "w0", engine=object())  # scoring needs no engine
    answers = ["7", "7", "3", "7"]
    rolls = []
    for a in answers:
        r = Rollout(prompt_ids=[1, 2])
        ids = agent.tokenizer.encode(f"x\n</think>\n<answer>\\boxed{{{a}}}</answer>")
        r.add("model", ids, [-1.0] * len(ids), version=0)
        rolls.append(r)
    samples = agent.score(Problem(id="p", question="q", answer="7"), rolls, "g", version=0)
    rewards = [s.reward for s in samples]
    assert rewards == [1.0, 1.0, 0.0, 1.0]
    n, mean = len(rewards), sum(rewards) / len(rewards)
    sd = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1 if std == "sample" else n))
    assert [s.advantage for s in samples] == pytest.approx([(r - mean) / (sd + 1e-4) for r in rewards])


def test_a_verifier_that_cannot_start_is_unavailable_not_a_wrong_answer(monkeypatch):
    from toolrl.worker import rewards

    monkeypatch.setattr(rewards, "STARTUP_TIMEOUT_S", 0.001)  # a loaded machine: the child is not up in time
    v = rewards.Verifier()
    try:
        with pytest.raises(rewards.VerifierUnavailable, match="could not start"):
            v("1/2", "0.5")
    finally:
        v.close()


def test_a_verifier_child_killed_under_it_is_replaced_and_the_answer_still_graded():
    import os
    import signal
    import time

    from toolrl.worker.rewards import Verifier

    v = Verifier()
    try:
        assert v("1/2", "0.5") is True
        for p in list(v._pool._processes.values()):
            os.kill(p.pid, signal.SIGKILL)  # the OOM killer, say
        time.sleep(0.5)
        assert v("1/2", "0.5") is True and v.crashes == 1  # not scored 0 for the machine's doing
        assert v("1/3", "0.5") is False
    finally:
        v.close()


def test_an_escaped_dollar_is_currency_not_a_math_delimiter():
    from toolrl.worker.rewards import is_correct

    assert is_correct(r"\$18", "18") and is_correct("1.17", r"\$1.17") and not is_correct(r"\$19", "18")


def test_correct_is_computed_even_when_no_weight_names_it():
    """Accuracy, pass@k, the curriculum and the teacher's decay read rewards["correct"]: a code
    recipe weighting only `tests` and `code_format` zeroed them all."""
    cfg = RewardConfig(weights={"format": 1.0})
    c = Completion(text="", final_text="<think>\nx\n</think>\n<answer>\n\\boxed{4}\n</answer>")
    comps, total = score(c, "4", cfg)
    assert comps["correct"] == 1.0 and total == comps["format"]  # logged, not weighted
    # and the format, which the format rate reads: it read 0.0 for well-formed answers (found in review)
    text = "<think>\nx\n</think>\n<answer>\n\\boxed{4}\n</answer>"
    comps, total = score(Completion(text=text, final_text=text), "4", RewardConfig(weights={"correct": 1.0}))
    assert comps == {"correct": 1.0, "format": 1.0} and total == 1.0


def test_a_calculation_in_the_box_is_not_a_number_answered():
    """Boxing the question's numbers with the operation earned full reward: math-verify evaluated
    `13 * 20` against 260, so neither arithmetic nor the tool was needed (found in review)."""
    from toolrl.worker.rewards import is_correct

    for calc in ["13 * 20", r"13 \times 20", r"140 * 700 - 64202 + 64462", r"\frac{520}{2}", r"\sqrt{67600}",
                 "260 + 0", "(13)(20)"]:
        assert not is_correct(calc, "260"), calc
        assert score(comp(f"<answer>\\boxed{{{calc}}}</answer>"), "260",
                     RewardConfig(weights={"correct": 1.0}))[0]["correct"] == 0.0
    for number in ["260", "260.0", "+260", r"\$260", r"260 \text{ pages}", "260 pages", r"\text{260}",
                   r"13 \times 20 = 260"]:
        assert is_correct(number, "260"), number
    assert is_correct("1,234", "1234") and is_correct(r"-\frac{1}{2}", "-0.5") and is_correct("3/4", "0.75")
    assert not is_correct("261", "260") and not is_correct(r"\frac{2}{4}", "0.5") and not is_correct("", "0")
    assert is_correct(r"\frac12", "0.5") and not is_correct(r"\frac24", "0.5")


def test_a_recipe_pays_rewards_that_exist_and_fit_its_task():
    """A misspelt reward passed `config.py` ("config OK") and broke the gen worker with a traceback
    once the other processes were up; the shipped 8-GPU code recipe paid `correct` and `format` (the
    think/answer layout) for code, so its code_mode did nothing (found in review)."""
    import subprocess
    import sys

    from toolrl.config import load_config
    from toolrl.worker.rewards import check_reward_config

    with pytest.raises(ValueError, match=r"rewards.weights: unknown reward\(s\) \['corect'\]"):
        check_reward_config(load_config("configs/cpu_demo.yaml", ["rewards.weights.corect=1"]))
    with pytest.raises(ValueError, match="rewards.schedule: unknown"):
        check_reward_config(load_config("configs/cpu_demo.yaml",
                                        ["rewards.schedule.formt={start: 0, end: 1, steps: 2}"]))
    with pytest.raises(ValueError, match="weigh `code_format`"):
        check_reward_config(load_config("configs/cpu_code.yaml", ["rewards.weights.format=0.1"]))
    with pytest.raises(ValueError, match="graded by its tests"):
        check_reward_config(load_config("configs/cpu_code.yaml", ["rewards.weights={code_format: 1}"]))
    for recipe in ("configs/cpu_code.yaml", "configs/gpu_coder_1p5b_teacher_8gpu.yaml", "configs/cpu_demo.yaml"):
        check_reward_config(load_config(recipe))
    console_script = ["-c", "import sys, importlib.metadata as m; sys.argv[0] = 'toolrl-config'; "
                            "m.entry_points(group='console_scripts')['toolrl-config'].load()()"]
    for cli in (["config.py"], ["gen_worker.py"], console_script):
        out = subprocess.run([sys.executable, *cli, "--config", "configs/cpu_tiny.yaml",
                              "--set", "rewards.weights.corect=1"],
                             capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
        assert out.returncode == 1 and out.stderr.strip().endswith(
            "registered: ['code_format', 'correct', 'digit', 'format', 'mark', 'strict_format', 'tests', 'tool']")
        assert "Traceback" not in out.stderr and "config error: rewards.weights: unknown" in out.stderr


def test_an_empty_box_answers_nothing_and_earns_no_format_reward():
    """`\\boxed{}` counted as an answer for the format reward (found in review)."""
    text = "<think>\nx\n</think>\n<answer>\n\\boxed{}\n</answer>"
    assert extract_answer(text) is None
    comps, _ = score(comp(text), "4", RewardConfig(weights={"format": 1.0}))
    assert comps == {"correct": 0.0, "format": 0.0}
