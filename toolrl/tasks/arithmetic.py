"""The built-in arithmetic word problems: a seeded generator whose levels form a curriculum, and
the teacher that writes each problem's ideal trace.

Numbers are large enough (3-digit products, several steps) that a 135M model cannot do them in its
head, and every problem carries the exact expression that solves it, so the teacher can state the
calculation in words, write a program for it and conclude from the program's real output.

Every problem has a *kind* (`Problem.meta["kind"]`): the operation it asks for and how it is worded.
The taught kinds are the curriculum's levels, one each (`product` is level 1, a·b; ...); by default
the training stream draws only these and the teacher demonstrates only these. The teacher-free kinds
are kinds the teacher never writes a trace for, so whatever a policy learns on them comes from reward
alone: `gain`, `loss` (group `verbs`: a·b + c and a·b − c in new wordings whose verb alone says
which) and `product_plus_commas`, `product_minus_commas` (group `commas`: the taught a·b ± c with
numbers written "1,250", which a program must not copy). `data.kinds` adds them to the stream,
`teacher.kinds` says which kinds the teacher demonstrates, `arithmetic:1-3@free` evaluates them all
(docs/ARCHITECTURE.md, "The teacher and the curriculum").
"""
from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

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


# ---------------------------------------------------------------------------------------------
# Kinds: the taught ones are the levels above; the teacher-free ones are defined here.

@dataclass(frozen=True)
class Kind:
    name: str
    level: int  # where it sits in the curriculum (data.level .. max_level select kinds by level)
    expression: str  # format string over the numbers: the exact calculation
    templates: tuple[str, ...]
    numbers: Callable[[random.Random], dict[str, int]]
    taught: bool  # the default partition: taught kinds get teacher traces, the others never by default
    commas: bool = False  # the question writes its numbers with thousands separators ("1,250")


# The teacher-free kinds: the taught operations a·b + c and a·b − c in new wordings. Each scene is
# worded twice, once gaining c and once losing it, with the same question, so only the verb says
# which operation it is, in verbs the taught templates never use. The question ("... after that?")
# ends as no taught template does ("... now?" is a taught a·b + c ending). That removed one cue, not
# the drift: SFT on the taught kinds still moves both free kinds toward plus (docs/RESULTS.md).
# Measured on a policy that the teacher had trained on levels 1-3 (docs/RESULTS.md, "Teacher-free
# kinds"; the old question): gain 0.67, loss 0.25, so groups have reward variance from the start
# and there is room above. New operations
# (division, c − a·b, (a + b)·c, a + b, a − b, a·b·c, a·b ± c·d) were solved 0-5% of the time
# there: no group would have had reward variance, so they are not kinds here.
_SCENES = [  # (setting, what is gained, what is lost, the question)
    ("A beekeeper has {a} hives with {b} bees in each hive", "a swarm of {c} bees joins them",
     "{c} of the bees fly away", "How many bees does the beekeeper have after that?"),
    ("A collector fills {a} albums with {b} stamps each", "a friend gives her {c} stamps as a gift",
     "she loses {c} stamps in a move", "How many stamps does the collector have after that?"),
    ("A florist arranges {a} vases of {b} roses each", "she picks {c} roses from her garden",
     "{c} of the roses wilt and are thrown out", "How many roses does the florist have after that?"),
    ("A ship loads {a} containers of {b} tons each", "it takes on {c} tons of fuel",
     "it unloads {c} tons at the first port", "How many tons does the ship carry after that?"),
]


def _gain_loss_numbers(rng: random.Random) -> dict[str, int]:
    # the same numbers for both kinds (c < a * b): their size says nothing about the operation
    return {"a": rng.randint(101, 999), "b": rng.randint(12, 99), "c": rng.randint(101, 999)}


_FREE_KINDS = [
    Kind("gain", 2, "{a} * {b} + {c}", tuple(f"{s}, and then {g}. {q}" for s, g, _, q in _SCENES),
         _gain_loss_numbers, False),
    Kind("loss", 3, "{a} * {b} - {c}", tuple(f"{s}, and then {lost}. {q}" for s, _, lost, q in _SCENES),
         _gain_loss_numbers, False),
]


def _comma_numbers(level: int, rng: random.Random) -> dict[str, int]:
    a, b = rng.randint(1001, 9999), rng.randint(12, 99)
    return {"a": a, "b": b, "c": rng.randint(1001, 9999 if level == 2 else a * b - 1)}


# The teacher-free kinds, second design: the taught a·b + c and a·b − c, in the taught templates,
# with a and c above 1000 and written with thousands separators. The teacher writes the numbers of
# the question into its program, which for the taught kinds (no separators) is right; copied here,
# "1,250 * 48" is a Python tuple and the answer is wrong. Only the reward says to drop the commas.
_COMMA_KINDS = [
    Kind(f"{name}_commas", level, _EXPRESSIONS[level], tuple(_TEMPLATES[level]),
         lambda rng, level=level: _comma_numbers(level, rng), False, commas=True)
    for level, name in ((2, "product_plus"), (3, "product_minus"))
]

_TAUGHT_NAMES = {1: "product", 2: "product_plus", 3: "product_minus", 4: "two_products", 5: "branches"}
KINDS: dict[str, Kind] = {
    **{name: Kind(name, level, _EXPRESSIONS[level], tuple(_TEMPLATES[level]),
                  lambda rng, level=level: _numbers(level, rng), True) for level, name in _TAUGHT_NAMES.items()},
    **{k.name: k for k in _FREE_KINDS},
    **{k.name: k for k in _COMMA_KINDS},
}
TAUGHT_KINDS = tuple(k.name for k in KINDS.values() if k.taught)
FREE_KINDS = tuple(k.name for k in KINDS.values() if not k.taught)
KIND_GROUPS = {"taught": TAUGHT_KINDS, "free": FREE_KINDS, "all": tuple(KINDS),
               "verbs": tuple(k.name for k in _FREE_KINDS), "commas": tuple(k.name for k in _COMMA_KINDS)}


def kind_names(names: Sequence[str], what: str = "kinds") -> list[str]:
    """Kind names with the groups (taught, free, all, verbs, commas) expanded, in order (repeats kept:
    a kind named twice in data.kinds is drawn twice as often). DataError for a name that is neither."""
    out: list[str] = []
    for n in names:
        if n in KIND_GROUPS:
            out += KIND_GROUPS[n]
        elif n in KINDS:
            out.append(n)
        else:
            raise DataError(f"{what}: unknown arithmetic kind {n!r}; kinds: {', '.join(KINDS)} "
                            f"(groups: {', '.join(KIND_GROUPS)})")
    if not out:
        raise DataError(f"{what}: no kind given")
    return out


def arithmetic_problem(seed: int, level: int, index: int) -> Problem:
    """Problem `index` of the stream (seed, level) of the level's taught kind; the same triple always
    gives the same problem."""
    rng = random.Random(f"arith:{seed}:{level}:{index}")
    nums = _numbers(level, rng)
    template = rng.choice(_TEMPLATES[level])
    expr = _EXPRESSIONS[level].format(**nums)
    value = eval(expr, {"__builtins__": {}})  # our own integer expression, never model output
    return Problem(id=f"arith-L{level}-s{seed}-{index}", question=template.format(**nums), answer=str(value),
                   program=f"print({expr})", level=level,
                   meta={"expression": expr, "numbers": nums, "kind": _TAUGHT_NAMES[level], "taught": True})


def kind_problem(seed: int, kind: str, index: int, twins: bool = False) -> Problem:
    """Problem `index` of the stream (seed, kind). A taught kind's problems are its level's
    (arithmetic_problem), so naming the taught kinds changes no problem. `twins`: gain and loss
    (group verbs) draw from one random stream, so problem `index` of gain and of loss is the same
    scene with the same numbers (their scenes are listed in the same order and their numbers drawn alike)."""
    k = KINDS[kind]
    if k.taught:
        return arithmetic_problem(seed, k.level, index)
    rng = random.Random(f"arith:{seed}:{'free' if twins and kind in KIND_GROUPS['verbs'] else kind}:{index}")
    nums = k.numbers(rng)
    template = rng.choice(k.templates)
    expr = k.expression.format(**nums)
    value = eval(expr, {"__builtins__": {}})  # our own integer expression, never model output
    shown = {n: f"{v:,}" for n, v in nums.items()} if k.commas else nums
    return Problem(id=f"arith-{kind}-s{seed}-{index}", question=template.format(**shown), answer=str(value),
                   program=f"print({expr})", level=k.level,
                   meta={"expression": expr, "numbers": nums, "kind": kind, "taught": False,
                         **({"commas": True} if k.commas else {})})


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


def kinds_stream(seed: int, kinds: Sequence[str], twins: bool = False) -> Iterator[Problem]:
    """The kinds in turn, each its own stream (a kind listed twice comes twice as often, never with
    the same problem twice). The taught kinds of levels 1..top are mixed_stream(seed, top) exactly.
    `twins` (data.twin_free_kinds): gain's and loss's problem i are twins (kind_problem)."""
    drawn: dict[str, int] = {}
    for kind in itertools.cycle(kinds):
        i = drawn.get(kind, 0)
        drawn[kind] = i + 1
        yield kind_problem(seed, kind, i, twins)


def kinds_at(kinds: Sequence[str], levels, what: str) -> list[str]:
    """The kinds (in order) whose level is one of `levels`; DataError when none is."""
    levels = set(levels)
    out = [k for k in kinds if KINDS[k].level in levels]
    if not out:
        raise DataError(f"{what}: none of the kinds {', '.join(dict.fromkeys(kinds))} is at level "
                        f"{' or '.join(map(str, sorted(levels)))}")
    return out


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
# teacher.quote_cue: the words of the question that say whether the last number is added or taken away
_CUE = [
    'The question says "{clause}", so {n} {how}.',
    'It says "{clause}": {n} {how}.',
    '"{clause}" means that {n} {how}.',
]
_HOW = {"+": "is added", "-": "is taken away"}


def expression_in_words(expr: str) -> str:
    """'148 * 36 - 2915' -> '148 times 36, minus 2915': the plan a teacher states before coding."""
    out = []
    for tok in expr.replace("(", "( ").replace(")", " )").split():
        if tok in ("+", "-") and out:
            out[-1] += ","
        out.append(_WORDS.get(tok, tok))
    return " ".join(out).replace("( ", "(").replace(" )", ")").replace(",)", ")")


def cue_clause(problem: Problem) -> tuple[str, str, str] | None:
    """(clause, number, op) for a problem whose expression ends in "+ n" or "- n": the clause of the
    question around n's last mention ("sells 2915 rolls"), from the previous ". ", ", " or " and " to the
    next comma, full stop or question mark. None when the last operand is not a number in the question."""
    m = re.search(r"([+-]) (\d+)$", problem.meta.get("expression", ""))
    hits = list(re.finditer(rf"(?<!\d){m.group(2)}(?!\d)", problem.question)) if m else []
    if not hits:
        return None
    q, at = problem.question, hits[-1].start()
    start = max((i + len(sep) for sep in (". ", ", ", " and ") if (i := q.rfind(sep, 0, at)) >= 0), default=0)
    end = min((i for sep in (",", ".", "?") if (i := q.find(sep, at)) >= 0), default=len(q))
    return q[start:end], m.group(2), m.group(1)


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


def teacher_trace(problem: Problem, rng: random.Random, quote_cue: bool = False) -> TeacherTrace | None:
    """The ideal tool trace: plan (with quote_cue, after the question's words that decide the last
    operation), program, stop marker; after the executor's output, the conclusion and the boxed
    answer. None for a problem the generator did not make."""
    if problem.program is None or "expression" not in problem.meta:
        return None
    code = teacher_program(problem, rng)
    plan = rng.choice(_PLAN).format(words=expression_in_words(problem.meta["expression"]))
    if quote_cue and (cue := cue_clause(problem)):
        clause, n, op = cue
        plan = f"{rng.choice(_CUE).format(clause=clause, n=n, how=_HOW[op])} {plan}"
    head = f"{plan} {rng.choice(_REASONING)}\n<program>\n```python\n{code}\n```\n</program>\n{STOP_MARKER}"

    def conclusion(n: str) -> str:  # drawn only once the program has run, as the teacher always did
        return f"{rng.choice(_CONCLUSION).format(n=n)}\n</think>\n<answer>\n\\boxed{{{n}}}\n</answer>"

    return TeacherTrace(head, program=code, expect=problem.answer, conclusion=conclusion)


# ---------------------------------------------------------------------------------------------
# The family

class ArithmeticTask(Task):
    """`data.source: arithmetic`; held out `arithmetic[:LEVEL or LO-HI][@KINDS]`: the kinds at those
    levels in turn. KINDS: kind names or the groups taught, free, all, verbs and commas, joined with
    commas; without it the taught kinds (one per level), and `arithmetic:@KINDS` takes those kinds at
    every level."""

    name = "arithmetic"
    curriculum = True

    def _kinds(self, data: DataConfig) -> list[str] | None:
        """data.kinds expanded; None when unset (the taught kinds: the stream as it always was)."""
        return None if data.kinds is None else kind_names(data.kinds, "data.kinds")

    def problems(self, data: DataConfig, n: int | None = None, seed: int | None = None) -> list[Problem]:
        seed = data.seed if seed is None else seed
        kinds = self._kinds(data)
        if kinds is None:
            return arithmetic_problems(n or 64, seed=seed, level=data.level)
        return list(itertools.islice(kinds_stream(seed, kinds_at(kinds, [data.level], "data.kinds")), n or 64))

    def stream(self, data: DataConfig, offset: int, level: int | None = None) -> Iterator[Problem]:
        seed, level = data.seed * 100_003 + offset, level or data.level
        kinds = self._kinds(data)
        if data.twin_free_kinds and not {"gain", "loss"} <= set(kinds or ()):
            raise DataError("data.twin_free_kinds pairs gain and loss problems: data.kinds must name both "
                            "(e.g. [taught, verbs, verbs])")
        if kinds is None:
            return mixed_stream(seed, level) if data.mix_levels else arithmetic_stream(seed=seed, level=level)
        # every level the curriculum can reach must have a kind, checked now rather than at a promotion
        for lv in range(data.level, data.max_level + 1):
            kinds_at(kinds, range(1, lv + 1) if data.mix_levels else [lv], f"data.kinds at level {lv}")
        return kinds_stream(seed, kinds_at(kinds, range(1, level + 1) if data.mix_levels else [level], "data.kinds"),
                            data.twin_free_kinds)

    def heldout(self, arg: str, n: int, seed: int, data: DataConfig) -> list[Problem]:
        task = f"{self.name}:{arg}" if arg else self.name
        arg, at, kind_arg = arg.partition("@")
        lo, _, hi = arg.partition("-")
        try:  # no level: data.level's kind, or with @KINDS those kinds at every level
            levels = range(int(lo), int(hi or lo) + 1) if lo else LEVELS if at else [data.level]
        except ValueError:
            raise DataError(f"task {task!r}: use arithmetic, arithmetic:LEVEL or arithmetic:LO-HI, "
                            "optionally followed by @KINDS (e.g. arithmetic:1-3@free)") from None
        if not levels:
            raise DataError(f"task {task!r}: empty level range")
        if not at:  # the taught kinds, one per level: the held-out set as it always was
            # problem i of level L is the same whatever n is, so a smaller eval is a prefix of a larger one
            return [arithmetic_problem(seed, levels[i % len(levels)], i // len(levels)) for i in range(n)]
        kinds = kinds_at(list(dict.fromkeys(kind_names([k for k in kind_arg.split(",") if k], f"task {task!r}"))),
                         levels, f"task {task!r}")
        return [kind_problem(seed, kinds[i % len(kinds)], i // len(kinds)) for i in range(n)]

    def teacher(self, cfg: TeacherConfig) -> Teacher:
        """Traces for the kinds in teacher.kinds (default: the taught ones); for any other kind None,
        so a teacher-free kind's group gets no teacher sample."""
        taught = frozenset(TAUGHT_KINDS if cfg.kinds is None else kind_names(cfg.kinds, "teacher.kinds"))

        def teach(problem: Problem, rng: random.Random) -> TeacherTrace | None:
            if problem.meta.get("kind") not in taught:
                return None
            return teacher_trace(problem, rng, cfg.quote_cue)
        return teach
