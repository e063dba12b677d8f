"""The code-test harness as a module: what goes to the executor is its function's source alone, which
needs nothing from its module, and run as a plain process it reports what the judge reads back
(the sandboxed runs and the attacks: test_code_rewards.py)."""
import inspect
import json
import re
import subprocess
import sys

import pytest
from test_code_rewards import frame_forger  # tests/tasks/code/ is on sys.path (pytest prepends it)

from toolrl.tasks.code import companion, harness
from toolrl.tasks.code.judge import (COMPANION, COMPANION_BOOT_S, HARNESS, TEST_MODULES, HarnessFailed, TestSpec,
                                     build_harness, judge, new_nonce)


def test_the_harness_sent_is_the_functions_source_and_needs_nothing_from_its_module():
    shipped = (harness._toolrl_digest, harness._toolrl_value_json, companion._toolrl_codec, harness._toolrl_harness)
    sources = [inspect.getsource(f) for f in shipped]
    assert HARNESS == "\n\n".join(sources)
    assert COMPANION.startswith(inspect.getsource(companion._toolrl_codec)) and COMPANION.endswith(
        inspect.getsource(companion._toolrl_companion) + "\n_toolrl_companion(3, 4)\n")
    # self-contained: no toolrl inside, and the runs below are `python -c` of this source alone
    for text in (HARNESS, COMPANION):
        assert "toolrl" not in re.sub(r"_toolrl_(harness|digest|value_json|codec|companion)", "", text)
    code, stdin = build_harness("x = 1", TestSpec("assert", tests=["assert x == 1"]), 1.0, "N")
    assert code.startswith(HARNESS) and code.endswith(f"\n_toolrl_harness('x = 1', {COMPANION!r})\n")
    # the tests travel on stdin after the nonce's line, never in the code a program's process could read
    assert "assert x == 1" not in code and stdin == "N\n" + json.dumps(
        {"kind": "assert", "per_test_timeout_s": 1.0, "tests": ["assert x == 1"], "setup": "", "program_setup": "",
         "entry_point": None, "prompt": "", "modules": list(TEST_MODULES), "boot_timeout_s": COMPANION_BOOT_S})


def run_plain(program: str, spec: TestSpec, cwd=None, prelude=""):
    """The harness in a plain interpreter (no sandbox), judged as the executor's output would be."""
    nonce = new_nonce()
    code, stdin = build_harness(program, spec, 2.0, nonce)
    code = prelude + code
    p = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True, timeout=60,
                       cwd=cwd)
    return judge(p.stdout, "ok", nonce, spec)


ADD = TestSpec("assert", tests=["assert add(1, 2) == 3", "assert add(2, 2) == 4"])


@pytest.mark.parametrize("program, spec, passed", [
    ("def add(a, b):\n    return a + b\n", ADD, 2),
    ("def add(a, b):\n    return 3\n", ADD, 1),
    ("def f(xs):\n    return sum(xs)\n", TestSpec("assert", tests=["assert candidate([1]) == 1"], entry_point="f"), 1),
    ("import sys\nsys.exit(0)\n", TestSpec("assert", tests=["assert True"]), 0),
    ("print(input() + '!')\n", TestSpec("stdio", inputs=["a\n", "b\n"], outputs=["a!", "c!"]), 1),
    ("for i in range(int(input())):\n    print(i)\n",  # over 200 characters: reported as a hash
     TestSpec("stdio", inputs=["300\n"], outputs=["\n".join(map(str, range(300)))]), 1),
    ("def twice(x):\n    return x * 2\n",
     TestSpec("call", fn_name="twice", inputs=[[2], [[1]]], outputs=[[4], [[1, 1]]]), 2),
])
def test_the_harness_reports_what_the_judge_reads(program, spec, passed):
    res = run_plain(program, spec)
    assert (res.passed, res.total) == (passed, spec.total)


def test_the_program_cannot_read_the_nonce_from_stdin():
    prog = "import sys\ndata = sys.stdin.read()\ndef f():\n    return data\n"
    assert run_plain(prog, TestSpec("call", fn_name="f", inputs=[[]], outputs=[""])).passed == 1  # stdin was empty


def test_a_module_the_program_writes_is_never_what_the_tests_import(tmp_path):
    """`python -c` (like the executor's runner) has the working directory on its import path: a test
    that imports a standard module not yet loaded must not find a file the program wrote there, which,
    run in the harness, would find the nonce in its frames and report every test passed."""
    program = f"open('colorsys.py', 'w').write({frame_forger(2)!r})\ndef add(a, b):\n    return -99\n"
    spec = TestSpec("assert", tests=["import colorsys\nassert add(1, 2) == 3", "assert add(2, 2) == 4"])
    assert run_plain(program, spec, cwd=tmp_path).passed == 0
    assert (tmp_path / "colorsys.py").exists()  # the program did write it


def test_a_program_process_that_cannot_start_is_the_sandboxs_failure_not_a_score():
    """No interpreter to run the program in (here: sys.executable gone): HarnessFailed, which callers
    leave unscored, never 0 passed."""
    with pytest.raises(HarnessFailed, match="did not start"):
        run_plain("def add(a, b):\n    return a + b\n", ADD, prelude="import sys\nsys.executable = '/nonexistent'\n")


FREEZER = '''import os, signal, time
def _freeze_what_the_harness_starts(harness, me):
    if os.fork() == 0:
        os.setsid()  # out of the group the harness kills with the program's process
        if os.fork() == 0:
            end = time.time() + 15
            while time.time() < end and os.path.exists(f"/proc/{harness}"):
                for d in filter(str.isdigit, os.listdir("/proc")):
                    try:
                        ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
                    except (OSError, ValueError, IndexError):
                        continue
                    if ppid == harness and int(d) != me:
                        os.kill(int(d), signal.SIGSTOP)
                time.sleep(0.0005)
        os._exit(0)
    os.wait()
def add(a, b):
    _freeze_what_the_harness_starts(os.getppid(), os.getpid())
    os._exit(0)
'''


def test_a_restart_the_program_stops_fails_its_tests_and_is_not_the_sandboxs_failure():
    """After the program's process exits, the next test starts a fresh one; a process the program
    left behind that freezes it made the harness report its own failure, so any sample could make
    itself unscored and drop its whole group (found in review). Only a first start is the sandbox's."""
    res = run_plain(FREEZER, ADD)
    assert (res.passed, res.total) == (0, 2)


def test_a_slow_start_of_the_programs_process_is_not_the_programs_time(tmp_path):
    """The interpreter's start counted against the first test's time: on a loaded CI host a start
    past it left the sample unscored (2026-11-30). Here the interpreter takes 3 s to start, past the
    2 s a test has, and the program still gets its whole time."""
    slow = tmp_path / "slow-python"
    slow.write_text(f"#!/bin/sh\nsleep 3\nexec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    res = run_plain("def add(a, b):\n    return a + b\n", ADD, prelude=f"import sys\nsys.executable = {str(slow)!r}\n")
    assert (res.passed, res.total) == (2, 2)
