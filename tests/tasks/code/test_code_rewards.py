"""Test-execution rewards against the real executor service: honest programs score, and none of the
known ways to fake a pass does."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from toolrl.executor.client import ExecutorClient
from toolrl.executor.local import LocalExecutor
from toolrl.format import extract_code
from toolrl.tasks import DataError
from toolrl.tasks.code.judge import TestSpec, judge, new_nonce, run_tests
from toolrl.tasks.code.loaders import load_apps, load_code_task, load_humaneval, load_mbpp, program_for, split

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[3]

ADD = TestSpec("assert", tests=["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"])
GOOD = "def add(a, b):\n    return a + b\n"
HALF = "def add(a, b):\n    return a + b if a > 0 else 7\n"  # passes 2 of 3


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("executor") / "executor.log"
    with LocalExecutor(log_path=log, sets=["executor.workers=2"]) as ex:
        with ExecutorClient(ex.url, timeout_s=60) as c:
            yield c


def score(client, programs, spec, **kw):
    return [r.passed for r in run_tests(client, programs, [spec] * len(programs), **kw)]


def test_honest_programs_score_by_the_fraction_passed(client):
    res = run_tests(client, [GOOD, HALF, None, "def add(a, b) return"], [ADD] * 4)
    assert [(r.passed, r.total) for r in res] == [(3, 3), (2, 3), (0, 3), (0, 3)]
    assert res[1].reward("fraction") == pytest.approx(2 / 3) and res[1].reward("all") == 0.0
    assert res[0].reward("all") == 1.0
    assert res[2].status == "no_code" and res[3].status == "syntax"


def frame_forger(n: int) -> str:
    """Code that, run inside the harness's process, walks up to its frame and reports tests 0..n-1
    passed with its nonce and report fd: every attack that gets code into the harness ends here."""
    return ("import sys, os\nf = sys._getframe()\nwhile f is not None and 'nonce' not in f.f_locals:\n"
            "    f = f.f_back\nif f is not None:\n    n, fd = f.f_locals['nonce'], f.f_locals['report_fd']\n"
            f"    for i in range({n}):\n        os.write(fd, ('\\n%s [%d, true, null]\\n' % (n, i)).encode())\n"
            "    os._exit(0)\n")


# Reads the tests' text out of the harness's memory and answers each by lookup
PROC_ATTACK = (
    "import os, re\nT = {}\npid = os.getppid()\ntry:\n    maps = open('/proc/%d/maps' % pid).read().splitlines()\n"
    "    mem = os.open('/proc/%d/mem' % pid, os.O_RDONLY)\nexcept OSError:\n    maps = []\n"
    "for ln in maps:\n    lo, hi = (int(x, 16) for x in ln.split()[0].split('-'))\n"
    "    if 'rw' not in ln.split()[1] or hi - lo > 1 << 28:\n        continue\n"
    "    try:\n        data = os.pread(mem, hi - lo, lo)\n    except Exception:\n        continue\n"
    "    for a, b, c in re.findall(rb'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', data):\n"
    "        T[int(a), int(b)] = int(c)\ndef add(a, b):\n    return T.get((a, b), -99)\n")

ATTACKS = {
    "sys.exit(0) before the tests": "import sys\nsys.exit(0)\ndef add(a, b):\n    return -99\n",
    "os._exit(0) before the tests": "import os\nos._exit(0)\n",
    "exit inside the function": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "printing fake PASSED lines": "print('PASSED ' * 3)\nprint('3 passed')\ndef add(a, b):\n    return -99\n",
    "printing a guessed report line": (
        "import os\nfor i in range(3):\n    os.write(1, b'\\nTOOLRL-0 [%d, true, null]\\n' % i)\n"
        "def add(a, b):\n    return -99\n"),
    "reading the nonce from stdin": (
        "import sys, os, json\nn = sys.stdin.read()\n"
        "try:\n    n += os.read(0, 100).decode()\nexcept OSError:\n    pass\n"
        "for i in range(3):\n    os.write(1, ('\\n%s %s\\n' % (n.strip(), json.dumps([i, True, None]))).encode())\n"
        "os._exit(0)\n"),
    "an object that equals everything": (
        "class Any:\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return Any()\n"),
    "an int subclass that equals everything": (
        "class Any(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Any(-99)\n"),
    "patching builtins and the checker": (
        "import builtins\nbuiltins.AssertionError = type('E', (Exception,), {})\n"
        "builtins.abs = lambda x: 0\nbuiltins.print = lambda *a: None\n"
        "def add(a, b):\n    return -99\n"),
    "catching the test's exception with a hook": (
        "import sys, os, atexit\nsys.excepthook = lambda *a: os._exit(0)\natexit.register(lambda: print('PASSED'))\n"
        "def add(a, b):\n    return -99\n"),
    "a trace function that swallows the failure": (
        "import sys\ndef t(frame, event, arg):\n    return t\nsys.settrace(t)\n"
        "def add(a, b):\n    return -99\n"),
    "an infinite loop": "def add(a, b):\n    while True:\n        pass\n",
    # found in review (2026-11-29): callables that are not plain functions, json's own encoder patched,
    # a thread or a profiling timer that patches the checker between the harness's steps
    "a class named like the function": (
        "class add:\n    def __init__(self, *a):\n        pass\n    def __eq__(self, o):\n        return True\n"),
    "a callable instance": (
        "class _Y:\n    def __eq__(self, o):\n        return True\nclass _F:\n    def __call__(self, *a):\n"
        "        return _Y()\nadd = _F()\n"),
    "a functools.partial": (
        "import functools\nclass _Y:\n    def __eq__(self, o):\n        return True\n"
        "def _g(*a):\n    return _Y()\nadd = functools.partial(_g)\n"),
    "patching json's default encoder": (
        "import json\n_e = json._default_encoder\n_orig = type(_e).encode\ndef _fake(obj):\n"
        "    if isinstance(obj, list) and len(obj) == 3 and obj[1] is False:\n        obj = [obj[0], True, None]\n"
        "    return _orig(_e, obj)\n_e.encode = _fake\ndef add(a, b):\n    return -99\n"),
    "a thread that patches json between steps": (
        "import threading, json, sys\n_orig = json.dumps\ndef _fake(obj, *a, **k):\n"
        "    if isinstance(obj, list) and len(obj) == 3 and obj[1] is False:\n        obj = [obj[0], True, None]\n"
        "    return _orig(obj, *a, **k)\ndef _loop():\n    while True:\n        json.dumps = _fake\n"
        "sys.setswitchinterval(1e-6)\nthreading.Thread(target=_loop, daemon=True).start()\n"
        "def add(a, b):\n    return -99\n"),
    "a profiling timer that patches json": (
        "import signal, json\n_orig = json.dumps\ndef _fake(obj, *a, **k):\n"
        "    if isinstance(obj, list) and len(obj) == 3 and obj[1] is False:\n        obj = [obj[0], True, None]\n"
        "    return _orig(obj, *a, **k)\ndef _h(*a):\n    json.dumps = _fake\n"
        "signal.signal(signal.SIGPROF, _h)\nsignal.setitimer(signal.ITIMER_PROF, 0.00002, 0.00002)\n"
        "def add(a, b):\n    return -99\n"),
    # found in review (2026-11-29, eighth): the program ran in the harness's own process, so the
    # harness's frame gave the nonce and the report fd (every test passed), and the runner's memory
    # held the tests' text. Now it runs in a fresh interpreter of its own (companion.py).
    "the harness's frame: its nonce and report fd": frame_forger(3),
    "the tests' text from memory (gc and frames)": (
        "import gc, re, sys\nT = {}\ndef _look(text):\n"
        "    for a, b, c in re.findall(r'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', text):\n"
        "        T[int(a), int(b)] = int(c)\n"
        "for o in gc.get_objects():\n"
        "    for v in (o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()):\n"
        "        if isinstance(v, str) and 'add(' in v:\n            _look(v)\n"
        "f = sys._getframe()\nwhile f is not None:\n    for v in f.f_locals.values():\n"
        "        if isinstance(v, str):\n            _look(v)\n    f = f.f_back\n"
        "def add(a, b):\n    return T.get((a, b), -99)\n"),
    "the harness's memory through /proc": PROC_ATTACK,
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_no_attack_passes_a_test(client, attack):
    assert score(client, [ATTACKS[attack]], ADD, per_test_timeout_s=1.0) == [0]


# A program that speaks the companion's protocol itself (fd 4 answers): names of the harness's own in
# its list of names, and True for every call
SPEAKER = (
    "import os\ndef s(o):\n    b = b'r' + repr(o).encode()\n    os.write(4, len(b).to_bytes(4, 'big') + b)\n"
    "s(['ready', {NAMES}])\nwhile True:\n    h = os.read(3, 4)\n    if len(h) < 4:\n        os._exit(0)\n"
    "    n, d = int.from_bytes(h, 'big'), b''\n    while len(d) < n:\n        d += os.read(3, n - len(d))\n"
    "    s(['ok', ['B', 1]])\n")


def test_review_attacks_of_2026_11_29_eighth_pass_no_test_and_honest_twins_pass_all(client, tmp_path):
    """What the review of the companion found: a program's list of names replacing the harness's
    checker or builtins, a module the harness would import for it (unittest.__main__ runs discovery in
    the working directory), a result object whose methods agree with anything, a StopIteration that
    ends `all(map(...))` early, and exception names that would pass for the harness's own failure
    or crowd the output cap (the sample must be scored 0, never left unscored)."""
    names = ("{'__harness_checked__': ['g'], 'add': ['g']}", "{'__builtins__': ['g'], 'add': ['g']}")
    assert score(client, [SPEAKER.replace("{NAMES}", n) for n in names], ADD) == [0, 0]
    # what discovery would import, and run, in the harness
    unittest_main = (f"open('test_x.py', 'w').write({frame_forger(3)!r})\nimport types\n"
                     "m = types.ModuleType('unittest.__main__')\ndef add(a, b):\n    return -99\n")
    assert score(client, [unittest_main, GOOD], ADD) == [0, 3]
    agrees = TestSpec("assert", tests=["assert f('abc').startswith('zz')", "assert all(map(f, [1, 2]))"])
    liar = ("class S:\n    def startswith(self, x):\n        return True\n"
            "def f(x):\n    if x in (1, 2):\n        raise StopIteration\n    return S()\n")
    honest = "def f(x):\n    return 'zzz' if x == 'abc' else True\n"
    assert score(client, [liar, honest], agrees) == [0, 2]
    for name in ("infra: x", "y" * 20_000):
        raiser = f"raise type({name!r}, (Exception,), {{}})()\n"
        call = TestSpec("call", fn_name="add", inputs=[[1, 2]], outputs=[3])
        res = run_tests(client, [raiser, raiser], [ADD, call])
        assert [(r.passed, r.detail[:10]) for r in res] == [(0, name[:10])] * 2


def test_without_per_slot_uids_the_program_still_cannot_read_the_harness(tmp_path):
    """Runners that stay root (executor.disable_isolation uid) hold CAP_SYS_PTRACE: the program's
    process drops every capability before it runs, so the harness's memory stays closed."""
    with LocalExecutor(sets=['executor.disable_isolation=["uid"]'], log_path=tmp_path / "executor.log") as ex:
        with ExecutorClient(ex.url, timeout_s=60) as c:
            assert score(c, [PROC_ATTACK, GOOD], ADD) == [0, 3]


def test_patching_a_module_the_tests_use_is_undone(client):
    spec = TestSpec("assert", tests=["import math\nassert math.isclose(area(1), 3.14159, rel_tol=1e-3)",
                                     "import math\nassert area(0) == 0 and "
                                     "math.isclose(area(2), 12.566, rel_tol=1e-3)"])
    cheat = ("import math\nmath.isclose = lambda *a, **k: True\n"
             "def area(r):\n    math.isclose = lambda *a, **k: True\n    return 0\n")
    honest = "import math\ndef area(r):\n    return math.pi * r * r\n"
    assert score(client, [cheat, honest], spec) == [0, 2]


def test_a_program_cannot_answer_for_the_builtins_or_modules_the_tests_use(client):
    """`def set(...)`, `def abs(...)` or `math = ...` in the program stay the program's: the tests
    see the real ones (the function under test keeps its own name, even a builtin's)."""
    sets = TestSpec("assert", tests=["assert set(similar((3, 4, 5), (5, 4))) == set((4, 5))"])
    honest = "def similar(a, b):\n    return tuple(set(a) & set(b))\n"
    shadow = "def similar(a, b):\n    return ()\ndef set(*a):\n    return 0\n"
    assert score(client, [honest, shadow], sets) == [1, 0]
    he = TestSpec("assert", tests=["assert abs(candidate(1.0) - 0.5) < 1e-6"], entry_point="half")
    fake_abs = "def half(x):\n    return 7.0\ndef abs(x):\n    return 0\n"
    assert score(client, ["def half(x):\n    return x / 2\n", fake_abs], he) == [1, 0]
    area = TestSpec("assert", tests=["assert math.isclose(area(2), 12.566, rel_tol=0.001)"], setup="import math")
    fake_math = ("import math\ndef area(r):\n    return 0\nclass M:\n    def isclose(self, *a, **k):\n"
                 "        return True\nmath = M()\n")
    assert score(client, ["import math\ndef area(r):\n    return math.pi * r * r\n", fake_math], area) == [1, 0]
    named_max = TestSpec("assert", tests=["assert max([3, 1, 2]) == 3"], entry_point="max")
    assert score(client, ["def max(xs):\n    return sorted(xs)[-1]\n"], named_max) == [1]


def test_stdio_answers_must_be_finite_numbers_and_scripts_may_use_fds_0_and_1(client):
    spec = TestSpec("stdio", inputs=["3 4\n", "10 20\n"], outputs=["7", "30"])
    assert score(client, ["print('nan')\n", "print('inf')\n"], spec) == [0, 0]  # nan matched any number
    fd_io = "import sys\na, b = map(int, open(0).read().split())\nsys.__stdout__.write(str(a + b) + '\\n')\n"
    assert score(client, [fd_io, "a, b = map(int, input().split())\nprint(a + b)\n"], spec) == [2, 2]


def test_a_run_the_executor_spoiled_is_an_executor_error_not_a_score():
    from toolrl.executor.api import ExecResult
    from toolrl.executor.client import ExecutorError

    class Spoiled:
        def execute_batch(self, items):
            return [ExecResult(status="killed", exit_code=None, stdout="", stderr="[executor: cannot start runners]\n",
                               truncated=False, wall_ms=0, cpu_ms=0, executor_fault=True) for _ in items]
    with pytest.raises(ExecutorError, match="cannot start runners"):
        run_tests(Spoiled(), [GOOD], [ADD])


def test_humaneval_style_candidate_and_stdio_and_call_tasks(client):
    he = TestSpec("assert", tests=["assert candidate([1, 2]) == 3", "assert candidate([]) == 0"], entry_point="total")
    assert score(client, ["def total(xs):\n    return sum(xs)\n", "def other(xs):\n    return 0\n"], he) == [2, 0]

    stdio = TestSpec("stdio", inputs=["2 3\n", "10 -4\n", "1 1\n"], outputs=["5\n", "6", "3\n"])
    prog = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert score(client, [prog, "print(5)"], stdio) == [2, 1]  # the third expected output is wrong on purpose
    fast_io = ("import sys\na, b = map(int, sys.stdin.buffer.readline().split())\n"
               "sys.stdout.buffer.write(b'%d\\n' % (a + b))\n")
    assert score(client, [fast_io], stdio) == [2]
    long_out = TestSpec("stdio", inputs=["300\n"], outputs=["\n".join(map(str, range(300)))])
    assert score(client, ["for i in range(int(input())):\n    print(i)\n"], long_out) == [1]  # sent as a hash

    call = TestSpec("call", fn_name="twice", inputs=[[2], [[1, 2]], [5]], outputs=[[4], [[1, 2, 1, 2]], [11]])
    assert score(client, ["def twice(x):\n    return x * 2\n"], call) == [2]
    leet = "class Solution:\n    def twice(self, x):\n        return x + x\n"
    assert score(client, [leet], call) == [2]
    # a dict with int and str keys: compared as JSON (keys as strings), not refused by sorting them
    mixed = TestSpec("call", fn_name="f", inputs=[[1]], outputs=[{"1": "a", "b": [1, 2]}])
    assert score(client, ["def f(x):\n    return {x: 'a', 'b': (1, 2)}\n"], mixed) == [1]


def test_review_attacks_of_2026_11_29_pass_no_test_and_honest_twins_pass_all(client):
    """Found in review, each passed tests it never solved: the tests read back from linecache (the
    executor keeps the whole script for tracebacks) and answered by lookup; a first call that
    unhooked the checker and rebound the function in the program's globals for every later test;
    HumanEval's `check` (the setup) asserting unchecked; a callable instance agreeing through
    arithmetic. Each beside an honest program the same spec passes whole."""
    lookup = ("import linecache, re\n_src = ''.join(linecache.getlines('<code>'))\n"
              "_n = r'(-?\\d+)'\n_t = {(int(a), int(b)): int(c)\n"
              "      for a, b, c in re.findall(r'add\\(' + _n + ', ' + _n + r'\\) == ' + _n, _src)}\n"
              "def add(a, b):\n    return _t.get((a, b), -99)\n")
    unhook = ("class _Y:\n    def __eq__(self, o):\n        return True\n"
              "def add(a, b):\n    g = globals()\n    g['__harness_checked__'] = lambda v: v\n"
              "    g['add'] = lambda *a: _Y()\n    return -99\n")
    assert score(client, [lookup, unhook, GOOD], ADD, per_test_timeout_s=2.0) == [0, 0, 3]

    check = TestSpec("assert", tests=["check(candidate)"], entry_point="add",
                     setup="def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n")
    anything = ("class _Y:\n    def __eq__(self, o):\n        return True\n"
                "class _F:\n    def __call__(self, *a):\n        return _Y()\nadd = _F()\n")
    assert score(client, [anything, GOOD], check) == [0, 1]

    near = TestSpec("assert", tests=["assert abs(candidate(1.0) - 0.5) < 1e-6"], entry_point="half")
    zero = ("class _Z:\n    def __sub__(self, o):\n        return 0.0\n"
            "class _F:\n    def __call__(self, *a):\n        return _Z()\nhalf = _F()\n")
    assert score(client, [zero, "def half(x):\n    return x / 2\n"], near) == [0, 1]


def test_a_script_may_print_from_its_own_thread(client):
    """`threading.Thread(target=main).start()`, the competitive programmer's way to a bigger stack:
    the harness refused any thread left running, so correct scripts scored 0 (found in review)."""
    spec = TestSpec("stdio", inputs=["2 3\n", "10 -4\n"], outputs=["5", "6"])
    threaded = ("import sys, threading, time\ndef main():\n    a, b = map(int, input().split())\n"
                "    time.sleep(0.1)\n    print(a + b)\n"
                "threading.stack_size(1 << 26)\nthreading.Thread(target=main).start()\n")
    forever = "import threading, time\nthreading.Thread(target=lambda: time.sleep(99), daemon=True).start()\nprint(5)\n"
    assert score(client, [threaded, forever], spec, per_test_timeout_s=1.0) == [2, 0]


def test_outputs_are_compared_alike_whatever_their_length_and_values_by_value(client):
    """Past 200 characters a stdio output travelled as a hash of its exact text, so a double space or
    float noise failed there and passed in a short one; call-based answers were compared as JSON text,
    so 2 for 2.0 failed where APPS's own grader (Python's ==) passes it (found in review)."""
    lines = 60
    spec = TestSpec("stdio", inputs=[f"{lines}\n"], outputs=["\n".join(f"{i / 3:.7f}  x" for i in range(lines))])
    noisy = "for i in range(int(input())):\n    print(f'{i / 3 + 1e-9:.9f} x')\n"
    wrong = "for i in range(int(input())):\n    print(f'{i / 3 + 1e-3:.9f} x')\n"
    assert len(spec.outputs[0]) > 200 and score(client, [noisy, wrong], spec) == [1, 0]
    call = TestSpec("call", fn_name="f", inputs=[[1], [2], [3]], outputs=[[2.0], [True], [[1, 2.5]]])
    honest = "def f(x):\n    return [2, 1, [1.0, 2.5]][x - 1]\n"
    assert score(client, [honest, "def f(x):\n    return 0\n"], call) == [3, 0]
    # ...and where only one side is long enough to travel as a hash (found in review, 2026-11-30)
    spaced = TestSpec("stdio", inputs=["30\n"], outputs=[" ".join(map(str, range(30)))])
    assert score(client, ["print('  '.join(map(str, range(int(input())))))\n"], spaced) == [1]
    floats = TestSpec("call", fn_name="f", inputs=[[20]], outputs=[list(range(20))])
    assert score(client, ["def f(n):\n    return [float(i) for i in range(n)]\n",
                          "def f(n):\n    return [i + 0.5 for i in range(n)]\n"], floats) == [1, 0]


def test_partial_credit_survives_a_hang_or_an_exit_in_any_test(client):
    spec = TestSpec("assert", tests=["assert f(1) == 1", "assert f(2) == 2", "assert f(0) == 0"])
    prog = "def f(x):\n    while x == 0:\n        pass\n    return x\n"
    assert score(client, [prog], spec, per_test_timeout_s=1.0) == [2]
    # the program's process is started afresh for the tests after one that hung or exited
    first = TestSpec("assert", tests=["assert f(0) == 0", "assert f(1) == 1", "assert f(2) == 2"])
    leaves = "import os\ndef f(x):\n    if x == 1:\n        os._exit(0)\n    return x\n"
    assert score(client, [prog, leaves], first, per_test_timeout_s=1.0) == [2, 2]


def test_what_tests_do_with_the_programs_objects_crosses_to_its_process(client):
    """Assert tests call into the program's own process: classes and their instances, methods,
    exceptions the tests expect, the program's modules and constants, keyword arguments and large
    values all work as they did in one process; an object is never taken for plain data."""
    program = (
        "import math\nfrom collections import Counter\nLIMIT = 3\n"
        "class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
        "    def span(self):\n        return self.b - self.a\n    def __len__(self):\n        return 2\n"
        "def chain(pairs, n):\n    return sum(p.span() for p in pairs[:n])\n"
        "def root(x, *, exact=False):\n    if x < 0:\n        raise ValueError(x)\n"
        "    return math.isqrt(x) if exact else math.sqrt(x)\n"
        "def count(s):\n    return Counter(s)\n"
        "def primes(n):\n    s = bytearray([1]) * n\n    s[:2] = b'\\0\\0'\n"
        "    for i in range(2, int(n ** 0.5) + 1):\n        if s[i]:\n"
        "            s[i * i::i] = bytearray(len(s[i * i::i]))\n"
        "    return [i for i in range(n) if s[i]]\n"
        "def same(x):\n    return Pair(1, 2)\n")
    spec = TestSpec("assert", tests=[
        "assert chain([Pair(1, 5), Pair(2, 3)], 2) == 5",
        "p = Pair(2, 9)\nassert p.span() == 7 and p.a == 2 and len(p) == 2",
        "assert math.isclose(root(2.0), 1.41421356, rel_tol=1e-6) and root(16, exact=True) == 4",
        "try:\n    root(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False",
        "assert count('aab') == {'a': 2, 'b': 1} and LIMIT == 3",
        "assert len(primes(200000)) == 17984",
        "assert same(1) == same(1)",  # the program's objects compare as nothing
    ])
    res = run_tests(client, [program], [spec], per_test_timeout_s=5.0)[0]
    assert (res.passed, res.total) == (6, 7)


def test_judge_ignores_lines_without_the_nonce_and_rejects_duplicates():
    nonce = new_nonce()
    spec = TestSpec("assert", tests=["assert 1", "assert 1"])
    ok = f"noise\n{nonce} [0, true, null]\nTOOLRL-x [1, true, null]\n{nonce} [1, false, \"AssertionError\"]\n"
    assert judge(ok, "ok", nonce, spec).passed == 1
    dup = f"{nonce} [0, true, null]\n{nonce} [0, true, null]\n"
    assert judge(dup, "ok", nonce, spec).passed == 0


@pytest.mark.parametrize("text, code", [
    ("<think>x</think>\n```python\ndef f():\n    return 1\n```\n", "def f():\n    return 1"),
    ("<think>```python\nbad\n```</think>\n```\ndef g(): pass\n```", "def g(): pass"),  # any fence after the thinking
    ("```py\na = 1\n```\ntext\n```python\nb = 2\n```", "b = 2"),  # the last python fence
    ("<think>plan</think>\nimport math\ndef h():\n    return math.pi", "import math\ndef h():\n    return math.pi"),
    ("<think>only words</think> no code here", None),
    ("```python\ndef unterminated():\n    return 2\n", "def unterminated():\n    return 2"),
])
def test_extraction(text, code):
    assert extract_code(text) == code


def test_spec_round_trip_and_errors():
    spec = TestSpec("call", fn_name="f", inputs=[[1]], outputs=[2])
    assert TestSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="equal length"):
        TestSpec("stdio", inputs=["1"], outputs=[])
    with pytest.raises(ValueError, match="at least one"):
        TestSpec("assert")


# ---------------------------------------------------------------------------------------------
# Tasks: loaders, split, and the reference solutions through the same harness

FIX = ROOT / "tests" / "fixtures"


def test_every_humaneval_reference_passes_all_its_tests_and_a_wrong_program_none(client):
    problems = load_humaneval()
    assert len(problems) == 164 and {p.grading for p in problems} == {"tests"}
    specs = [TestSpec.from_json(p.answer) for p in problems]
    assert sum(s.total for s in specs) > 1000  # split into per-assert tests for partial credit
    res = run_tests(client, [p.program for p in problems], specs, per_test_timeout_s=3.0, max_timeout_s=20)
    assert [p.id for p, r in zip(problems, res) if r.passed != r.total] == []
    wrong = run_tests(client, [program_for(p, "    return None\n") for p in problems], specs)
    assert sum(r.passed for r in wrong) < 0.05 * sum(s.total for s in specs)  # a few asserts do expect None
    assert not any(r.passed == r.total for r in wrong)


def test_what_mbpps_setup_builds_is_the_programs_to_take(tmp_path, client):
    """MBPP's test_setup_code builds what its tests hand the program (task 927: a tree of a Node
    class of its own). It runs in the program's process, right after the program, so the tree is
    the program's object and crosses as a handle; in the tests' process it could not be passed at
    all, and every answer scored 0. The test imports still run beside the tests."""
    row = {"task_id": 927, "text": "Write a function to calculate the height of the given binary tree.",
           "code": "def max_height(node):\n    if node is None:\n        return 0\n"
                   "    return 1 + max(max_height(node.left), max_height(node.right))\n",
           "test_list": ["assert max_height(root) == 3", "assert max_height(root1) == 5",
                         "assert max_height(Node(4)) == 1", "assert math.floor(max_height(root) / 2) == 1"],
           "test_imports": ["import math"],
           "test_setup_code": "class Node:\n    def __init__(self, data):\n        self.data = data\n"
                              "        self.left = None\n        self.right = None\n"
                              "root = Node(1)\nroot.left = Node(2)\nroot.right = Node(3)\nroot.left.left = Node(4)\n"
                              "root1 = Node(1)\nnode = root1\nfor i in range(4):\n"
                              "    node.left = Node(i)\n    node = node.left\n"}
    path = tmp_path / "mbpp.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [problem] = load_mbpp(str(path))
    spec = TestSpec.from_json(problem.answer)
    assert spec.setup == "import math" and spec.program_setup == "import math\n" + row["test_setup_code"]
    flat = "def max_height(node):\n    return 1 if node.left is None else 3\n"  # right on three of four
    assert score(client, [problem.program, flat, "def max_height(node):\n    return node\n"], spec) == [4, 3, 0]


SETUP_HOOK = """import sys
class Agree:
    def __iter__(self):
        return iter([7])
    def __len__(self):
        return 7
    def __getitem__(self, i):
        return 7
def on_setup(frame, event, arg):
    if frame.f_code.co_filename == "<setup>":
        def at_return(fr, ev, a):
            if ev == "return":
                fr.f_globals.update(DATA=Agree(), is_sorted=lambda *a: True, EXPECTED=[7])
                sys.settrace(None)
            return at_return
        return at_return
sys.settrace(on_setup)
"""
SEVENS = "def sort_it(xs):\n    return [7]\ndef count(xs):\n    return 7\ndef first(xs):\n    return 7\n"


def test_what_the_task_defines_is_never_the_programs_to_answer_for(client):
    """Review of 2026-11-30: the tests called the program's copy of what the task defines. HumanEval's
    prompt helpers (the tests make their inputs with /38's encode_cyclic: a program that remembered
    them decoded anything), a module the tests use unimported (`math = M()`), the setup's own
    imports, plain values and checkers (rebound by a trace hook on the setup, or sent as handles once
    a large global used up the names' budget). They come from the harness now; honest twins pass."""
    he = {p.id: TestSpec.from_json(p.answer) for p in load_humaneval()}
    memo = "_seen = [None]\ndef {enc}(s):\n    _seen[0] = s\n    return 'x'\ndef {dec}(s):\n    return _seen[0]\n"
    assert score(client, ["def poly(xs, x):\n    return 0.0\ndef find_zero(xs):\n    return 0.0\n"],
                 he["humaneval:HumanEval/32"]) == [0]
    assert score(client, [memo.format(enc="encode_cyclic", dec="decode_cyclic")], he["humaneval:HumanEval/38"]) == [0]
    assert score(client, [memo.format(enc="encode_shift", dec="decode_shift")], he["humaneval:HumanEval/50"]) == [0]

    area = TestSpec("assert", tests=["assert math.isclose(area(2), 12.566, rel_tol=0.001)"])
    agrees = "class M:\n    def isclose(self, *a, **k):\n        return True\n"
    assert score(client, ["import math\ndef area(r):\n    return math.pi * r * r\n",  # honest: 1
                          agrees + "math = M()\ndef area(r):\n    return -1\n",
                          "def math():\n    pass\nmath.isclose = lambda *a, **k: True\ndef area(r):\n    return -1\n",
                          agrees + "import sys\nsys.modules['math'] = M()\nimport math\ndef area(r):\n    return -1\n"],
                 area) == [1, 0, 0, 0]
    imported = TestSpec("assert", tests=area.tests, program_setup="import math")  # MBPP's setup importing
    assert score(client, [agrees + "import sys\nsys.modules['math'] = M()\ndef area(r):\n    return -1\n"],
                 imported) == [0]
    # a callable the setup imports is ours too, and `from k import k` stays k.k for the tests
    sqrt = TestSpec("assert", tests=["assert root(16) == sqrt(16)", "assert clone([1, [2]]) == copy([1, [2]])"],
                    program_setup="from math import sqrt")
    honest_sqrt = ("from copy import copy\nimport math\ndef root(x):\n    return math.sqrt(x)\n"
                   "def clone(x):\n    return copy(x)\n")
    patched = "import math\nmath.sqrt = lambda x: 7.0\ndef root(x):\n    return 7.0\n"
    assert score(client, [honest_sqrt, patched], sqrt) == [2, 0]

    data = TestSpec("assert", tests=["assert sort_it(DATA) == sorted(DATA)", "assert count(DATA) == len(DATA)",
                                     "assert first(DATA) == DATA[0]", "assert is_sorted(sort_it([9, 8]))",
                                     "assert EXPECTED == sort_it([9, 8])"],
                    program_setup="DATA = [3, 1, 2, 5]\nEXPECTED = [8, 9]\n"
                                  "def is_sorted(xs):\n    return list(xs) == sorted(xs) and len(xs) > 1\n")
    honest = ("def sort_it(xs):\n    return sorted(xs)\ndef count(xs):\n    return len(xs)\n"
              "def first(xs):\n    return xs[0]\n")
    assert score(client, [honest, SETUP_HOOK + SEVENS, "_pad = [0] * 100_000\n" + SEVENS], data) == [5, 0, 0]


def test_mbpp_and_apps_local_files_in_their_own_formats(client):
    mbpp = load_mbpp(str(FIX / "mbpp_sample.jsonl"))
    assert [p.id for p in mbpp] == ["mbpp:11", "mbpp:17", "mbpp:900"]
    assert "assert remove_Occ" in mbpp[0].question  # the first test names the function
    apps = load_apps(str(FIX / "apps_sample.jsonl"))
    assert [p.id for p in apps] == ["apps:4000", "apps:4001"]  # the row without tests is skipped
    assert [TestSpec.from_json(p.answer).kind for p in apps] == ["stdio", "call"]
    assert {p.grading for p in mbpp + apps} == {"tests"}  # what tells the worker to run tests
    assert [p.id for p in load_apps(str(FIX / "apps_sample.jsonl"), difficulty="interview")] == ["apps:4001"]
    with pytest.raises(DataError, match="difficulty"):
        load_apps(str(FIX / "apps_sample.jsonl"), difficulty="hard")
    mixed = load_code_task(f"mbpp:{FIX / 'mbpp_sample.jsonl'}+apps:{FIX / 'apps_sample.jsonl'}@interview")
    assert [p.id for p in mixed] == ["mbpp:11", "mbpp:17", "mbpp:900", "apps:4001"]
    with pytest.raises(DataError, match="unknown code task"):
        load_code_task("appsx")
    problems = mbpp + apps
    res = run_tests(client, [p.program for p in problems], [TestSpec.from_json(p.answer) for p in problems])
    assert [(r.passed, r.total) for r in res] == [(3, 3), (3, 3), (2, 2), (3, 3), (3, 3)]


def test_bad_rows_get_clear_errors(tmp_path):
    bad = tmp_path / "mbpp.jsonl"
    bad.write_text(json.dumps({"task_id": 1, "code": "x"}) + "\n")
    with pytest.raises(DataError, match="missing field 'test_list'"):
        load_mbpp(str(bad))
    bad.write_text(json.dumps({"problem_id": 1, "question": "q", "input_output": "{not json"}) + "\n")
    with pytest.raises(DataError, match="input_output is not valid JSON"):
        load_apps(str(bad))
    # HumanEval-shaped rows of one's own: a KeyError and a SyntaxError traceback before
    row = {"task_id": "X/0", "prompt": "def f():\n", "entry_point": "f", "canonical_solution": "    return 1\n"}
    bad = tmp_path / "he.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match="he.jsonl row 1: missing field 'test'"):
        load_humaneval(str(bad))
    bad.write_text(json.dumps({**row, "test": "def check(:"}) + "\n")
    with pytest.raises(DataError, match="test for f is not Python"):
        load_humaneval(str(bad))
    bad.write_text(json.dumps({**row, "test": "def check(candidate):\n    assert candidate() == 1\n",
                               "prompt": 5}) + "\n")
    with pytest.raises(DataError, match="prompt must be a string"):
        load_humaneval(str(bad))


def test_split_is_seeded_and_per_source():
    problems = load_humaneval() + load_mbpp(str(FIX / "mbpp_sample.jsonl")) * 10
    problems = [p if i < 164 else replace(p, id=f"{p.id}-{i}") for i, p in enumerate(problems)]
    train, held = split(problems, seed=1)
    assert split(problems, seed=1) == (train, held) and split(problems, seed=2) != (train, held)
    assert sum(p.meta["source"] == "humaneval" for p in held) == round(164 * 0.2)
    assert sum(p.meta["source"] == "mbpp" for p in held) == 6
    assert not {p.id for p in train} & {p.id for p in held}


def test_score_cli_prints_passed_total_reward(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("```python\ndef add(a, b):\n    return a + b\n```\n")
    half = tmp_path / "half.py"
    half.write_text("def remove_Occ(s, ch):\n    return s.replace(ch, '') if len(s) > 3 else s\n")  # wrong on 'PHP'
    run = lambda task, f, *extra: subprocess.run(  # noqa: E731
        [sys.executable, "evaluate.py", "score", "--task", task, "--program", str(f), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    p = run(f"mbpp:{FIX / 'mbpp_sample.jsonl'}#11", half)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) | {"detail": ""} == {"task": f"mbpp:{FIX / 'mbpp_sample.jsonl'}#11", "passed": 2,
                                                     "total": 3, "reward": pytest.approx(2 / 3), "status": "ok",
                                                     "detail": ""}
    p = run(f"mbpp:{FIX / 'mbpp_sample.jsonl'}#11", half, "--mode", "all")
    assert json.loads(p.stdout)["reward"] == 0.0
    p = run("humaneval:HumanEval/no-such", prog)
    assert p.returncode == 2 and "no task" in p.stderr


def test_an_mbpp_function_named_like_a_builtin_stays_visible_to_its_tests(tmp_path, client):
    row = {"task_id": 1, "text": "Write max.", "code": "def max(xs):\n    return sorted(xs)[-1]\n",
           "test_list": ["assert max([3, 1, 2]) == 3", "assert set([max([1])]) == {1}"]}
    path = tmp_path / "mbpp.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [p] = load_mbpp(str(path))
    spec = TestSpec.from_json(p.answer)
    assert spec.entry_point == "max"  # not `set`: the reference does not define it
    assert score(client, [p.program], spec) == [2]


def test_reports_cut_by_the_output_cap_leave_the_sample_unscored_not_zero(client):
    from toolrl.tasks.code.judge import ReportsCut

    n = 300  # ~300 report lines: more than the executor keeps of a run's output (8 KiB head and tail)
    spec = TestSpec("stdio", inputs=[f"{i}\n" for i in range(n)], outputs=[str(2 * i) for i in range(n)])
    with pytest.raises(ReportsCut, match="output cap cut the reports"):
        run_tests(client, ["i = int(input())\nprint(2 * i)\n"], [spec], per_test_timeout_s=0.5, max_timeout_s=20)
    few = replace(spec, inputs=spec.inputs[:40], outputs=spec.outputs[:40])
    assert score(client, ["i = int(input())\nprint(2 * i)\n", "print(0)\n"], few) == [40, 1]


def test_what_a_program_prints_or_names_cannot_push_the_reports_past_the_cap(client):
    """A report carries an output itself only while its JSON is short: 200 emoji took 2.4 KB of
    escapes, an exception class named with them as much, and a few such lines had the output cap cut
    the reports, which leaves the sample unscored instead of 0 (found in review, 2026-11-30)."""
    n = 12
    stdio = TestSpec("stdio", inputs=[f"{i}\n" for i in range(n)], outputs=[str(2 * i) for i in range(n)])
    assert score(client, ["i = int(input())\nprint(2 * i)\n", "print('\\U0001F600' * 200)\n",
                          "print(chr(1) * 200)\n"], stdio) == [n, 0, 0]
    call = TestSpec("call", fn_name="f", inputs=[[i] for i in range(n)], outputs=[2 * i for i in range(n)])
    named = "E = type('\\U0001F600' * 200, (Exception,), {})\ndef f(x):\n    raise E()\n"
    assert score(client, ["def f(x):\n    return 2 * x\n", named], call) == [n, 0]


def test_a_program_that_floods_its_output_scores_0_and_its_group_keeps_its_scores(client):
    """100 KB on stderr and then os._exit: the output was truncated with no test reported, so the
    judge took it for reports cut by the cap and the whole batch, honest programs too, went unscored
    (found in review). Only a cut of the report stream itself is ReportsCut."""
    from toolrl.executor.forkserver.capture import MARKER
    from toolrl.tasks.code.judge import ReportsCut

    flood = "import os\nos.write(2, b'x' * 100_000)\nos._exit(0)\ndef add(a, b):\n    return a + b\n"
    # a call task's program runs in the harness's process, whose output the executor caps
    call = TestSpec("call", fn_name="add", inputs=[[1, 2], [2, 2], [-1, 1]], outputs=[3, 4, 0])
    res = run_tests(client, [GOOD, GOOD, flood], [call] * 3)
    assert [r.passed for r in res] == [3, 3, 0] and "no test ran" in res[2].detail
    # an assert task's program runs in a process of its own, whose output goes nowhere
    res = run_tests(client, [GOOD, flood], [ADD] * 2)
    assert [r.passed for r in res] == [3, 0] and res[1].detail == "exited" and res[1].status == "ok"
    # the report stream cut: reports beside the mark are the cap's doing; anything else, the program's
    nonce, cut = new_nonce(), MARKER.format(omitted=5000)
    reports = f"\n{nonce} [0, true, null]\n{nonce} [1, tr" + cut + "ue, null]\n"
    with pytest.raises(ReportsCut):
        judge(reports, "ok", nonce, ADD, truncated=True)
    crowded = f"\n{nonce} [0, true, null]\nxxxxxxxx\nxxxx" + cut + "xxxx\n"
    assert judge(crowded, "ok", nonce, ADD, truncated=True).passed == 1


def test_score_cli_says_a_run_the_executor_could_not_judge_is_not_scored(tmp_path):
    """A ReportsCut (here: 300 tests, reports past the output cap) was a traceback from
    `evaluate.py score` (found in review): now one line, status 1, no score."""
    row = {"problem_id": 7, "question": "Print twice the number.", "solutions": "[]", "difficulty": "introductory",
           "input_output": json.dumps({"inputs": [f"{i}\n" for i in range(300)],
                                       "outputs": [f"{2 * i}\n" for i in range(300)]}), "url": "", "starter_code": ""}
    (tmp_path / "apps.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "p.py").write_text("print(2 * int(input()))\n")
    p = subprocess.run([sys.executable, "evaluate.py", "score", "--task", f"apps:{tmp_path / 'apps.jsonl'}#7",
                        "--program", str(tmp_path / "p.py"), "--set", "rewards.code_test_timeout_s=0.2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and lines[-1].startswith("evaluate.py score: not scored: the executor's output cap"), \
        p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not p.stdout
