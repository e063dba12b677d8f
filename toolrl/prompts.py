"""System prompts (prompts/*.txt) and the one definition of the tool-call layout they teach.

The rollout engine, the teacher traces and the rewards all use these constants, so the layout the
model is taught, the layout rollouts produce and the layout rewards parse cannot drift apart.
"""
from __future__ import annotations

from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"

STOP_MARKER = "The result of executing this Python code is:"
PROGRAM_OPEN, PROGRAM_CLOSE = "<program>", "</program>"
OUTPUT_FENCE = "```output"


def format_tool_result(output: str) -> str:
    """The text inserted after the stop marker: the executor's output in an output fence."""
    body = output if output.endswith("\n") or not output else output + "\n"
    return f"\n{OUTPUT_FENCE}\n{body}```\n"


def available() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.txt"))


def load_prompt(name: str) -> str:
    """A prompt by name (a file under prompts/, without .txt) or by path."""
    path = Path(name)
    if not path.is_file():
        path = PROMPTS_DIR / f"{name}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"unknown prompt {name!r}; available: {', '.join(available())}")
    return path.read_text().strip()
