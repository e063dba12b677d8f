"""Problems: file/hub loaders and the built-in arithmetic word-problem generator.

Every loader returns `Problem`s. A loader reads a local file when `path` is one; otherwise it
treats `path` as a hub dataset id (`org/name` or `org/name:config`) and goes through `datasets`,
which needs the network.
"""
from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from toolrl.format import last_boxed


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str  # the ground truth, as text math-verify can parse
    program: str | None = None  # the exact Python that computes the answer, where known (the teacher uses it)
    level: int | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


class DataError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# Reading rows

def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object")
            rows.append(row)
    return rows


def read_rows(path: str, split: str = "train") -> list[dict]:
    """Rows from a local .jsonl/.jsonl.gz/.json file, or from a hub dataset via `datasets`."""
    local = Path(path).expanduser()
    if local.is_file():
        if local.suffix == ".json":
            data = json.loads(local.read_text())
            if not isinstance(data, list):
                raise DataError(f"{local}: expected a JSON list of objects")
            return data
        return _read_jsonl(local)
    if local.exists() or path.startswith((".", "/", "~")):
        raise DataError(f"{path}: not a readable data file")
    repo, _, config = path.partition(":")
    try:
        import datasets

        ds = datasets.load_dataset(repo, config or None, split=split)
    except Exception as exc:  # offline, unknown id, bad split: one clear line
        raise DataError(f"could not load hub dataset {path!r} split {split!r}: {type(exc).__name__}: {exc}") from None
    return [dict(r) for r in ds]


def _field(row: dict, name: str, where: str) -> Any:
    if name not in row:
        raise DataError(f"{where}: missing field {name!r} (has {', '.join(sorted(row))})")
    return row[name]


def gsm8k_answer(solution: str) -> str | None:
    """GSM8K keeps the final answer after '####'; commas are thousands separators."""
    if "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def load_gsm8k(path: str, split: str = "train") -> list[Problem]:
    out = []
    for i, row in enumerate(read_rows(path, split)):
        answer = gsm8k_answer(str(_field(row, "answer", f"{path} row {i}")))
        if answer is None:
            raise DataError(f"{path} row {i}: GSM8K answer has no '####' final answer")
        out.append(Problem(id=str(row.get("id", f"gsm8k-{i}")), question=_field(row, "question", path), answer=answer))
    return out


def load_math(path: str, split: str = "train") -> list[Problem]:
    out = []
    for i, row in enumerate(read_rows(path, split)):
        where = f"{path} row {i}"
        answer = row.get("answer")
        if answer is None:
            answer = last_boxed(str(_field(row, "solution", where)))
        if answer is None:
            raise DataError(f"{where}: MATH solution has no \\boxed{{}} answer")
        meta = {k: row[k] for k in ("level", "type", "subject") if k in row}
        out.append(Problem(id=str(row.get("unique_id", row.get("id", f"math-{i}"))),
                           question=_field(row, "problem", where), answer=str(answer), meta=meta))
    return out


def load_jsonl(path: str, question_field: str = "question", answer_field: str = "answer",
               split: str = "train") -> list[Problem]:
    out = []
    for i, row in enumerate(read_rows(path, split)):
        where = f"{path} row {i}"
        out.append(Problem(id=str(row.get("id", f"row-{i}")), question=str(_field(row, question_field, where)),
                           answer=str(_field(row, answer_field, where))))
    return out


# ---------------------------------------------------------------------------------------------
# The built-in arithmetic word problems
#
# Numbers are large enough (3-digit products, several steps) that a 135M model cannot do them in
# its head, and every problem carries the exact program that solves it. Levels form a curriculum.

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


def load_problems(cfg, n: int | None = None, seed: int | None = None) -> list[Problem]:
    """Problems for a DataConfig. For the generator, `n` problems from `seed` (default cfg.seed)."""
    if cfg.source == "arithmetic":
        return arithmetic_problems(n or 64, seed=cfg.seed if seed is None else seed, level=cfg.level)
    if cfg.source == "code":
        from toolrl.tasks.code.loaders import load_code_task, split

        train, _ = split(load_code_task(cfg.path or "humaneval"), cfg.seed, cfg.train_fraction)
        return train[:n] if n else train
    if not cfg.path:
        raise DataError(f"data.source={cfg.source} needs data.path (a local file or a hub dataset id)")
    if cfg.source == "gsm8k":
        problems = load_gsm8k(cfg.path, cfg.split)
    elif cfg.source == "math":
        problems = load_math(cfg.path, cfg.split)
    else:
        problems = load_jsonl(cfg.path, cfg.question_field, cfg.answer_field, cfg.split)
    return problems[:n] if n else problems
