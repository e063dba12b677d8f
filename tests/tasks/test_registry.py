"""The task registry: every family through the same entry points (training problems, a worker's
stream, held-out task strings, their seed), and a new family is one class plus its registration."""
import asyncio
import itertools
import random
from pathlib import Path

import pytest

from toolrl.config import DataConfig, TeacherConfig, load_config
from toolrl.tasks import (TASKS, DataError, Problem, Task, TeacherTrace, get_task, load_problems, load_task,
                          problem_stream, register_task, task_names, task_seed)
from toolrl.tasks.code.loaders import load_humaneval, split
from toolrl.worker.service import GenWorker
from toolrl.worker.rewards import Completion, score
from toolrl.worker.teacher import teacher_sample

FIX = Path(__file__).resolve().parent.parent / "fixtures"


def test_the_built_in_families_are_registered():
    assert task_names() == ["arithmetic", "code", "gsm8k", "jsonl", "math", "pycode"]
    assert {n for n in TASKS if get_task(n).grading == "tests"} == {"code", "pycode"}
    assert [n for n in TASKS if get_task(n).curriculum] == ["arithmetic", "pycode"]


def test_an_unknown_family_is_one_clear_error_that_lists_the_registered_ones():
    registered = "registered: arithmetic, code, gsm8k, jsonl, math, pycode"
    with pytest.raises(DataError, match=f"unknown task family 'chess'; {registered}"):
        load_task("chess:x", 1, 0, DataConfig())
    with pytest.raises(DataError, match="unknown task family 'chess'"):
        task_seed(DataConfig(), "chess:x")
    with pytest.raises(DataError, match=f"unknown task family 'chess'; {registered}"):
        load_problems(DataConfig(source="chess"))
    with pytest.raises(DataError, match="unknown task family 'chess'"):  # a gen worker fails before its engine starts
        GenWorker(load_config(None, ["data.source=chess"]), worker_id="t", engine=object())
    with pytest.raises(ValueError, match="already registered"):
        register_task(get_task("math"))


def test_arithmetic_level_ranges_take_the_levels_in_turn():
    d = DataConfig(level=1)
    ps = load_task("arithmetic:1-3", 7, 5, d)
    assert [p.level for p in ps] == [1, 2, 3, 1, 2, 3, 1]
    assert load_task("arithmetic:1-3", 4, 5, d) == ps[:4]  # a smaller eval is a prefix
    assert [p.id for p in load_task("arithmetic:2", 3, 5, d)] == [f"arith-L2-s5-{i}" for i in range(3)]
    assert {p.level for p in load_task("arithmetic", 3, 5, DataConfig(level=3))} == {3}  # default: data.level
    for bad in ("arithmetic:x", "arithmetic:3-1"):
        with pytest.raises(DataError, match="arithmetic"):
            load_task(bad, 3, 5, d)


def test_code_task_is_the_held_out_split_seeded_by_the_training_seed():
    d = DataConfig(source="code", seed=0)
    held = load_task("code:humaneval", 100, task_seed(d, "code:humaneval"), d)
    assert [p.id for p in held] == [p.id for p in split(load_humaneval(), 0)[1]] and len(held) == 33
    train = load_problems(d)
    assert len(train) == 164 - 33 and not {p.id for p in train} & {p.id for p in held}
    assert {p.grading for p in held + train} == {"tests"}
    # another seed (evaluate.py --seed, eval.seed) held out 29 of 33 problems that training saw (found in review)
    with pytest.raises(DataError, match=r"seed 1 for code:humaneval: .* holds out problems it trained on"):
        load_task("code:humaneval", 100, 1, d)


def test_seeds_and_file_tasks():
    d = DataConfig(seed=3, eval_seed=77)
    assert task_seed(d, "arithmetic:2") == task_seed(d, "gsm8k:x") == 77 and task_seed(d, "code:humaneval") == 3
    assert task_seed(d, "code:humaneval", seed=9) == 9
    assert len(load_task(f"gsm8k:{FIX / 'gsm8k_sample.jsonl'}", 2, 0, d)) == 2
    assert [p.grading for p in load_task(f"math:{FIX / 'math_sample.jsonl'}", 5, 0, d)] == ["answer"] * 3
    with pytest.raises(DataError, match="needs a file"):
        load_task("gsm8k", 1, 0, d)


def test_a_file_family_streams_its_problems_reshuffled_per_worker():
    d = DataConfig(source="jsonl", path=str(FIX / "generic_sample.jsonl"), question_field="prompt",
                   answer_field="target")
    a = [p.id for p in itertools.islice(problem_stream(d, "w0"), 6)]
    assert sorted(a) == ["q1", "q1", "q1", "q2", "q2", "q2"] and a == [
        p.id for p in itertools.islice(problem_stream(d, "w0"), 6)]  # seeded
    with pytest.raises(DataError, match="missing field"):  # a bad file fails when the stream is made
        problem_stream(d.model_copy(update={"question_field": "nope"}), "w0")


def test_an_empty_training_file_is_a_data_error_when_the_stream_is_made(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no problems"):  # not an endless loop at the first draw
        problem_stream(DataConfig(source="jsonl", path=str(empty)), "w0")


class Parity(Task):
    """A toy family: is a number even? Generated, graded by the boxed answer, with a plain teacher."""

    name = "parity"

    def problems(self, data, n=None, seed=None):
        rng = random.Random(data.seed if seed is None else seed)
        nums = [rng.randrange(1000) for _ in range(n or 8)]
        return [Problem(id=f"parity-{k}", question=f"Is {k} even? Answer 1 or 0.", answer=str(int(k % 2 == 0)))
                for k in nums]

    def heldout(self, arg, n, seed, data):
        return self.problems(data, n, seed)

    def teacher(self, cfg):
        return lambda p, rng: TeacherTrace(f"<think>\nparity\n</think>\n<answer>\n\\boxed{{{p.answer}}}\n</answer>")


class ByteTokenizer:
    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


def test_a_new_family_is_one_class_and_its_registration():
    register_task(Parity())
    try:
        data = load_config(None, ["data.source=parity", "data.seed=5"]).data
        assert load_problems(data, n=3) == Parity().problems(data, 3)
        stream = problem_stream(data, "w0")
        assert {next(stream).id for _ in range(16)} == {p.id for p in load_problems(data)}  # every problem, on
        held = load_task("parity", 4, task_seed(data, "parity"), data)  # ... and held out, from data.eval_seed
        assert held == Parity().problems(data, 4, data.eval_seed) != load_problems(data, n=4)
        p = held[0]
        text = f"<think>\nk\n</think>\n<answer>\n\\boxed{{{p.answer}}}\n</answer>"
        assert score(Completion(text, text, grading=p.grading), p.answer, load_config().rewards)[0]["correct"] == 1.0
        trace = get_task(data.source).teacher(TeacherConfig())(p, random.Random(0))
        s = asyncio.run(teacher_sample(trace, [1], ByteTokenizer(), None, 64, "g:teacher0", 0, prefill="<think>\n"))
        assert s.text == trace.text and s.completion_ids[-1] == 0 and set(s.loss_mask) == {1}
    finally:
        TASKS.pop("parity")
    with pytest.raises(DataError, match="unknown task family 'parity'"):
        load_task("parity", 1, 0, DataConfig())
