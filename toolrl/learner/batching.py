"""Micro-batches: a batch split so each forward/backward stays within a token budget."""
from __future__ import annotations

from toolrl.protocol import Sample


def micro_batches(samples: list[Sample], token_budget: int, share_prompts: bool = False) -> list[list[Sample]]:
    """Split a batch so each micro-batch's cost stays within the token budget.

    Packed rows (share_prompts False) cost rows * longest row, so length-sorted samples are packed
    greedily. With shared prompts a group of samples with one prompt costs the prompt once plus
    rows * longest completion, so a prompt's samples stay together (split only when one group
    alone is over the budget) and whole groups are packed greedily."""
    if not share_prompts:
        order = sorted(samples, key=lambda s: s.num_tokens)
        out: list[list[Sample]] = []
        cur: list[Sample] = []
        for s in order:
            longest = max([s.num_tokens] + [c.num_tokens for c in cur])
            if cur and longest * (len(cur) + 1) > token_budget:
                out.append(cur)
                cur = []
            cur.append(s)
        if cur:
            out.append(cur)
        return out
    by_prompt: dict[tuple, list[Sample]] = {}
    for s in samples:
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(s)
    chunks: list[tuple[int, list[Sample]]] = []  # (cost, samples of one prompt)
    for prompt, group in by_prompt.items():
        cur, longest = [], 0
        for s in sorted(group, key=lambda s: len(s.completion_ids)):
            c = max(longest, len(s.completion_ids))
            if cur and len(prompt) + c * (len(cur) + 1) > token_budget:
                chunks.append((len(prompt) + longest * len(cur), cur))
                cur, c = [], len(s.completion_ids)
            cur.append(s)
            longest = c
        chunks.append((len(prompt) + longest * len(cur), cur))
    out, cur, used = [], [], 0
    for cost, chunk in sorted(chunks, key=lambda c: c[0]):
        if cur and used + cost > token_budget:
            out.append(cur)
            cur, used = [], 0
        cur += chunk
        used += cost
    if cur:
        out.append(cur)
    return out
