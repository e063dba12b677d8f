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
def test_a_question_shows_the_tool_loop_and_only_that(tmp_path):
    log = tmp_path / "engine.log"
    p = inference("What is 6 times 7?", "--log", str(log))
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "print(6 * 7)" in out and "42" in out and "answer:" in out and "1 tool call(s)" in out
    # vLLM's start-up and shutdown logs (INFO lines of dozens of modules) are in the file, not on screen
    assert "INFO" not in out and "vllm" not in out.lower().replace("inference.log", "")
    engine_log = log.read_text()
    assert "INFO" in engine_log and "shutdown" in engine_log.lower()


@pytest.mark.slow
def test_no_question_reads_questions_until_the_input_ends(tmp_path):
    """On a pipe, one question per line (on a terminal, the same loop prompts for each)."""
    p = inference("--log", str(tmp_path / "engine.log"), stdin="What is 6 times 7?\nAnd 2 plus 2?\n")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("answer:") == 2
    assert "What is 6 times 7?" in p.stdout and "And 2 plus 2?" in p.stdout
    assert "INFO" not in p.stdout + p.stderr


@pytest.mark.slow
def test_verbose_shows_the_engine_logs():
    p = inference("What is 6 times 7?", "--verbose")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "answer:" in p.stdout and "INFO" in p.stdout + p.stderr
