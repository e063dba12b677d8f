"""inference.py speaks only to the user: the engine's logs go to a file (or to the screen with
--verbose); with no question it takes questions until the user stops."""
import subprocess
import sys

import pytest

from procs import ROOT  # tests/ is on sys.path (conftest)

TINY = ["--config", "configs/cpu_tiny.yaml", "--model", "tiny-random"]


def inference(*args, stdin=None, timeout=600):
    return subprocess.run([sys.executable, "inference.py", *TINY, *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_questions_show_the_tool_loop_and_only_that(tmp_path):
    """With no question on the command line, one question per line of a pipe (on a terminal, the
    same loop prompts for each); each shows its tool loop and answer, and vLLM's start-up and
    shutdown logs (INFO lines of dozens of modules) go to the file, not to the screen. One engine
    start serves both questions; --verbose is the test below."""
    log = tmp_path / "engine.log"
    p = inference("--log", str(log), stdin="What is 6 times 7?\nAnd 2 plus 2?\n")
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert p.stdout.count("answer:") == 2
    assert "What is 6 times 7?" in p.stdout and "And 2 plus 2?" in p.stdout
    assert "print(6 * 7)" in out and "42" in out and "1 tool call(s)" in out
    assert "INFO" not in out and "vllm" not in out.lower().replace("inference.log", "")
    engine_log = log.read_text()
    assert "INFO" in engine_log and "shutdown" in engine_log.lower()
    # The engine core ends on vLLM's SIGTERM, not when vLLM gives up 5 s later and kills it: its
    # last garbage collection is skipped (toolrl/__init__.py), and no library reports leaks for it.
    assert "[shutdown] EngineCore: exiting busy loop" in engine_log
    everything = out + engine_log
    assert "force killing" not in everything and "leaked" not in everything, engine_log[-3000:]


SHOW = """
import subprocess, sys
from pathlib import Path
from toolrl.worker.chat import engine_output_to
with engine_output_to(Path(sys.argv[1]) if sys.argv[1] else None) as console:
    console.print("for the user")
    print("a library's print", flush=True)
    child = "import os; os.write(1, b'a child on fd 1\\\\n'); os.write(2, b'a child on fd 2\\\\n')"
    subprocess.run([sys.executable, "-c", child])
print("after the engine", flush=True)
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_verbose_shows_the_engine_output_and_otherwise_only_the_file_gets_it(tmp_path, verbose):
    """What inference.py wraps the engine in: with a log file (the default), everything else the
    process and its children write to fds 1 and 2 goes to the file and the user reads only the
    console; with --verbose (no file) it all reaches the screen."""
    log = tmp_path / "engine.log"
    p = subprocess.run([sys.executable, "-c", SHOW, "" if verbose else str(log)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    engine = ["a library's print", "a child on fd 1", "a child on fd 2"]
    out = p.stdout + p.stderr
    assert "for the user" in p.stdout and "after the engine" in p.stdout  # fds 1 and 2 given back
    if verbose:
        assert all(x in out for x in engine) and not log.exists(), out
    else:
        assert not any(x in out for x in engine), out
        assert all(x in log.read_text() for x in engine)
