"""The procedural code family (pycode): every template's reference passes its hidden tests through
the real harness and judge while wrong programs fail them, the train and held-out sides share no
instance, the curriculum's levels, HumanEval's prompt shape, and partial credit per test."""
import doctest
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from toolrl.config import DataConfig, TeacherConfig, load_config
from toolrl.tasks import DataError, get_task, load_problems, load_task, problem_stream, task_seed
from toolrl.tasks.code import templates_lines
from toolrl.tasks.code.judge import TestSpec, build_harness, judge, new_nonce, program_in
from toolrl.tasks.code.loaders import humaneval_question
from toolrl.tasks.code.procedural import (LEVELS, N_TESTS, TEMPLATES, draw_instance, instance_key, make_problem,
                                          pycode_problem, split_of)
from toolrl.worker.rewards import Completion, score

ROOT = Path(__file__).resolve().parents[3]
ALL = [(level, t) for level in LEVELS for t in TEMPLATES[level]]


def problem_of(level, template, split="train", stem="t"):
    inst, rng = draw_instance(template, split, f"{stem}:{template.__name__}")
    return make_problem(inst, template.__name__, level, rng, f"{stem}-{template.__name__}", split), inst


# Runs each harness in a process of its own, forked from one plain interpreter (as the executor's
# fork server does), its nonce on its stdin: one interpreter start for all of them keeps this fast.
FORKER = r"""
import collections, decimal, fractions, hashlib, io, json, os, signal, sys
outs = []
for code, stdin in json.loads(sys.stdin.read()):
    r0, w0 = os.pipe()
    r1, w1 = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(r0, 0)
        os.dup2(w1, 1)
        for fd in (r0, w0, r1, w1):
            os.close(fd)
        exec(compile(code, "<harness>", "exec"), {"__name__": "__main__"})
        os._exit(1)
    os.close(r0)
    os.close(w1)
    os.write(w0, stdin.encode())
    os.close(w0)
    chunks = []
    while chunk := os.read(r1, 1 << 16):
        chunks.append(chunk)
    os.close(r1)
    os.waitpid(pid, 0)
    outs.append(b"".join(chunks).decode())
print(json.dumps(outs))
"""


def run_judged(jobs):
    """(completion, problem) pairs through what the reward runs: extraction (program_in), the
    harness and the judge (the harness unsandboxed; the sandboxed executor runs the same code:
    tests/tasks/code/test_code_rewards.py)."""
    specs = [TestSpec.from_json(p.answer) for _, p in jobs]
    nonces = [new_nonce() for _ in specs]
    runs = [build_harness(program_in(c, spec), spec, 2.0, nonce) for (c, _), spec, nonce in zip(jobs, specs, nonces)]
    out = subprocess.run([sys.executable, "-S", "-c", FORKER], input=json.dumps(runs), capture_output=True,
                         text=True, timeout=120, check=True)
    return [judge(stdout, "ok", nonce, spec) for stdout, nonce, spec in zip(json.loads(out.stdout), nonces, specs)]


def test_the_levels_have_a_dozen_templates_each():
    assert LEVELS == (1, 2, 3) and all(len(TEMPLATES[level]) >= 12 for level in LEVELS)
    assert len({t.__name__ for _, t in ALL}) == len(ALL)


def test_every_reference_passes_its_tests_through_the_judge_and_wrong_programs_fail():
    """Each template on both sides of the split: its teacher trace (the reference, in the layout
    prompts/code.txt asks for) and its bare body (a HumanEval-style continuation of the prompt) pass
    every hidden test; `return None` fails them all, and the reference of a training instance of the
    template (other parameters) fails some."""
    teacher = get_task("pycode").teacher(TeacherConfig())
    good, bad = [], []
    for level, t in ALL:
        train, train_inst = problem_of(level, t, "train")
        held, inst = problem_of(level, t, "heldout")
        trace = teacher(train, random.Random(0)).text
        assert '"""' not in trace  # the docstring is the prompt's; the trace is the function alone
        good.append((trace, train))
        body = held.program[len(TestSpec.from_json(held.answer).code_prompt):]
        good.append((f"<think>\nok\n</think>\n```python\n{body}```", held))
        bad.append((f"```python\ndef {inst.name}(*args):\n    return None\n```", held))
        bad.append((f"```python\n{train.program.replace(f'def {train_inst.name}(', f'def {inst.name}(')}```", held))
    results = run_judged(good + bad)
    failed = [p.id for (_, p), r in zip(good, results) if (r.passed, r.total) != (N_TESTS, N_TESTS)]
    assert failed == []
    wrong = results[len(good):]
    assert [p.id for (_, p), r in zip(bad[::2], wrong[::2]) if r.passed] == []  # None is never expected
    # a neighbouring function is not the held-out one (a rare pair that the tests cannot tell apart:
    # test_hidden_tests_tell_instances_of_a_template_apart)
    assert sum(r.passed == r.total for r in wrong[1::2]) <= len(ALL) // 10
    assert sum(r.passed for r in wrong[1::2]) < 0.7 * sum(r.total for r in wrong[1::2])


def test_hidden_tests_tell_instances_of_a_template_apart():
    """Another instance's reference (other parameters) fails at least one test of almost every
    instance: the tests check the parameters, not only the kind of function."""
    fooled = pairs = 0
    for level, t in ALL:
        probs = {}
        for i in range(12):
            p, inst = problem_of(level, t, "train", stem=f"tell{i}")
            probs.setdefault(p.meta["key"], (p, inst))
        assert len(probs) >= 4, t.__name__
        fns = {}
        for key, (p, inst) in probs.items():
            ns = {}
            exec(p.program, ns)
            fns[key] = ns[inst.name]
        for (ka, fa), (kb, (pb, _)) in itertools.product(fns.items(), probs.items()):
            if ka != kb:
                pairs += 1
                fooled += all(_passes(fa, test) for test in TestSpec.from_json(pb.answer).tests)
    assert fooled / pairs < 0.05


def _passes(fn, test):
    try:
        exec(test, {"candidate": fn})
        return True
    except Exception:
        return False


def test_train_and_heldout_share_no_instance():
    """The split is a fixed hash of the instance key (template and parameters, not names), so no
    seed, level or stream brings a held-out function into training, and every template has
    instances on both sides."""
    d = DataConfig(source="pycode", seed=0, level=3, mix_levels=True)
    train = load_problems(d, n=60) + [p for w in ("w0", "w1") for p in itertools.islice(problem_stream(d, w), 90)]
    held = load_task("pycode:1-3", 180, task_seed(d, "pycode"), d) + load_task("pycode:1-3", 60, d.seed, d)
    assert {p.meta["split"] for p in train} == {"train"} and {p.meta["split"] for p in held} == {"heldout"}
    assert all(split_of(p.meta["key"]) == p.meta["split"] for p in train + held)
    assert not {p.meta["key"] for p in train} & {p.meta["key"] for p in held}
    assert not {p.id for p in train} & {p.id for p in held}
    assert len({p.meta["template"] for p in held}) > 0.8 * len(ALL)
    for _, t in ALL:  # every template has instances on both sides
        assert {split_of(instance_key(t.__name__, draw_instance(t, side, "sides")[0].params))
                for side in ("train", "heldout")} == {"train", "heldout"}
    keys = {instance_key(t.__name__, t(random.Random(i)).params) for _, t in ALL for i in range(200)}
    share = sum(split_of(k) == "heldout" for k in keys) / len(keys)
    assert 0.15 < share < 0.25, share
    # names are surface: draws with the same parameters are one instance, whatever they are called
    names: dict[str, set] = {}
    for i in range(100):
        inst = templates_lines.reverse_words(random.Random(i))
        names.setdefault(instance_key("reverse_words", inst.params), set()).add(inst.name)
    assert len(names) <= 18 and max(len(n) for n in names.values()) > 1


def test_problems_are_humaneval_shaped():
    for level, t in ALL:
        p, inst = problem_of(level, t)
        spec = TestSpec.from_json(p.answer)
        assert p.grading == "tests" and p.level == level and spec.kind == "assert" and spec.entry_point == inst.name
        assert p.question == humaneval_question(spec.code_prompt) and p.program.startswith(spec.code_prompt)
        assert len(spec.tests) == len(set(spec.tests)) == N_TESTS
        # the docstring's examples are right, and are not among the hidden tests
        ns = {}
        exec(p.program, ns)
        runner = doctest.DocTestRunner()
        for test in doctest.DocTestFinder().find(ns[inst.name], inst.name, globs=ns):
            runner.run(test)
        assert runner.summarize(verbose=False) == (0, 2), t.__name__
        examples = [line.split(">>> ", 1)[1].split("(", 1)[1]
                    for line in spec.code_prompt.splitlines() if ">>>" in line]
        assert not [e for e in examples for test in spec.tests if f"candidate({e} ==" in test]


def test_curriculum_levels_streams_and_task_strings():
    task = get_task("pycode")
    assert task.curriculum and task.grading == "tests"
    d = DataConfig(source="pycode", seed=3, level=2)
    assert {p.level for p in load_problems(d, n=5)} == {2} and load_problems(d, n=5) == load_problems(d, n=5)
    assert load_problems(d, n=5, seed=4) != load_problems(d, n=5)
    a, b = problem_stream(d, "w0"), problem_stream(d, "w1")
    assert [p.id for p in itertools.islice(a, 3)] != [p.id for p in itertools.islice(b, 3)]
    assert {p.level for p in itertools.islice(problem_stream(d, "w0", level=3), 4)} == {3}
    # data.max_level may be 4 or 5: past the last level the curriculum stays on it
    assert {p.level for p in itertools.islice(problem_stream(d, "w0", level=5), 4)} == {3}
    mixed = DataConfig(source="pycode", level=3, mix_levels=True)
    assert [p.level for p in itertools.islice(problem_stream(mixed, "w0"), 6)] == [1, 2, 3, 1, 2, 3]
    ps = load_task("pycode:1-3", 7, 5, d)
    assert [p.level for p in ps] == [1, 2, 3, 1, 2, 3, 1] and load_task("pycode:1-3", 4, 5, d) == ps[:4]
    assert [p.id for p in load_task("pycode:2", 2, 5, d)] == [f"pycode-heldout-L2-s5-{i}" for i in range(2)]
    assert {p.level for p in load_task("pycode", 3, 5, d)} == {2}  # default: data.level
    assert task_seed(d, "pycode:1") == d.eval_seed
    for bad in ("pycode:x", "pycode:3-1", "pycode:4", "pycode:0-2"):
        with pytest.raises(DataError, match="pycode"):
            load_task(bad, 3, 5, d)
    with pytest.raises(DataError, match="level"):
        pycode_problem(0, 4, 0)


def test_partial_credit_is_the_fraction_of_tests_passed():
    """The worker's reward for grading "tests": `tests` is the fraction passed (rewards.code_mode
    fraction, as configs/cpu_code.yaml), `correct` only when all pass."""
    inst, rng = draw_instance(templates_lines.clamp, "train", "partial")
    p = make_problem(inst, "clamp", 1, rng, "partial", "train")
    x, hi = inst.args.split(":")[0], inst.params["hi"]
    half = f"<think>\nno lower bound\n</think>\n```python\ndef {inst.name}({x}):\n    return min({hi}, {x})\n```"
    teacher = get_task("pycode").teacher(TeacherConfig())(p, random.Random(0)).text
    cfg = load_config(ROOT / "configs" / "cpu_code.yaml").rewards
    results = run_judged([(half, p), (teacher, p)])
    assert 0 < results[0].passed < results[0].total
    (comps, _), (full, _) = (score(Completion(text, text, tests=r, grading="tests"), p.answer, cfg)
                             for text, r in zip((half, teacher), results))
    assert comps["tests"] == pytest.approx(results[0].passed / N_TESTS) and comps["correct"] == 0.0
    assert full["tests"] == full["correct"] == full["code_format"] == 1.0
