"""The output format, defined once: its tags, the stop marker, the tool-result layout, and the
parsers that read them back.

    <think>
    ... reasoning ...
    <program>
    ```python
    print(47 * 38)
    ```
    </program>
    The result of executing this Python code is:      <- generation stops here; the harness runs
    ```output                                            the program and appends this block
    1786                                                 (masked from the loss)
    ```
    ... more reasoning, more programs ...
    </think>
    <answer>
    \\boxed{1786}
    </answer>

Code tasks answer with the thinking and then one python fence. The prompts (prompts/*.txt), the
rollout engine, the teacher traces and the rewards all read these names, so the layout the model is
taught, the layout rollouts produce and the layout rewards parse agree.
"""
from __future__ import annotations

import math
import re
import textwrap
from fractions import Fraction

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
PROGRAM_OPEN, PROGRAM_CLOSE = "<program>", "</program>"
STOP_MARKER = "The result of executing this Python code is:"
OUTPUT_FENCE = "```output"
PYTHON_LANGS = ("python", "py", "python3")


def format_tool_result(output: str) -> str:
    """The text inserted after the stop marker: the executor's output in an output fence."""
    body = output if output.endswith("\n") or not output else output + "\n"
    return f"\n{OUTPUT_FENCE}\n{body}```\n"


def stop_strings(stop_marker: str, at_program_close: bool) -> list[str]:
    """Where a model segment stops for the tool: the marker, and `</program>` as well when the
    harness writes the marker line itself (rollout.stop_at_program_close)."""
    return [stop_marker] + ([PROGRAM_CLOSE] if at_program_close else [])


def ends_inside_stop(text: str, stops: list[str]) -> bool:
    """Whether `text` ends with the beginning of a stop string. A segment cut off there (by a
    weight update) and resumed as a new request would hide the stop string from the engine, which
    only looks for it in the new request's own output."""
    return any(text.endswith(s[:k]) for s in stops for k in range(1, len(s)))


# ---------------------------------------------------------------------------------------------
# Answers

_ANSWER = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.S)


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


def extract_answer(final_text: str) -> str | None:
    """The last \\boxed{} inside the last <answer> block of `final_text` (what the model wrote after
    its last tool output); None when there is none, or it is empty (an empty box answers nothing,
    and earned the format reward)."""
    blocks = _ANSWER.findall(final_text)
    if not blocks:
        return None
    return last_boxed(blocks[-1]) or None


# Numbers as answers

_UNITS = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{[^{}\d]*\}")  # \text{ pages}: words, no digits
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")
_WORDS = re.compile(r"[A-Za-z]+\.?$")  # 260 pages
_DECORATION = re.compile(r"\\[,!;: ]|\\?\$|\\?%|~|\s")  # thin spaces, dollars, percent, spaces
_DECIMAL = re.compile(r"[+-]?\d+(?:\.\d+)?\.?")
_FRACTION = re.compile(r"[+-]?(?:\\[dt]?frac(?:\{(\d+)\}\{(\d+)\}|(\d)(\d))|(\d+)/(\d+))")  # \frac12 too


def _bare(s: str) -> str:
    """`s` without what does not change a number: units in words, currency and percent signs,
    spaces and thousands separators."""
    s = _TEXT.sub(r"\1", _UNITS.sub("", s))  # \text{260} is 260
    return _WORDS.sub("", _DECORATION.sub("", s).replace(",", "").replace("{}", ""))


def number_value(text: str) -> Fraction | None:
    """The value of a number as written (a decimal, or a fraction in lowest terms), else None: a
    calculation such as `13 * 20` or `\\frac{3572}{2}` is not a number. Where the ground truth is a
    plain number (arithmetic, GSM8K) only a number can be correct: math-verify would evaluate the
    calculation, so boxing the question's numbers with the operation earned full reward with no
    arithmetic done and no tool used."""
    bare = _bare(text)
    if _DECIMAL.fullmatch(bare):
        return Fraction(bare.rstrip("."))
    m = _FRACTION.fullmatch(bare)
    if m is None:
        return None
    num, den = (int(x) for x in next(pair for pair in (m.group(1, 2), m.group(3, 4), m.group(5, 6)) if pair[0]))
    if den < 2 or math.gcd(num, den) != 1:
        return None
    return Fraction(-num if bare.startswith("-") else num, den)


def grade_plainly(pred: str | None, gold: str) -> bool | None:
    """Whether `pred` answers `gold` where no parser is needed, None where math-verify must decide:
    no answer is wrong, the same text is right, and a plain-number ground truth (arithmetic, GSM8K)
    is answered only by a number of that value ("13 \\times 20 = 260" answers 260; `13 * 20` does not)."""
    if pred is None or not pred.strip():
        return False
    if pred.strip() == gold.strip():
        return True
    gold_bare = _bare(gold)
    if not _DECIMAL.fullmatch(gold_bare):
        return None
    value = number_value(pred.rsplit("=", 1)[-1])
    return value is not None and value == Fraction(gold_bare.rstrip("."))


def _layout(*parts: str) -> re.Pattern:
    """A whole-completion layout: the tags in order, anything between them, whitespace-tolerant."""
    return re.compile(r"^\s*" + r"\s*".join(parts) + r"\s*$", re.S)


# <think>...</think> <answer>...</answer>, and the code tasks' <think>...</think> ```python...```
THINK_ANSWER = _layout(re.escape(THINK_OPEN) + ".*?" + re.escape(THINK_CLOSE),
                       re.escape(ANSWER_OPEN) + ".*?" + re.escape(ANSWER_CLOSE))
THINK_CODE = _layout(re.escape(THINK_OPEN) + ".*?" + re.escape(THINK_CLOSE), r"```python\n.*?```")
# the same think/answer layout with exactly one newline around each tag's content
THINK_ANSWER_STRICT = re.compile(rf"^{THINK_OPEN}\n.*?\n{THINK_CLOSE}\n{ANSWER_OPEN}\n.*?\n{ANSWER_CLOSE}\n?$", re.S)


# ---------------------------------------------------------------------------------------------
# Programs

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_PROGRAM = re.compile(re.escape(PROGRAM_OPEN) + r"(.*?)(?:" + re.escape(PROGRAM_CLOSE) + r"|\Z)", re.S)
_INLINE = re.compile(r"```[ \t]*(?:" + "|".join(PYTHON_LANGS) + r")[ \t]+([^`\n]+)```")
_CODE_START = re.compile(r"^(?:def |class |import |from |async def |@)", re.M)


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) for each fenced block; an unclosed last fence runs to the end."""
    return [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]


def extract_program(segment: str, stop_marker: str | None = None) -> str | None:
    """The program to run from the text the model just wrote before the stop marker.

    Preference: the last ```python fence; else the last fence of any language; else the bare
    contents of the last <program> block. None when there is no code at all.
    """
    if stop_marker and stop_marker in segment:
        segment = segment[: segment.rindex(stop_marker)]
    # ```python print(47 * 38)``` on one line is a fence too (read apart: the multi-line pattern
    # would take its closing backticks for an opening fence)
    inline = [(m.start(), "python", m.group(1).strip()) for m in _INLINE.finditer(segment)]
    rest = _INLINE.sub(lambda m: " " * len(m.group(0)), segment)  # same offsets
    blocks = sorted(inline + [(m.start(), m.group(1).lower(), _code(m.group(2))) for m in _FENCE.finditer(rest)])
    # an empty fence is skipped, not taken as "no program": an earlier one may hold the code
    for _, lang, code in reversed(blocks):
        if lang in PYTHON_LANGS and code:
            return code
    for _, lang, code in reversed(blocks):
        if lang not in ("output", "text") and code:
            return code
    progs = _PROGRAM.findall(rest)
    if progs and progs[-1].strip() and "```" not in progs[-1]:  # fences, all empty: no code
        return _code(progs[-1])
    return None


def _code(body: str) -> str:
    """A block's code as Python reads it: the indentation every line shares removed (an indented
    fence kept it, and the program failed with an IndentationError)."""
    return textwrap.dedent(body).strip("\n")


def extract_code(text: str) -> str | None:
    """A code task's program in a completion: the last python fence after the thinking, else the
    last fence of any language, else bare code. None when there is nothing that looks like code."""
    answer = text.rsplit(THINK_CLOSE, 1)[1] if THINK_CLOSE in text else text
    for part in (answer, text):
        fences = code_blocks(part)
        python = [body for lang, body in fences if lang in PYTHON_LANGS]
        if python:
            return python[-1].strip("\n")
        if fences:
            return fences[-1][1].strip("\n")
    m = _CODE_START.search(answer)
    if m:
        return answer[m.start():].strip("\n")
    return None
