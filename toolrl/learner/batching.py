"""How a batch is cut: into mini-batches (one optimizer step each) and micro-batches (one
forward/backward each, within a token budget); and which groups of it carry a learning signal."""
from __future__ import annotations

from toolrl.grpo import zero_variance
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


def split_mini_batches(samples: list[Sample], n: int) -> list[list[Sample]]:
    """`n` mini-batches of about equal numbers of samples, each group whole (its samples share a
    prompt and a baseline), in the batch's order; fewer when there are fewer groups."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    out: list[list[Sample]] = [[]]
    target = len(samples) / max(1, n)
    for g in groups.values():
        if out[-1] and len(out) < n and len(out[-1]) + len(g) / 2 > target:
            out.append([])
        out[-1] += g
    return out


def with_signal(samples: list[Sample]) -> tuple[list[Sample], int]:
    """DAPO's dynamic sampling: the batch without the policy samples of groups whose rewards are all
    equal (their advantages are zero: no GRPO signal). Teacher traces stay (they carry the SFT term).
    Returns (kept, dropped policy samples)."""
    rewards: dict[str, list[float]] = {}
    for s in samples:
        if s.source == "policy":
            rewards.setdefault(s.group_id, []).append(s.reward)
    flat = {g for g, r in rewards.items() if zero_variance(r)}
    kept = [s for s in samples if s.source != "policy" or s.group_id not in flat]
    return kept, len(samples) - len(kept)
