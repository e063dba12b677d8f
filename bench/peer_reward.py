"""The arithmetic task's reward for the TRL peer of bench/e2e_vs_trl.py, as one pure function.

    score(text, answer, weights) -> (components, total)

`text` is the whole completion with the prompt's prefill ("<think>\\n") put back in front, as toolrl's
gen worker scores it; `answer` is the problem's ground truth. It scores as toolrl scores a completion with no tool calls
(toolrl.worker.rewards: `correct` and `format`), with nothing but the standard library, math-verify
and toolrl/format.py loaded as a single file, so the TRL virtualenv scores exactly as the gen
worker does without importing the toolrl package.
tests/test_bench_peer_reward.py checks the two agree on a set of completions.

Where they differ: toolrl runs math-verify in a child process under a timeout (so a pathological
answer cannot hang a worker); here it runs in-process with math-verify's own timeouts (TRL calls
reward functions in its main thread, where those signal-based timeouts work).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

# toolrl/format.py (the answer extraction and the think/answer layout) needs only the standard
# library: load that one file by its path, so the peer scores with the same code without importing
# the toolrl package (or anything it depends on) into TRL's virtualenv.
_spec = importlib.util.spec_from_file_location(
    "toolrl_format", Path(__file__).resolve().parent.parent / "toolrl" / "format.py")
_format = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_format)
extract_answer, THINK_ANSWER = _format.extract_answer, _format.THINK_ANSWER
grade_plainly = _format.grade_plainly
VERIFY_TIMEOUT_S = 5


def _verify(pred: str, gold: str, timeout_s: int = VERIFY_TIMEOUT_S) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:  # without math-verify only exact answers count (the peer venv installs it)
        return False
    wrap = lambda s: s if "$" in s or "\\boxed" in s else f"${s}$"  # noqa: E731
    try:
        gold_p = parse(wrap(gold), parsing_timeout=timeout_s)
        pred_p = parse(wrap(pred), parsing_timeout=timeout_s)
        return bool(gold_p and pred_p and verify(gold_p, pred_p, timeout_seconds=timeout_s))
    except Exception:  # an unparseable answer is simply not correct
        return False


def is_correct(pred: str | None, gold: str) -> bool:
    if (plain := grade_plainly(pred, gold)) is not None:  # no answer, the same text, or numbers
        return plain
    return _verify(pred, gold)


def score(text: str, answer: str, weights: dict[str, float]) -> tuple[dict[str, float], float]:
    """(components, weighted total) for the rewards named in `weights` (correct, format; tool is 0
    without tool calls, as in the plain think/answer task)."""
    pred = extract_answer(text)
    known = {
        "correct": lambda: 1.0 if is_correct(pred, answer) else 0.0,
        "format": lambda: 1.0 if THINK_ANSWER.match(text) and pred is not None else 0.0,
        "tool": lambda: 0.0,
    }
    unknown = sorted(set(weights) - set(known))
    if unknown:
        raise ValueError(f"the peer reward implements {sorted(known)}, not {unknown}")
    comps = {name: known[name]() for name in weights}
    return comps, sum(weights[n] * comps[n] for n in weights)
