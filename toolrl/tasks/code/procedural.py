"""Procedural code tasks (`data.source: pycode`, held out `pycode[:LEVEL or LO-HI]`): generated
function-writing problems at a small model's level, graded exactly like HumanEval.

Levels: 1, functions whose solution is one line over lists, strings and numbers
(toolrl.tasks.code.templates_lines); 2, loops, conditions and dictionaries (templates_loops); 3,
two-step specifications: filter then transform, group then aggregate (templates_steps). Each
template draws its parameters (thresholds, constants, variants) and surface names, so it yields
many different functions.

A problem is HumanEval's shape: the prompt is a signature and a docstring with the specification
and two examples, the question is HumanEval's (`humaneval_question`), the tests are asserts on
`candidate` (one test each, so the `tests` reward is the fraction passed); `program` is the prompt
plus the reference body, and the teacher's trace (toolrl.tasks.code.task.code_trace) is the
signature and the body alone (`meta["solution"]`: the prompt already shows the docstring). The
expected values come from running the reference on the inputs (edge cases first, then random).

The split. An instance's key is its template and its parameters (`instance_key`; names are left
out, so a renamed function is the same instance). A fixed hash of the key puts one key in five on
the held-out side (`split_of`), whatever the seed; the training stream draws only train-side
instances and held-out problems only held-out ones, so the two never share a function.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
import random
import textwrap
from functools import partial
from typing import Iterator, Literal

from toolrl.config import DataConfig, TeacherConfig
from toolrl.tasks.base import DataError, Problem, Task, Teacher
from toolrl.tasks.code import templates_lines, templates_loops, templates_steps
from toolrl.tasks.code.judge import TestSpec
from toolrl.tasks.code.loaders import humaneval_question
from toolrl.tasks.code.task import code_trace, load_code_traces
from toolrl.tasks.code.templates import NBSP, Instance, Template

Split = Literal["train", "heldout"]
TEMPLATES: dict[int, list[Template]] = {1: templates_lines.TEMPLATES, 2: templates_loops.TEMPLATES,
                                        3: templates_steps.TEMPLATES}
LEVELS = tuple(sorted(TEMPLATES))
HELDOUT_BUCKETS = 5  # one key in this many is held out
N_EXAMPLES = 2  # shown in the docstring; not among the tests
N_TESTS = 8  # hidden tests per problem (edge cases included)
MAX_ATTEMPTS = 2000  # draws of a template's parameters to find an instance on one side of the split


def instance_key(template: str, params: dict) -> str:
    """What makes an instance the same function: its template and its parameters, not its names."""
    return f"{template}:{json.dumps(params, sort_keys=True)}"


def split_of(key: str) -> Split:
    """The side of the split an instance key is on: a fixed hash of the key, seed-independent."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % HELDOUT_BUCKETS
    return "heldout" if bucket == 0 else "train"


def call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def reference(inst: Instance, program: str):
    """The reference function: our own code, never a model's."""
    ns: dict = {}
    exec(compile(program, f"<pycode {inst.name}>", "exec"), ns)
    return ns[inst.name]


def cases(inst: Instance, fn, rng: random.Random) -> tuple[list[tuple], list[tuple]]:
    """(examples, tests), each a list of (args, expected): the edge cases are tests; random inputs,
    all different, fill the examples and the rest of the tests."""
    edges = list({repr(a): a for a in inst.edges}.values())  # two edge cases may coincide
    seen = set(map(repr, edges))
    drawn = []
    for _ in range(200):
        if len(drawn) >= N_EXAMPLES + N_TESTS - len(edges):
            break
        args = inst.inputs(rng)
        if repr(args) not in seen:
            seen.add(repr(args))
            drawn.append(args)
    run = [(args, fn(*copy.deepcopy(args))) for args in drawn[:N_EXAMPLES] + edges + drawn[N_EXAMPLES:]]
    return run[:N_EXAMPLES], run[N_EXAMPLES:]


def render_prompt(inst: Instance, examples: list[tuple]) -> str:
    """HumanEval's prompt shape: the signature, then the docstring with the spec and the examples."""
    doc = [line.replace(NBSP, " ") for line in textwrap.wrap(inst.doc, 88)]
    lines = [f"def {inst.name}({inst.args}) -> {inst.returns}:", f'    """{doc[0]}'] + [f"    {d}" for d in doc[1:]]
    for args, want in examples:
        lines += [f"    >>> {call(inst.name, args)}", f"    {want!r}"]
    return "\n".join(lines + ['    """']) + "\n"


def make_problem(inst: Instance, template: str, level: int, rng: random.Random, pid: str, split: Split) -> Problem:
    """One problem from an instance: prompt, reference program, hidden tests."""
    body = textwrap.indent(inst.body, "    ") + "\n"
    fn = reference(inst, f"def {inst.name}({inst.args}):\n{body}")
    examples, tests = cases(inst, fn, rng)
    prompt = render_prompt(inst, examples)
    spec = TestSpec("assert", tests=[f"assert candidate{call('', args)} == {want!r}" for args, want in tests],
                    entry_point=inst.name, code_prompt=prompt)
    key = instance_key(template, inst.params)
    # The teacher writes the function without the docstring the prompt already shows: copied, it was
    # most of a trace's tokens, so the SFT term's token mean spent most of its weight on copying.
    solution = f"def {inst.name}({inst.args}) -> {inst.returns}:\n{body}"
    return Problem(id=pid, question=humaneval_question(prompt), answer=spec.to_json(), program=prompt + body,
                   level=level, grading="tests",
                   meta={"source": "pycode", "template": template, "key": key, "split": split,
                         "solution": solution})


def draw_instance(template: Template, split: Split, stem: str) -> tuple[Instance, random.Random]:
    """The template's first instance on `split`'s side, drawn with the seeds `stem:0`, `stem:1`, ..."""
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"{stem}:{attempt}")
        inst = template(rng)
        if split_of(instance_key(template.__name__, inst.params)) == split:
            return inst, rng
    raise DataError(f"pycode template {template.__name__} drew no {split} instance in {MAX_ATTEMPTS} tries")


def pycode_problem(seed: int, level: int, index: int, split: Split = "train") -> Problem:
    """Problem `index` of the stream (seed, level, split); the same arguments give the same problem.
    Every template of the level is as likely, on either side of the split."""
    if level not in TEMPLATES:
        raise DataError(f"pycode level must be one of {LEVELS}, got {level}")
    stem = f"pycode:{split}:{seed}:{level}:{index}"
    template = random.Random(stem).choice(TEMPLATES[level])
    inst, rng = draw_instance(template, split, stem)
    return make_problem(inst, template.__name__, level, rng, f"pycode-{split}-L{level}-s{seed}-{index}", split)


def top_level(level: int) -> int:
    """The curriculum may go past the last level (data.max_level up to 5): the hardest level stays."""
    return max(1, min(level, LEVELS[-1]))


class ProceduralCodeTask(Task):
    """`data.source: pycode` trains on the train side, at data.level (the curriculum moves it; with
    data.mix_levels, levels 1..level in turn); held out `pycode[:LEVEL]` or `pycode:LO-HI`, the
    held-out side from data.eval_seed."""

    name = "pycode"
    grading = "tests"
    curriculum = True

    def problems(self, data: DataConfig, n: int | None = None, seed: int | None = None) -> list[Problem]:
        seed = data.seed if seed is None else seed
        return [pycode_problem(seed, top_level(data.level), i) for i in range(n or 64)]

    def stream(self, data: DataConfig, offset: int, level: int | None = None) -> Iterator[Problem]:
        seed, top = data.seed * 100_003 + offset, top_level(level or data.level)
        if data.mix_levels:
            return (pycode_problem(seed, i % top + 1, i // top) for i in itertools.count())
        return (pycode_problem(seed, top, i) for i in itertools.count())

    def heldout(self, arg: str, n: int, seed: int, data: DataConfig) -> list[Problem]:
        task = f"{self.name}:{arg}" if arg else self.name
        lo, _, hi = arg.partition("-")
        try:
            levels = list(range(int(lo), int(hi or lo) + 1)) if lo else [top_level(data.level)]
        except ValueError:
            raise DataError(f"task {task!r}: use pycode, pycode:LEVEL or pycode:LO-HI") from None
        if not levels or not set(levels) <= set(LEVELS):
            raise DataError(f"task {task!r}: levels are {LEVELS[0]} to {LEVELS[-1]}")
        # problem i of level L is the same whatever n is, so a smaller eval is a prefix of a larger one
        return [pycode_problem(seed, levels[i % len(levels)], i // len(levels), "heldout") for i in range(n)]

    def teacher(self, cfg: TeacherConfig) -> Teacher:
        """The reference solution, in the code family's trace layout (or a collected trace by id)."""
        return partial(code_trace, traces=load_code_traces(cfg.traces_path))
