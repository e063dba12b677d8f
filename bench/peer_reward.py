"""The arithmetic task's reward for the TRL peer of bench/e2e_vs_trl.py, as one pure function.

    score(text, answer, weights) -> (components, total)

`text` is the whole completion with the prompt's prefill ("<think>\\n") put back in front, as toolrl's
gen worker scores it; `answer` is the problem's ground truth. It is a copy of what toolrl scores a
completion with no tool calls by (toolrl.worker.rewards: `correct` and `format`; toolrl.format:
the answer extraction and the think/answer layout), with nothing but the standard library and
math-verify, so the TRL virtualenv scores exactly as the gen worker does without importing toolrl.
tests/test_bench_peer_reward.py checks the two agree on a set of completions.

Where they differ: toolrl runs math-verify in a child process under a timeout (so a pathological
answer cannot hang a worker); here it runs in-process with math-verify's own timeouts (TRL calls
reward functions in its main thread, where those signal-based timeouts work).
"""
from __future__ import annotations

import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
_ANSWER = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.S)
THINK_ANSWER = re.compile(r"^\s*" + re.escape(THINK_OPEN) + ".*?" + re.escape(THINK_CLOSE) + r"\s*"
                          + re.escape(ANSWER_OPEN) + ".*?" + re.escape(ANSWER_CLOSE) + r"\s*$", re.S)
VERIFY_TIMEOUT_S = 5


def last_boxed(text: str) -> str | None:
    r"""The content of the last \boxed{...} (or \fbox{...}) in `text`, with arbitrary brace nesting."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "\\" and i + 1 < len(text):  # skip escaped braces like \{ \}
                i += 2
                continue
            depth += (c == "{") - (c == "}")
            i += 1
        if depth == 0:
            best = text[m.end(): i - 1]
    return best.strip() if best is not None else None


def extract_answer(text: str) -> str | None:
    """The last \\boxed{} inside the last <answer> block."""
    blocks = _ANSWER.findall(text)
    return last_boxed(blocks[-1]) if blocks else None


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
    if pred is None or not pred.strip():
        return False
    if pred.strip() == gold.strip():  # exact match needs no parser
        return True
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
