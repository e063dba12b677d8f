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
