"""How a batch is gathered (from the reference server, with DAPO's dynamic sampling) and cut: into
mini-batches (one optimizer step each) and micro-batches (one forward/backward each, within a token
budget)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from toolrl.config import GRPOConfig
from toolrl.grpo import advantages, max_variance_subset, zero_variance
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


def downsample(samples: list[Sample], g: GRPOConfig) -> tuple[list[Sample], int]:
    """PODS (`grpo.downsample_to`): each group's policy samples cut to the `downsample_to` whose
    rewards vary most, their advantages recomputed over the kept ones (the others no longer count
    in the group's baseline, and their advantage is set to 0: they are not trained). Teacher traces
    and smaller groups stay as they are; the batch keeps its order. Returns (kept, left out).
    The reference server hands out samples up to the learner's token budget, so a group can arrive
    split over two batches; each part is cut on its own (a part of `downsample_to` or fewer keeps the
    worker's advantages). Size `learner.batch_tokens` to hold a batch of whole groups."""
    m = g.downsample_to
    if m is None:
        return samples, 0
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        if s.source == "policy":
            groups.setdefault(s.group_id, []).append(s)
    out: set[int] = set()
    for group in groups.values():
        if len(group) <= m:
            continue
        keep = [group[i] for i in max_variance_subset([s.reward for s in group], m)]
        kept = {id(s) for s in keep}
        for s in group:
            if id(s) not in kept:  # not trained: no advantage (the signal metrics count it so)
                s.advantage = 0.0
                out.add(id(s))
        for s, a in zip(keep, advantages([s.reward for s in keep], g)):
            s.advantage = a
    return [s for s in samples if id(s) not in out], len(out)


@dataclass
class Gathered:
    samples: list[Sample]
    drawn: int  # samples taken from the reference server
    dropped: int  # policy samples left out by dynamic sampling


def gather_batch(draw: Callable[[int, int], list[Sample]], want: int, token_budget: int, deadline: float,
                 dynamic_sampling: bool = False, max_draws: int = 1, what: str = "the reference server",
                 clock: Callable[[], float] = time.time) -> Gathered:
    """A step's batch: pieces drawn until it holds `want` samples or `token_budget` tokens.
    `draw(max_samples, max_tokens)` returns the next piece (possibly empty after its own wait).
    With dynamic sampling (DAPO) groups without reward variance are left out and more are drawn,
    until max_draws * want samples have been drawn; then the step trains on what has signal (at
    least one piece of it). Past `deadline` with the batch still short, the run stops: a learner
    waiting for ever on dead workers helps nobody."""
    got = Gathered([], 0, 0)
    while len(got.samples) < want:
        if clock() > deadline:
            why = (f" ({got.drawn} drawn, {got.dropped} left out by dynamic sampling: their groups had no "
                   f"reward variance)") if got.dropped else ""
            raise SystemExit(f"{len(got.samples)}/{want} samples from {what} before the batch deadline{why}")
        if dynamic_sampling and got.samples and got.drawn >= max_draws * want:
            break
        used = sum(s.num_tokens for s in got.samples)
        if got.samples and used >= token_budget:
            break  # the token budget is full before the sample count
        piece = draw(want - len(got.samples), token_budget - used)
        got.drawn += len(piece)
        if dynamic_sampling:
            piece, n = with_signal(piece)
            got.dropped += n
        got.samples += piece
    return got
