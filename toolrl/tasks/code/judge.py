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
call into the program), not by returning an object whose `__eq__` always agrees (return values
must be plain data), and not by catching a test's exception (the harness runs each test). For
`stdio` and `call` tasks the expected outputs never enter the sandbox at all. Out of scope: a
program that walks the interpreter's frames or memory to find the nonce.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
import secrets
from dataclasses import asdict, dataclass, field
from typing import Literal

from toolrl.format import extract_code

# ---------------------------------------------------------------------------------------------
# The tests of one task


@dataclass
class TestSpec:
    __test__ = False  # not a pytest class
    kind: Literal["assert", "stdio", "call"]
    tests: list[str] = field(default_factory=list)  # assert: one snippet per test
    setup: str = ""  # assert: run once after the program (MBPP's test_setup_code)
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
# The harness (runs inside the executor)

HARNESS = r'''
def _toolrl_harness(program, spec):
    import builtins, hashlib, io, json, os, signal, sys
    write, exit_, read, settrace, setprofile = os.write, os._exit, os.read, sys.settrace, sys.setprofile
    nonce = read(0, 256).decode().strip()
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again: input() sees EOF, never the nonce
    import collections, decimal, fractions
    names = ("builtins", "math", "cmath", "re", "collections", "itertools", "functools", "operator", "heapq",
             "bisect", "string", "statistics", "decimal", "fractions", "copy", "json", "random", "io", "os",
             "signal", "typing")
    snap = [(n, sys.modules[n], dict(sys.modules[n].__dict__)) for n in names if n in sys.modules]
    extra = (collections.Counter, collections.OrderedDict, collections.defaultdict, collections.deque,
             fractions.Fraction, decimal.Decimal)
    cls_snap = [(c, dict(c.__dict__)) for c in extra]
    plain_types = {int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset,
                   range, *extra}
    saved_stdout, saved_stderr = sys.stdout, sys.stderr

    def restore():
        settrace(None)
        setprofile(None)
        for n, m, d in snap:
            sys.modules[n] = m
            md = m.__dict__
            for k in [k for k in md if k not in d]:
                del md[k]
            for k, v in d.items():
                if md.get(k, d) is not v:
                    md[k] = v
        for c, d in cls_snap:
            for k in [k for k in c.__dict__ if k not in d]:
                try:
                    delattr(c, k)
                except (AttributeError, TypeError):
                    pass
            for k, v in d.items():
                if c.__dict__.get(k, d) is not v:
                    try:
                        setattr(c, k, v)
                    except (AttributeError, TypeError):
                        pass

    def plain(v, budget):
        budget[0] += 1
        if budget[0] > 1_000_000 or type(v) not in plain_types:
            return False
        if type(v) in (list, tuple, set, frozenset, collections.deque):
            return all(plain(x, budget) for x in v)
        if isinstance(v, dict):
            return all(plain(k, budget) and plain(x, budget) for k, x in v.items())
        return True

    class NotPlain(Exception):
        pass

    depth = [0]

    def guard(fn):
        def call(*a, **k):
            if depth[0]:  # a call from the program to itself: checked when the outer call returns
                return fn(*a, **k)
            depth[0] += 1
            try:
                out = fn(*a, **k)
            finally:
                depth[0] -= 1
                restore()
            if not plain(out, [0]):
                raise NotPlain(f"{getattr(fn, '__name__', 'function')} returned {type(out).__name__}, not plain data")
            return out
        return call

    class Timeout(BaseException):
        pass

    def on_alarm(signum, frame):
        raise Timeout()

    def digest(text):  # long outputs travel as a hash, so the executor's output cap cuts nothing
        return text if len(text) <= 200 else {"sha256": hashlib.sha256(text.encode()).hexdigest()}

    def report(i, ok, payload=None):
        line = json.dumps([i, ok, payload])
        write(1, ("\n" + nonce + " " + line + "\n").encode())

    def run(code, ns, timeout):
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            exec(code, ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            restore()

    timeout = spec["per_test_timeout_s"]
    try:
        compiled = compile(program, "<program>", "exec", dont_inherit=True, optimize=0)
    except BaseException:
        report(-1, False, "syntax")
        exit_(0)
    if spec["kind"] == "assert":
        ns = {"__name__": "__main__", "__builtins__": builtins}
        sys.stdout = sys.stderr = io.StringIO()
        try:
            run(compiled, ns, timeout)
            if spec.get("setup"):
                run(compile(spec["setup"], "<setup>", "exec", dont_inherit=True, optimize=0), ns, timeout)
        except BaseException as exc:  # SystemExit included: a program that exits defines nothing more
            report(-1, False, type(exc).__name__)
            exit_(0)
        for k, v in list(ns.items()):
            if callable(v) and getattr(getattr(v, "__code__", None), "co_filename", None) == "<program>":
                ns[k] = guard(v)
        if spec.get("entry_point"):
            if spec["entry_point"] not in ns:
                report(-1, False, "no " + spec["entry_point"])
                exit_(0)
            ns["candidate"] = ns[spec["entry_point"]]
        for i, test in enumerate(spec["tests"]):
            try:
                run(compile(test, "<test>", "exec", dont_inherit=True, optimize=0), dict(ns), timeout)
                report(i, True)
            except BaseException as exc:
                report(i, False, type(exc).__name__)
    elif spec["kind"] == "stdio":
        for i, text in enumerate(spec["inputs"]):
            # real text streams over bytes, so sys.stdin.buffer / sys.stdout.buffer work as in a script
            raw = io.BytesIO()
            out = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", write_through=True)
            sys.stdin = io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8")
            sys.stdout, sys.stderr = out, io.StringIO()
            try:
                run(compiled, {"__name__": "__main__", "__builtins__": builtins}, timeout)
                ok = True
            except SystemExit as exc:
                ok = exc.code in (None, 0)
            except BaseException:
                ok = False
            try:
                out.flush()
            except BaseException:
                pass
            printed = raw.getvalue().decode("utf-8", "replace")
            text = "\n".join(ln.rstrip() for ln in printed.strip().splitlines())
            report(i, ok, digest(text) if ok else None)
    else:
        ns = {"__name__": "__main__", "__builtins__": builtins}
        sys.stdout = sys.stderr = io.StringIO()
        try:
            run(compiled, ns, timeout)
            if spec["fn_name"] in ns:
                fn = ns[spec["fn_name"]]
            else:  # LeetCode-style: a method of class Solution
                fn = getattr(ns["Solution"](), spec["fn_name"])
        except BaseException as exc:
            report(-1, False, type(exc).__name__)
            exit_(0)
        fn = guard(fn)
        for i, args in enumerate(spec["inputs"]):
            ns2 = dict(ns, _fn=fn, _args=args, _out=None)
            try:
                run(compile("_out = _fn(*_args)", "<test>", "exec"), ns2, timeout)
                report(i, True, digest(json.dumps(json.loads(json.dumps(ns2["_out"], default=list)), sort_keys=True)))
            except BaseException as exc:
                report(i, False, type(exc).__name__)
    sys.stdout, sys.stderr = saved_stdout, saved_stderr
    exit_(0)
'''


def build_harness(program: str, spec: TestSpec, per_test_timeout_s: float) -> str:
    """The code sent to the executor: the harness, then the call with the program and the tests.
    Expected outputs of stdio/call tasks are left out: they stay on this side."""
    inner = {"kind": spec.kind, "per_test_timeout_s": per_test_timeout_s}
    if spec.kind == "assert":
        inner.update(tests=spec.tests, setup=spec.setup, entry_point=spec.entry_point)
    else:
        inner.update(inputs=spec.inputs, fn_name=spec.fn_name)
    return f"{HARNESS}\n_toolrl_harness({program!r}, {inner!r})\n"


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


def _digest(text: str):
    """The harness's encoding of an output (kept in step with `digest` in HARNESS)."""
    return text if len(text) <= 200 else {"sha256": hashlib.sha256(text.encode()).hexdigest()}


def _tokens_close(got: str, want: str) -> bool:
    """Token by token, numbers equal within 1e-6 (APPS checkers accept float noise)."""
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x != y:
            try:
                if abs(float(x) - float(y)) > 1e-6:
                    return False
            except ValueError:
                return False
    return True


def _stdout_matches(payload, want) -> bool:
    want = _norm_stdout(want)
    if payload == _digest(want):
        return True
    return isinstance(payload, str) and _tokens_close(payload, want)


def _value_matches(payload, want) -> bool:
    # APPS call-based outputs are usually wrapped in a one-element list
    options = [want] + ([want[0]] if isinstance(want, list) and len(want) == 1 else [])
    return any(payload == _digest(json.dumps(json.loads(json.dumps(w, default=list)), default=list, sort_keys=True))
               for w in options)


def judge(stdout: str, status: str, nonce: str, spec: TestSpec) -> TestResult:
    """Count passes from the harness's nonce lines. A test reported twice means the output was
    tampered with: nothing passes. A nonce line that does not parse was cut by the output cap."""
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
    if not seen and not detail:
        detail = f"no test ran (executor status {status})"
    return TestResult(passed, spec.total, status, detail)


def is_spec(answer: str) -> bool:
    """A code task's answer (a TestSpec as JSON), as opposed to a math answer."""
    return answer.startswith('{"kind": ')


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
    from toolrl.executor.api import ExecRequest

    todo, results = [], []
    for program, spec in zip(programs, specs, strict=True):
        if program is None:
            results.append(TestResult(0, spec.total, "no_code", "no code found"))
        elif not syntax_ok(program):
            results.append(TestResult(0, spec.total, "syntax", "the code does not parse"))
        else:
            nonce = new_nonce()
            budget = min(max_timeout_s, per_test_timeout_s * (spec.total + 1) + 1.0)
            todo.append((len(results), spec, nonce,
                         ExecRequest(code=build_harness(program, spec, per_test_timeout_s), timeout_s=budget,
                                     stdin=nonce + "\n")))
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


def run_tests(client, programs: list[str | None], specs: list[TestSpec], per_test_timeout_s: float = 2.0,
              max_timeout_s: float = 10.0) -> list[TestResult]:
    """Run each program with its tests, one executor batch for all; results in input order."""
    todo, results = _requests(programs, specs, per_test_timeout_s, max_timeout_s)
    for chunk in _chunks(todo):
        outs = client.execute_batch([t[3] for t in chunk])
        for (idx, spec, nonce, _), out in zip(chunk, outs):
            results[idx] = judge(out.stdout, out.status, nonce, spec)
    return results


async def arun_tests(client, programs: list[str | None], specs: list[TestSpec], per_test_timeout_s: float = 2.0,
                     max_timeout_s: float = 10.0) -> list[TestResult]:
    todo, results = _requests(programs, specs, per_test_timeout_s, max_timeout_s)
    for chunk in _chunks(todo):
        outs = await client.execute_batch([t[3] for t in chunk])
        for (idx, spec, nonce, _), out in zip(chunk, outs):
            results[idx] = judge(out.stdout, out.status, nonce, spec)
    return results
