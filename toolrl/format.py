"""Small text parsers shared by data loaders, rewards and the rollout loop."""
from __future__ import annotations

import re


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


def gsm8k_answer(solution: str) -> str | None:
    """GSM8K keeps the final answer after '####'; commas are thousands separators."""
    if "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_PROGRAM = re.compile(r"<program>(.*?)(?:</program>|\Z)", re.S)


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
    blocks = code_blocks(segment)
    for lang, code in reversed(blocks):
        if lang in ("python", "py", "python3"):
            return code.strip("\n") or None
    for lang, code in reversed(blocks):
        if lang not in ("output", "text"):
            return code.strip("\n") or None
    progs = _PROGRAM.findall(segment)
    if progs and progs[-1].strip():
        return progs[-1].strip("\n")
    return None
