"""Group-relative advantages: each prompt's n samples are scored against each other."""
from __future__ import annotations

import math


def group_advantages(rewards: list[float], scale: bool = True, eps: float = 1e-4) -> list[float]:
    """(r - mean) / (std + eps) as in GRPO, or r - mean when `scale` is False (Dr. GRPO).

    The std is the population std of the group. A group whose rewards are all equal gets zero
    advantages: it carries no learning signal (callers decide whether to drop it).
    """
    if zero_variance(rewards):  # exactly zero, not float dust: the learner skips zero-advantage samples
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not scale:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]


def zero_variance(rewards: list[float], tol: float = 1e-9) -> bool:
    return max(rewards) - min(rewards) <= tol if rewards else True
