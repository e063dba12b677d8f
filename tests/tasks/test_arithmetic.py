"""The arithmetic family: the seeded generator, its curriculum streams and its teacher's traces."""
import contextlib
import io
import itertools
import json
import random
from pathlib import Path

import pytest

from toolrl.config import DataConfig, TeacherConfig
from toolrl.format import STOP_MARKER
from toolrl.tasks import get_task, load_problems, problem_stream
from toolrl.tasks.arithmetic import LEVELS, arithmetic_problem, arithmetic_problems, expression_in_words
from toolrl.tasks.textmath import load_gsm8k

FIX = Path(__file__).resolve().parent.parent / "fixtures"


def test_arithmetic_is_seeded_and_correct():
    a = arithmetic_problems(20, seed=7, level=3)
    b = arithmetic_problems(20, seed=7, level=3)
    assert a == b
    assert a != arithmetic_problems(20, seed=8, level=3)
    for p in a:
        expr = p.meta["expression"]
        assert str(eval(expr)) == p.answer
        assert p.program == f"print({expr})"
        assert int(p.answer) > 0
        for v in p.meta["numbers"].values():
            assert str(v) in p.question


@pytest.mark.parametrize("level", LEVELS)
def test_levels_need_a_calculator(level):
    probs = arithmetic_problems(50, seed=0, level=level)
    assert all(int(p.answer) >= 144 for p in probs)  # never a one-digit toy
    assert len({p.question for p in probs}) == 50
    if level >= 2:  # multi-step: at least one product and one more operation
        assert all(p.meta["expression"].count("*") >= 1 and len(p.meta["numbers"]) >= 3 for p in probs)
    # harder levels have bigger answers on average
    if level > 1:
        prev = arithmetic_problems(50, seed=0, level=level - 1)
        assert sum(int(p.answer) for p in probs) > sum(int(p.answer) for p in prev)


def test_training_problems_and_streams():
    cfg = DataConfig(source="arithmetic", seed=3, level=2)
    probs = load_problems(cfg, n=5)
    assert probs == arithmetic_problems(5, seed=3, level=2)
    assert load_problems(cfg, n=5, seed=4) != probs
    # each worker its own stream; the curriculum's level replaces data.level; mix_levels takes 1..level in turn
    a, b = problem_stream(cfg, "w0"), problem_stream(cfg, "w1")
    assert [p.id for p in itertools.islice(a, 3)] != [p.id for p in itertools.islice(b, 3)]
    assert {p.level for p in itertools.islice(problem_stream(cfg, "w0", level=4), 5)} == {4}
    mixed = DataConfig(source="arithmetic", level=3, mix_levels=True)
    assert [p.level for p in itertools.islice(problem_stream(mixed, "w0"), 6)] == [1, 2, 3, 1, 2, 3]
    assert get_task("arithmetic").curriculum and not get_task("gsm8k").curriculum


def test_heldout_seed_differs():
    cfg = DataConfig()
    train = {p.question for p in arithmetic_problems(200, seed=cfg.seed, level=1)}
    held = {p.question for p in arithmetic_problems(200, seed=cfg.eval_seed, level=1)}
    assert len(train & held) <= 2  # different streams; a rare coincidence is possible
    assert arithmetic_problem(cfg.eval_seed, 1, 0).id != arithmetic_problem(cfg.seed, 1, 0).id
    json.dumps(arithmetic_problem(0, 5, 0).meta)  # meta stays JSON-serialisable


def test_expression_in_words():
    assert expression_in_words("148 * 36 - 2915") == "148 times 36, minus 2915"
    assert expression_in_words("(2 * 3 + 4 * 5) * 6 - 7") == "(2 times 3, plus 4 times 5) times 6, minus 7"


def test_teacher_trace_plans_programs_and_concludes_from_the_output():
    """The trace's text (the executor run and the token layout: tests/test_rollout_loop.py)."""
    teacher = get_task("arithmetic").teacher(TeacherConfig())
    rng = random.Random(0)
    for p in arithmetic_problems(6, seed=4, level=3):
        t = teacher(p, rng)
        assert t.text.endswith(STOP_MARKER) and f"```python\n{t.program}\n```" in t.text and t.expect == p.answer
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(t.program, {})  # our own program: every style prints the answer
        assert out.getvalue().strip() == p.answer
        a, b, c = (p.meta["numbers"][k] for k in "abc")
        assert f"{a} times {b}, minus {c}" in t.text.split("<program>")[0]  # the plan names the operation
        assert t.conclusion("123").endswith("\\boxed{123}\n</answer>") and "</think>" in t.conclusion("1")
    assert teacher(load_gsm8k(str(FIX / "gsm8k_sample.jsonl"))[0], rng) is None  # not generated: no trace
