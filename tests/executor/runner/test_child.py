"""The runner's own semantics, in-process: how a snippet's outcome becomes an exit code and a
traceback that shows the model's code, not the harness."""
from __future__ import annotations

from toolrl.executor.runner.child import CODE_NAME, run_source


def test_a_clean_run_exits_0_and_keeps_its_globals():
    g: dict = {}
    assert run_source("x = 6 * 7\n", g) == (0, False)
    assert g["x"] == 42


def test_exit_codes_follow_the_interpreter(capsys):
    assert run_source("raise SystemExit", {}) == (0, False)
    assert run_source("raise SystemExit(3)", {}) == (3, False)
    assert run_source("raise SystemExit(256 + 5)", {}) == (5, False)  # an exit status is one byte
    assert run_source("raise SystemExit('bye')", {}) == (1, False)
    assert "bye" in capsys.readouterr().err


def test_errors_print_a_traceback_of_the_model_code_only(capsys):
    assert run_source("def f():\n    return 1 / 0\nf()\n", {}) == (1, False)
    err = capsys.readouterr().err
    assert "ZeroDivisionError" in err and CODE_NAME in err and "return 1 / 0" in err
    assert "child.py" not in err  # the harness's own frames are dropped


def test_syntax_errors_and_memory_errors_are_reported(capsys):
    assert run_source("def (:", {}) == (1, False)
    assert "SyntaxError" in capsys.readouterr().err
    assert run_source("raise MemoryError", {}) == (1, True)
