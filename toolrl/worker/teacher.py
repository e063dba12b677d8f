"""Teacher traces, learned by the SFT term: programmatic for the built-in arithmetic task, and for
code tasks a collected trace (toolrl.tasks.code.traces) or the data's reference solution.

The generator knows the exact expression behind every problem, so the teacher writes the ideal
trace: the calculation in words, a `<program>` with a python fence that computes the answer, the marker
line, the program's real output *from the executor service*, and `<answer>\\boxed{N}</answer>`.
The trace is built from the same pieces as a rollout (prompt ids with the prefill, model
segments, a tool segment tokenised by `tool_segment_ids`), so it teaches exactly the token layout
rollouts produce, and the tool output is masked out of the SFT loss like any tool output.
Wording and program style vary so the model learns the behaviour, not one string.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from toolrl.tasks.data import Problem
from toolrl.format import STOP_MARKER
from toolrl.protocol import Sample
from toolrl.worker.rollout import Tool, tool_output_text, tool_segment_ids

# The plan states the calculation in words before the program: choosing the operation from the
# question ("sells" -> minus) is what a model that has the format still gets wrong (docs/RESULTS.md).
_PLAN = [
    "I need {words}.",
    "The question asks for {words}.",
    "So the calculation is {words}.",
    "That is {words}.",
]
_REASONING = [
    "I will compute it with Python.",
    "Let me write the calculation as a program instead of doing it in my head.",
    "The numbers are large, so I will let Python do the arithmetic.",
    "I will turn this into an expression and run it.",
    "I will use Python to get the exact number.",
]
_CONCLUSION = [
    "The program printed {n}, so the answer is {n}.",
    "So the result is {n}.",
    "The computation gives {n}.",
    "Python says {n}, which answers the question.",
]
_WORDS = {"*": "times", "+": "plus", "-": "minus"}


def expression_in_words(expr: str) -> str:
    """'148 * 36 - 2915' -> '148 times 36, minus 2915': the plan a teacher states before coding."""
    out = []
    for tok in expr.replace("(", "( ").replace(")", " )").split():
        if tok in ("+", "-") and out:
            out[-1] += ","
        out.append(_WORDS.get(tok, tok))
    return " ".join(out).replace("( ", "(").replace(" )", ")").replace(",)", ")")


def teacher_program(problem: Problem, rng: random.Random) -> str:
    """The program that solves the problem, in one of a few styles."""
    expr = problem.meta["expression"]
    nums = problem.meta["numbers"]
    style = rng.randrange(3)
    if style == 0:
        return f"print({expr})"
    if style == 1:
        return f"result = {expr}\nprint(result)"
    names = {k: f"{k}_value" if rng.random() < 0.5 else k for k in nums}
    lines = [f"{names[k]} = {v}" for k, v in nums.items()]
    body = expr
    for k, v in sorted(nums.items(), key=lambda kv: -len(str(kv[1]))):  # replace longer numbers first
        body = body.replace(str(v), names[k], 1)
    return "\n".join(lines + [f"total = {body}", "print(total)"])


async def teacher_sample(problem: Problem, prompt_ids: list[int], tokenizer, tool: Tool, max_tool_output_tokens: int,
                         rng: random.Random, group_id: str, policy_version: int) -> Sample | None:
    """One ideal trace as a Sample (source 'teacher'); None if the executor's output disagrees with
    the known answer (then there is nothing to teach)."""
    if problem.program is None or "expression" not in problem.meta:
        return None
    code = teacher_program(problem, rng)
    plan = rng.choice(_PLAN).format(words=expression_in_words(problem.meta["expression"]))
    head = f"{plan} {rng.choice(_REASONING)}\n<program>\n```python\n{code}\n```\n</program>\n{STOP_MARKER}"
    call = await tool.run(code, None)
    if call.status != "ok" or call.output.strip() != problem.answer:
        return None
    n = call.output.strip()
    tail = f"{rng.choice(_CONCLUSION).format(n=n)}\n</think>\n<answer>\n\\boxed{{{n}}}\n</answer>"
    head_ids = tokenizer.encode(head, add_special_tokens=False)
    tool_ids = tool_segment_ids(tokenizer, tool_output_text(call), max_tool_output_tokens)
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        tail_ids.append(tokenizer.eos_token_id)  # the trace ends the turn, as a finished rollout does
    ids = head_ids + tool_ids + tail_ids
    mask = [1] * len(head_ids) + [0] * len(tool_ids) + [1] * len(tail_ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return Sample(prompt_ids=prompt_ids, completion_ids=ids, loss_mask=mask,
                  logprobs=[0.0 if m else None for m in mask],  # not sampled: never used as behaviour logprobs
                  rewards={"correct": 1.0}, reward=1.0, advantage=0.0, group_id=group_id,
                  policy_version=policy_version, source="teacher", stop_reason="eos", tool_calls=[call], text=text)


_CODE_THINKING = [
    "I will write the function directly and make sure it handles the edge cases.",
    "Let me work out the approach, then write the complete solution.",
    "The task is clear; here is a straightforward implementation.",
]


def load_code_traces(path: str | None) -> dict[str, list[dict]]:
    """Collected traces by problem id (jsonl rows with id, thinking, code; see teacher_traces)."""
    if not path:
        return {}
    traces: dict[str, list[dict]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"teacher.traces_path: cannot read {path}: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"teacher.traces_path {path}:{n}: not a trace row: {exc}") from None
            if not isinstance(row, dict) or not {"id", "code"} <= set(row):
                raise ValueError(f"teacher.traces_path {path}:{n}: not a trace row (needs id and code)")
            traces.setdefault(row["id"], []).append(row)
    return traces


def code_teacher_sample(problem: Problem, prompt_ids: list[int], tokenizer, traces: dict[str, list[dict]],
                        rng: random.Random, group_id: str, policy_version: int, prefill: str = "") -> Sample | None:
    """A code task's ideal answer in the layout prompts/code.txt asks for: thinking, then one
    python block. None when there is neither a collected trace nor a reference solution."""
    if problem.id in traces:
        row = rng.choice(traces[problem.id])
        thinking, code = row.get("thinking") or rng.choice(_CODE_THINKING), row["code"]
    elif problem.program:
        thinking, code = rng.choice(_CODE_THINKING), problem.program
    else:
        return None
    text = f"<think>\n{thinking.strip()}\n</think>\n```python\n{code.strip()}\n```"
    if prefill and text.startswith(prefill):
        text = text[len(prefill):]  # the prompt already ends with the prefill
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return Sample(prompt_ids=prompt_ids, completion_ids=ids, loss_mask=[1] * len(ids),
                  logprobs=[0.0] * len(ids), rewards={"correct": 1.0}, reward=1.0, advantage=0.0,
                  group_id=group_id, policy_version=policy_version, source="teacher", stop_reason="eos",
                  tool_calls=[], text=prefill + text)
