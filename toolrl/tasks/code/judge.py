"""Test-execution rewards for code tasks: extract the program, run it with the task's tests in the
executor service, count what passed.

A task's tests are a `TestSpec` (JSON, carried as the problem's `answer`):
- `assert`: Python test snippets (MBPP's `assert f(1) == 2`, HumanEval's asserts) run in the
  program's namespace; `entry_point` names the function HumanEval's tests call `candidate`.
- `stdio`: APPS-style inputs fed on stdin; the program's stdout is compared with the outputs here.
- `call`: APPS call-based tasks: `fn_name(*inputs[i])`, its return value compared here.

Why the result cannot be faked. The program and its tests run in one sandboxed execution under a
harness that reports each result on a line that starts with a fresh random nonce. The nonce
arrives on stdin and the harness closes stdin before the program runs, so the program cannot
print a valid report: not by `sys.exit(0)` before the tests (no report: nothing passed), not by
printing "PASSED" lines, not by patching the checker or builtins (they are restored around every
call into the program, and reports are encoded by the harness's own encoder onto its own copy of
fd 1), not by an object whose `__eq__` or `__bool__` always agrees (the program's functions must
return plain data, and every value a test compares, negates or asserts is checked to be plain data
whatever made it: a class, a callable instance, a partial), not by its own `set`, `abs` or
`math` (the tests see the real builtins and modules; the function under test keeps its name), not
by a thread or a signal handler that patches things between the harness's steps (a thread left
running refuses the run; handlers and interval timers are reset), and not by catching a test's
exception (the harness runs each test). For `stdio` and `call` tasks the expected outputs never
enter the sandbox at all. For `assert` tasks, whose tests hold the expected values, the program
runs in a fresh interpreter of its own (toolrl.tasks.code.companion): the tests and the nonce come
on the harness's stdin, never in the code, and the program's process holds no descriptor of the
executor's output and cannot read the harness's memory, so walking frames, `gc.get_objects()` or
/proc finds neither. The tests call into it and get plain data back, or handles to its objects.
tests/tasks/code/test_code_rewards.py lists every attack that is checked.
"""
from __future__ import annotations

import ast
import inspect
import json
import math
import re
import secrets
from dataclasses import asdict, dataclass, field
from typing import Literal

from toolrl.config import ExecutorConfig
from toolrl.executor.api import ExecRequest, ExecResult
from toolrl.executor.client import ExecutorError
from toolrl.executor.forkserver.capture import MARKER
from toolrl.format import extract_code
from toolrl.tasks.code.companion import _toolrl_codec, _toolrl_companion
from toolrl.tasks.code.harness import _toolrl_digest, _toolrl_harness, _toolrl_value_json

# ---------------------------------------------------------------------------------------------
# The tests of one task


@dataclass
class TestSpec:
    __test__ = False  # not a pytest class
    kind: Literal["assert", "stdio", "call"]
    tests: list[str] = field(default_factory=list)  # assert: one snippet per test
    setup: str = ""  # assert: run once by the tests, after the program (HumanEval's check, MBPP's test_imports)
    # assert: run in the program's own process right after it (MBPP's test_setup_code), so that what
    # it builds (a tree of its own Node class) is the program's to take; the harness runs it too, and
    # the tests get all it binds but its own classes and their objects from that run. The program
    # can read it: it must hold no expected value.
    program_setup: str = ""
    entry_point: str | None = None  # assert: bound to `candidate` (HumanEval)
    inputs: list = field(default_factory=list)  # stdio: stdin texts; call: argument lists
    outputs: list = field(default_factory=list)  # stdio: expected stdout; call: return values
    fn_name: str | None = None  # call
    code_prompt: str = ""  # HumanEval: the signature and docstring a body-only completion continues

    def __post_init__(self):
        if self.kind not in ("assert", "stdio", "call"):
            raise ValueError(f"unknown test kind {self.kind!r}")
        if self.kind == "assert" and not self.tests:
            raise ValueError("an assert task needs at least one test")
        if self.kind in ("stdio", "call"):
            if not self.inputs or len(self.inputs) != len(self.outputs):
                raise ValueError(f"{self.kind} task: inputs and outputs must be non-empty and of equal length")
        if self.kind == "call" and not self.fn_name:
            raise ValueError("a call task needs fn_name")

    @property
    def total(self) -> int:
        return len(self.tests) if self.kind == "assert" else len(self.inputs)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TestSpec":
        return cls(**json.loads(text))


# ---------------------------------------------------------------------------------------------
# Extraction

def syntax_ok(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# The harness (toolrl.tasks.code.harness runs inside the executor)

# Standard modules the tests may use without importing them (the reference solution did): the
# tests always get the real one, never what the program bound to its name
TEST_MODULES = ("math", "cmath", "re", "collections", "itertools", "functools", "operator", "heapq", "bisect",
                "string", "statistics", "decimal", "fractions", "copy", "json", "random", "typing", "datetime",
                "array")

# How long the program's own process (assert tasks) may take to start, not counted in its time: a
# fresh interpreter starts in ~20 ms, but on a loaded host with a slow disk it took seconds
COMPANION_BOOT_S = 20.0

# what the executor runs: these functions alone; the companion is what the harness starts for the program
HARNESS = "\n\n".join(inspect.getsource(f) for f in (_toolrl_digest, _toolrl_value_json, _toolrl_codec,
                                                      _toolrl_harness))
COMPANION = ("\n\n".join(inspect.getsource(f) for f in (_toolrl_codec, _toolrl_companion))
             + "\n_toolrl_companion(3, 4)\n")


def build_harness(program: str, spec: TestSpec, per_test_timeout_s: float, nonce: str) -> tuple[str, str]:
    """What is sent to the executor: the code (the harness, then its call with the program) and the
    stdin (the nonce's line, then the tests). The tests never appear in the code, which the program's
    process could read. Expected outputs of stdio/call tasks are left out: they stay on this side."""
    inner = {"kind": spec.kind, "per_test_timeout_s": per_test_timeout_s}
    if spec.kind == "assert":
        inner.update(tests=spec.tests, setup=spec.setup, program_setup=spec.program_setup,
                     entry_point=spec.entry_point, prompt=spec.code_prompt, modules=TEST_MODULES,
                     boot_timeout_s=COMPANION_BOOT_S)
    else:
        inner.update(inputs=spec.inputs, fn_name=spec.fn_name)
    code = f"{HARNESS}\n\n{_toolrl_harness.__name__}({program!r}, {COMPANION!r})\n"
    return code, nonce + "\n" + json.dumps(inner)


# ---------------------------------------------------------------------------------------------
# Judging what came back


@dataclass
class TestResult:
    passed: int
    total: int
    status: str  # the executor's status for the whole run
    detail: str = ""  # why nothing passed, when something broke early

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def reward(self, mode: Literal["fraction", "all"] = "fraction") -> float:
        if mode == "all":
            return 1.0 if self.total and self.passed == self.total else 0.0
        return self.fraction


def _norm_stdout(text: str) -> str:
    return "\n".join(ln.rstrip() for ln in str(text).strip().splitlines())


_digest = _toolrl_digest  # the harness's encoding of an output: the same function on both sides


def _tokens_close(got: str, want: str) -> bool:
    """Token by token, numbers equal within 1e-6 (APPS checkers accept float noise). Only finite
    numbers: "nan" is no closer to 7 than any other word (abs(nan - 7) > 1e-6 is False)."""
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x != y:
            try:
                fx, fy = float(x), float(y)
            except ValueError:
                return False
            if not (math.isfinite(fx) and math.isfinite(fy)) or abs(fx - fy) > 1e-6:
                return False
    return True


def _stdout_matches(payload, want) -> bool:
    want = _norm_stdout(want)
    if isinstance(payload, dict):  # sent as its canonical hash: against want's, whatever want's length
        return payload == _digest(want, whole=True)
    return isinstance(payload, str) and (payload == want or _tokens_close(payload, want))


def _value_matches(payload, want) -> bool:
    """A returned value against the expected one: by value, as APPS's own grader compares them
    (2 == 2.0, True == 1; found in review: the JSON texts were compared), or, for a long value the
    harness sent as a hash, by its canonical JSON."""
    # APPS call-based outputs are usually wrapped in a one-element list
    options = [json.loads(json.dumps(w, default=list)) for w in
               [want] + ([want[0]] if isinstance(want, list) and len(want) == 1 else [])]
    if isinstance(payload, str):
        try:
            got = json.loads(payload)
        except ValueError:
            return False
        return any(_same(got, w) for w in options)
    return any(payload == _digest(_toolrl_value_json(w), whole=True) for w in options)


def _same(got, want) -> bool:
    """Python's == on JSON values, except that NaN (which the harness's JSON may carry) equals nothing."""
    if isinstance(got, float) and got != got:
        return False
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in got)
    return got == want


class HarnessFailed(ExecutorError):
    """The harness could not start the program's own process (toolrl.tasks.code.companion): the
    sandbox's failure, not the program's, so the sample is unscored, never 0."""


class ReportsCut(ExecutorError):
    """The executor's output cap (executor.max_output_bytes, head and tail kept) cut the reports of
    a run with many tests: what passed is unknown, so the sample is unscored, never 0."""


def judge(stdout: str, status: str, nonce: str, spec: TestSpec, truncated: bool = False) -> TestResult:
    """Count passes from the harness's nonce lines. A test reported twice means the output was
    tampered with: nothing passes. A nonce line that does not parse was cut by the output cap;
    with the reports cut there and tests unreported, ReportsCut."""
    seen: dict[int, tuple[bool, object]] = {}
    detail = ""
    for line in stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue
        try:
            i, ok, payload = json.loads(line[len(nonce) + 1:])
        except (ValueError, TypeError):
            continue  # cut by the executor's output limit; only the harness knows the nonce
        if i == -1:
            # The harness's own failure comes as {"infra": why}: a shape no program-chosen name can take
            if isinstance(payload, dict) and isinstance(payload.get("infra"), str):
                raise HarnessFailed(f"the test harness could not run the program: {payload['infra']}")
            detail = str(payload)
            continue
        if not isinstance(i, int) or not 0 <= i < spec.total or i in seen:
            return TestResult(0, spec.total, status, "duplicate or unknown test index")
        seen[i] = (bool(ok), payload)
    passed = 0
    for i, (ok, payload) in seen.items():
        if not ok:
            continue
        if spec.kind == "assert":
            passed += 1
        elif spec.kind == "stdio":
            passed += _stdout_matches(payload, spec.outputs[i])
        else:
            passed += _value_matches(payload, spec.outputs[i])
    if truncated and len(seen) < spec.total and not detail and _reports_cut(stdout, nonce):
        raise ReportsCut(f"the executor's output cap cut the reports of {spec.total - len(seen)} of {spec.total} "
                         "tests: raise executor.max_output_bytes for tasks with this many tests")
    if not seen and not detail:
        detail = f"no test ran (executor status {status})"
    return TestResult(passed, spec.total, status, detail)


def _reports_cut(stdout: str, nonce: str) -> bool:
    """Whether the output cap cut a stream of reports alone: its mark is in stdout (a flood of
    stderr cuts no report), and every whole line beside it is a report. A program that wrote into
    the report stream itself (guessing its fd) answers for the reports it crowded out: they count
    as failed, and its group's other samples keep their scores (found in review: one such sample
    left its whole group unscored)."""
    head, mark, rest = stdout.partition(MARKER.partition("{")[0])
    if not mark:
        return False
    whole = head.split("\n")[:-1] + rest.partition("\n")[2].split("\n")[1:]  # the cut lines dropped
    return all(not line or line.startswith(nonce + " ") for line in whole)


def complete_program(code: str | None, spec: TestSpec) -> str | None:
    """For HumanEval, a completion that only continues the prompt (no `def entry_point`) is
    appended to the prompt, as the benchmark intends."""
    entry = spec.entry_point
    if code is not None and entry and spec.code_prompt and not re.search(rf"^\s*def {re.escape(entry)}\b", code, re.M):
        return spec.code_prompt + code
    return code


def program_in(completion: str, spec: TestSpec) -> str | None:
    """The program to test from a model's completion: extracted, then completed for HumanEval."""
    return complete_program(extract_code(completion), spec)


def new_nonce() -> str:
    return "TOOLRL-" + secrets.token_hex(16)


# ---------------------------------------------------------------------------------------------
# Running through the executor service


def _requests(programs: list[str | None], specs: list[TestSpec], per_test_timeout_s: float,
              max_timeout_s: float):
    todo, results = [], []
    for program, spec in zip(programs, specs, strict=True):
        if program is None:
            results.append(TestResult(0, spec.total, "no_code", "no code found"))
        elif not syntax_ok(program):
            results.append(TestResult(0, spec.total, "syntax", "the code does not parse"))
        else:
            nonce = new_nonce()
            budget = min(max_timeout_s, per_test_timeout_s * (spec.total + 1) + 1.0
                         + (COMPANION_BOOT_S if spec.kind == "assert" else 0.0))
            code, stdin = build_harness(program, spec, per_test_timeout_s, nonce)
            todo.append((len(results), spec, nonce, ExecRequest(code=code, timeout_s=budget, stdin=stdin)))
            results.append(None)
    return todo, results


def _chunks(todo: list, max_items: int = 32, max_bytes: int = 512 << 10):
    """Batches under the executor's request-size cap (1 MiB by default) and its queue."""
    chunk, size = [], 0
    for t in todo:
        n = len(t[3].code) + len(t[3].stdin or "")
        if chunk and (len(chunk) >= max_items or size + n > max_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(t)
        size += n
    if chunk:
        yield chunk


# A run's whole budget is at most the executor's longest request (executor.max_timeout_s): the same for
# the rewards, teacher traces and `evaluate.py score`, each of which passes its config's value
MAX_TIMEOUT_S = ExecutorConfig.model_fields["max_timeout_s"].default


def run_tests(client, programs: list[str | None], specs: list[TestSpec], per_test_timeout_s: float = 2.0,
              max_timeout_s: float = MAX_TIMEOUT_S) -> list[TestResult]:
    """Run each program with its tests, one executor batch for all; results in input order."""
    todo, results = _requests(programs, specs, per_test_timeout_s, max_timeout_s)
    for chunk in _chunks(todo):
        _judge_chunk(chunk, client.execute_batch([t[3] for t in chunk]), results)
    return results


async def arun_tests(client, programs: list[str | None], specs: list[TestSpec], per_test_timeout_s: float = 2.0,
                     max_timeout_s: float = MAX_TIMEOUT_S) -> list[TestResult]:
    todo, results = _requests(programs, specs, per_test_timeout_s, max_timeout_s)
    for chunk in _chunks(todo):
        _judge_chunk(chunk, await client.execute_batch([t[3] for t in chunk]), results)
    return results


def _judge_chunk(chunk: list, outs: list[ExecResult], results: list) -> None:
    """A run the executor itself spoiled (executor_fault: a runner that could not start, a full
    queue) says nothing of the program: ExecutorError, which callers count as unscored, never 0."""
    for (idx, spec, nonce, _), out in zip(chunk, outs, strict=True):
        if out.executor_fault:
            raise ExecutorError(f"the executor could not run the tests: {out.stderr.strip()[:300]}")
        results[idx] = judge(out.stdout, out.status, nonce, spec, out.truncated)
