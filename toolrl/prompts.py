"""System prompts (prompts/*.txt) and the one definition of the tool-call layout they teach.

A prompt file is a system prompt, optionally followed by worked examples that become real chat
turns (a small model follows an example turn far better than an example described in the
system prompt):

    <system text>
    ### example user
    <question>
    ### example assistant
    <ideal answer>

The tags and the stop marker the examples use are defined in toolrl.format.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"
_SECTION = re.compile(r"^### example (user|assistant)\s*$", re.M)


@dataclass
class ChatPrompt:
    system: str
    examples: list[tuple[str, str]] = field(default_factory=list)

    def messages(self, question: str) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}]
        for user, assistant in self.examples:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return msgs + [{"role": "user", "content": question}]

    def ids(self, tokenizer, question: str, prefill: str = "") -> list[int]:
        """The chat template with the generation prompt, then the prefill, as token ids: the prompt of
        every rollout, kept as ids from here on (nothing is re-tokenised between turns)."""
        ids = tokenizer.apply_chat_template(self.messages(question), add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return ids + (tokenizer.encode(prefill, add_special_tokens=False) if prefill else [])


def available() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.txt"))


def load_prompt(name: str) -> str:
    """A prompt file's raw text, by name (a file under prompts/, without .txt) or by path."""
    path = Path(name)
    if not path.is_file():
        path = PROMPTS_DIR / f"{name}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"unknown prompt {name!r}; available: {', '.join(available())}")
    return path.read_text().strip()


def load_chat_prompt(name: str) -> ChatPrompt:
    parts = _SECTION.split(load_prompt(name))
    system, rest = parts[0].strip(), parts[1:]
    examples, user = [], None
    for role, text in zip(rest[::2], rest[1::2]):
        if role == "user":
            user = text.strip()
        elif user is None:
            raise ValueError(f"prompt {name!r}: an example assistant turn without a user turn")
        else:
            examples.append((user, text.strip()))
            user = None
    if user is not None:
        raise ValueError(f"prompt {name!r}: an example user turn without an assistant turn")
    return ChatPrompt(system, examples)
