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
    start serves both questions: a question given as an argument is test_verbose_shows_the_engine_logs."""
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


@pytest.mark.slow
def test_verbose_shows_the_engine_logs():
    p = inference("What is 6 times 7?", "--verbose")
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "answer:" in p.stdout and "INFO" in out
    # The engine core ends on vLLM's SIGTERM, not when vLLM gives up 5 s later and kills it: its
    # last garbage collection is skipped (toolrl/__init__.py), and no library reports leaks for it.
    assert "[shutdown] EngineCore: exiting busy loop" in out
    assert "force killing" not in out and "leaked" not in out, out[-3000:]
