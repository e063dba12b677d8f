"""The built-in arithmetic word problems: a seeded generator whose levels form a curriculum, and
the teacher that writes each problem's ideal trace.

Numbers are large enough (3-digit products, several steps) that a 135M model cannot do them in its
head, and every problem carries the exact expression that solves it, so the teacher can state the
calculation in words, write a program for it and conclude from the program's real output.
"""
from __future__ import annotations

import itertools
import random
from typing import Iterator

from toolrl.config import DataConfig, TeacherConfig
from toolrl.format import STOP_MARKER
from toolrl.tasks.base import DataError, Problem, Task, Teacher, TeacherTrace

# ---------------------------------------------------------------------------------------------
# The generator

_TEMPLATES: dict[int, list[str]] = {
    1: [  # a * b
        "A farmer plants {a} rows of apple trees with {b} trees in each row. How many trees does the farmer plant?",
        "A school orders {a} boxes of pencils. Each box holds {b} pencils. How many pencils does the school order?",
        "A theater has {a} rows with {b} seats in each row. How many seats does the theater have?",
        "A printer prints {b} pages per minute for {a} minutes. How many pages does it print?",
        "Each of {a} buses carries {b} people. How many people do the buses carry in total?",
    ],
    2: [  # a * b + c
        "A warehouse receives {a} crates with {b} bottles in each crate. It already holds {c} bottles. "
        "How many bottles are in the warehouse now?",
        "A library buys {a} boxes of {b} books each and receives {c} donated books. How many new books does it get?",
        "A factory makes {b} toys an hour for {a} hours, plus {c} toys on a night shift. How many toys does it make?",
        "A runner trains {a} days and runs {b} laps each day, then {c} more laps in a race. How many laps in total?",
    ],
    3: [  # a * b - c
        "A bakery bakes {a} trays with {b} rolls on each tray and sells {c} rolls. How many rolls are left?",
        "A train makes {a} trips carrying {b} passengers each time, and {c} of them ride for free. "
        "How many passengers pay?",
        "A shop orders {a} packs of {b} batteries and {c} batteries turn out to be broken. "
        "How many batteries work?",
        "A farm collects {b} eggs a day for {a} days and ships {c} of them. How many eggs are still on the farm?",
    ],
    4: [  # a * b + c * d
        "A store sells {a} shirts at {b} dollars each and {c} jackets at {d} dollars each. "
        "How many dollars does it take in?",
        "A farm has {a} fields with {b} plants each and {c} greenhouses with {d} plants each. "
        "How many plants does the farm have?",
        "A stadium has {a} blocks of {b} seats and {c} boxes of {d} seats. How many seats are there?",
    ],
    5: [  # (a * b + c * d) * e - f
        "A company has {e} branches. Each branch sells {a} units at {b} dollars and {c} units at {d} dollars. "
        "After paying {f} dollars in fees in total, how many dollars does the company keep?",
        "A school has {e} buildings. Each building has {a} rooms with {b} chairs and {c} halls with {d} chairs. "
        "{f} chairs are being repaired. How many chairs can be used?",
    ],
}

_EXPRESSIONS = {
    1: "{a} * {b}",
    2: "{a} * {b} + {c}",
    3: "{a} * {b} - {c}",
    4: "{a} * {b} + {c} * {d}",
    5: "({a} * {b} + {c} * {d}) * {e} - {f}",
}

LEVELS = tuple(sorted(_TEMPLATES))


def _numbers(level: int, rng: random.Random) -> dict[str, int]:
    if level == 1:
        return {"a": rng.randint(12, 99), "b": rng.randint(12, 99)}
    if level == 2:
        return {"a": rng.randint(101, 999), "b": rng.randint(12, 99), "c": rng.randint(101, 999)}
    if level == 3:
        a, b = rng.randint(101, 999), rng.randint(101, 999)
        return {"a": a, "b": b, "c": rng.randint(1001, a * b - 1)}
    if level == 4:
        return {k: rng.randint(101, 999) for k in "abcd"}
    if level == 5:
        nums = {k: rng.randint(101, 999) for k in "abcd"}
        nums["e"] = rng.randint(3, 19)
        nums["f"] = rng.randint(1001, (nums["a"] * nums["b"] + nums["c"] * nums["d"]) * nums["e"] - 1)
        return nums
    raise DataError(f"arithmetic level must be one of {LEVELS}, got {level}")


def arithmetic_problem(seed: int, level: int, index: int) -> Problem:
    """Problem `index` of the stream (seed, level); the same triple always gives the same problem."""
    rng = random.Random(f"arith:{seed}:{level}:{index}")
    nums = _numbers(level, rng)
    template = rng.choice(_TEMPLATES[level])
    expr = _EXPRESSIONS[level].format(**nums)
    value = eval(expr, {"__builtins__": {}})  # our own integer expression, never model output
    return Problem(id=f"arith-L{level}-s{seed}-{index}", question=template.format(**nums), answer=str(value),
                   program=f"print({expr})", level=level, meta={"expression": expr, "numbers": nums})


def arithmetic_problems(n: int, seed: int = 0, level: int = 1, start: int = 0) -> list[Problem]:
    return [arithmetic_problem(seed, level, i) for i in range(start, start + n)]


def arithmetic_stream(seed: int = 0, level: int = 1) -> Iterator[Problem]:
    i = 0
    while True:
        yield arithmetic_problem(seed, level, i)
        i += 1


def mixed_stream(seed: int, top: int) -> Iterator[Problem]:
    """Levels 1..top in turn, so earlier levels keep being reviewed (data.mix_levels)."""
    return (arithmetic_problem(seed, i % top + 1, i // top) for i in itertools.count())


# ---------------------------------------------------------------------------------------------
# The teacher: the calculation in words, a program, the executor's output, the boxed answer.
# Wording and program style vary so the model learns the behaviour, not one string.

# The plan states the calculation in words before the program: choosing the operation from the
# question ("sells" -> minus) is what a model that has the format still gets wrong (docs/RESULTS.md).
_PLAN = [
    "I need {words}.",
    "The question asks for {words}.",
    "So the calculation is {words}.",
    "That is {words}.",
]
_REASONING = [
    "I will compute it with Python.",
    "Let me write the calculation as a program instead of doing it in my head.",
    "The numbers are large, so I will let Python do the arithmetic.",
    "I will turn this into an expression and run it.",
    "I will use Python to get the exact number.",
]
_CONCLUSION = [
    "The program printed {n}, so the answer is {n}.",
    "So the result is {n}.",
    "The computation gives {n}.",
    "Python says {n}, which answers the question.",
]
_WORDS = {"*": "times", "+": "plus", "-": "minus"}


def expression_in_words(expr: str) -> str:
    """'148 * 36 - 2915' -> '148 times 36, minus 2915': the plan a teacher states before coding."""
    out = []
    for tok in expr.replace("(", "( ").replace(")", " )").split():
        if tok in ("+", "-") and out:
            out[-1] += ","
        out.append(_WORDS.get(tok, tok))
    return " ".join(out).replace("( ", "(").replace(" )", ")").replace(",)", ")")


def teacher_program(problem: Problem, rng: random.Random) -> str:
    """The program that solves the problem, in one of a few styles."""
    expr = problem.meta["expression"]
    nums = problem.meta["numbers"]
    style = rng.randrange(3)
    if style == 0:
        return f"print({expr})"
    if style == 1:
        return f"result = {expr}\nprint(result)"
    names = {k: f"{k}_value" if rng.random() < 0.5 else k for k in nums}
    lines = [f"{names[k]} = {v}" for k, v in nums.items()]
    body = expr
    for k, v in sorted(nums.items(), key=lambda kv: -len(str(kv[1]))):  # replace longer numbers first
        body = body.replace(str(v), names[k], 1)
    return "\n".join(lines + [f"total = {body}", "print(total)"])


def teacher_trace(problem: Problem, rng: random.Random) -> TeacherTrace | None:
    """The ideal tool trace: plan, program, stop marker; after the executor's output, the conclusion
    and the boxed answer. None for a problem the generator did not make."""
    if problem.program is None or "expression" not in problem.meta:
        return None
    code = teacher_program(problem, rng)
    plan = rng.choice(_PLAN).format(words=expression_in_words(problem.meta["expression"]))
    head = f"{plan} {rng.choice(_REASONING)}\n<program>\n```python\n{code}\n```\n</program>\n{STOP_MARKER}"

    def conclusion(n: str) -> str:  # drawn only once the program has run, as the teacher always did
        return f"{rng.choice(_CONCLUSION).format(n=n)}\n</think>\n<answer>\n\\boxed{{{n}}}\n</answer>"

    return TeacherTrace(head, program=code, expect=problem.answer, conclusion=conclusion)


# ---------------------------------------------------------------------------------------------
# The family

class ArithmeticTask(Task):
    """`data.source: arithmetic`; held out `arithmetic[:LEVEL]` or `arithmetic:LO-HI` (the levels in turn)."""

    name = "arithmetic"
    curriculum = True

    def problems(self, data: DataConfig, n: int | None = None, seed: int | None = None) -> list[Problem]:
        return arithmetic_problems(n or 64, seed=data.seed if seed is None else seed, level=data.level)

    def stream(self, data: DataConfig, offset: int, level: int | None = None) -> Iterator[Problem]:
        seed, level = data.seed * 100_003 + offset, level or data.level
        return mixed_stream(seed, level) if data.mix_levels else arithmetic_stream(seed=seed, level=level)

    def heldout(self, arg: str, n: int, seed: int, data: DataConfig) -> list[Problem]:
        task = f"{self.name}:{arg}" if arg else self.name
        lo, _, hi = arg.partition("-")
        try:
            levels = range(int(lo), int(hi or lo) + 1) if lo else [data.level]
        except ValueError:
            raise DataError(f"task {task!r}: use arithmetic, arithmetic:LEVEL or arithmetic:LO-HI") from None
        if not levels:
            raise DataError(f"task {task!r}: empty level range")
        # problem i of level L is the same whatever n is, so a smaller eval is a prefix of a larger one
        return [arithmetic_problem(seed, levels[i % len(levels)], i // len(levels)) for i in range(n)]

    def teacher(self, cfg: TeacherConfig) -> Teacher:
        return teacher_trace
