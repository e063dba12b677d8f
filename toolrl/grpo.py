"""GRPO, in one place: group advantages, the roles a sample plays in the loss, and the objective.

Advantages are group-relative: each prompt's n samples are scored against each other,
(r - mean) / (std + eps), or r - mean with `scale_rewards: false` (Dr. GRPO).

A sample plays up to three roles: GRPO (a policy sample), teacher SFT (a teacher trace) and self
SFT (the best policy sample of its group that solved the problem). The learner's loss is
    w_grpo * GRPO + w_teacher * SFT(teacher traces) + w_self * SFT(self-chosen samples).

Inputs of the losses are per-token tensors of shape [B, T] over completion positions (right-padded), with
`mask` 1 only where the policy generated the token: tool output and padding never count.

    ratio      = exp(logp - behaviour_logp)                   (behaviour: the sampler's logprobs)
    surrogate  = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)     (clip-higher)
    kl (k3)    = exp(ref - logp) - (ref - logp) - 1                            (weight beta)
    per token  = -surrogate + beta * kl - entropy_coef * entropy

Truncated importance sampling (`tis_cap`): the clipped ratio is taken against the learner's own
current logprobs (detached), and the gap to the sampler (staleness, vLLM-vs-learner numerics) is
corrected by the weight min(exp(logp.detach() - behaviour_logp), tis_cap) on each token.

Aggregation (`loss_type`):
    token    sum over all tokens / tokens in the whole batch              (DAPO)
    sequence mean over each sequence's tokens, then mean over sequences   (GRPO paper)
    dr_grpo  sum over all tokens / (sequences * max_completion_len)       (Dr. GRPO)

With gradient accumulation each micro-batch passes the *whole batch's* sequence and token counts,
so the micro-batch losses add up exactly to the full-batch loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch

from toolrl.config import GRPOConfig
from toolrl.protocol import Sample


# ---------------------------------------------------------------------------------------------
# Advantages

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


# ---------------------------------------------------------------------------------------------
# Roles

class Role(IntEnum):
    GRPO = 0  # a policy sample, trained by the clipped surrogate
    TEACHER = 1  # a teacher trace, trained by SFT (w_teacher)
    SELF = 2  # the best solved policy sample of its group, trained by SFT as well (w_self)


def self_sft_choice(samples: list[Sample]) -> set[int]:
    """Per group, the best sample that solved the problem (reward component 'correct' == 1)."""
    best: dict[str, tuple[float, int]] = {}
    for i, s in enumerate(samples):
        if s.source != "policy" or s.rewards.get("correct", 0.0) < 1.0:
            continue
        if s.group_id not in best or s.reward > best[s.group_id][0]:
            best[s.group_id] = (s.reward, i)
    return {i for _, i in best.values()}


def sample_roles(samples: list[Sample], with_self: bool) -> list[tuple[bool, bool, bool]]:
    """Each sample's roles, indexed by Role."""
    chosen = self_sft_choice(samples) if with_self else set()
    return [(s.source == "policy", s.source == "teacher", i in chosen) for i, s in enumerate(samples)]


# ---------------------------------------------------------------------------------------------
# The objective


@dataclass
class BatchCounts:
    sequences: int
    tokens: int


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, counts: BatchCounts,
              max_completion_len: int) -> torch.Tensor:
    if loss_type == "token":
        return masked_sum(per_token, mask) / max(1, counts.tokens)
    if loss_type == "sequence":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(1, counts.sequences)
    if loss_type == "dr_grpo":
        return masked_sum(per_token, mask) / (max(1, counts.sequences) * max_completion_len)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def grpo_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              cfg: GRPOConfig, counts: BatchCounts, ref_logp: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of one micro-batch, and detached sums for metrics (divide by tokens)."""
    mask = mask.to(logp.dtype)
    # Masked positions may hold anything (NaN logprobs for tool output): zero them before exp.
    behaviour_logp = torch.where(mask > 0, behaviour_logp, logp.detach())
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    if cfg.tis_cap is None:
        log_ratio = logp - behaviour_logp
        weight = None
    else:
        log_ratio = logp - logp.detach()
        weight = torch.exp(logp.detach() - behaviour_logp).clamp(max=cfg.tis_cap)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if weight is not None:
        per_token = per_token * weight
    metrics: dict[str, torch.Tensor] = {}
    if ref_logp is not None and cfg.beta > 0:
        d = torch.where(mask > 0, ref_logp, logp.detach()) - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + cfg.beta * kl
        metrics["kl_sum"] = masked_sum(kl.detach(), mask)
    if entropy is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy
    if entropy is not None:
        metrics["entropy_sum"] = masked_sum(entropy.detach(), mask)
    loss = aggregate(per_token, mask, cfg.loss_type, counts, cfg.max_completion_len)
    with torch.no_grad():
        r = ratio.detach() if weight is None else torch.exp(logp.detach() - behaviour_logp)
        is_clipped = ((ratio < 1 - cfg.epsilon_low) & (adv < 0)) | ((ratio > 1 + cfg.epsilon_high) & (adv > 0))
        metrics["clip_sum"] = masked_sum(is_clipped.to(logp.dtype), mask)
        metrics["ratio_sum"] = masked_sum(r, mask)
        big = torch.finfo(r.dtype).max
        metrics["ratio_max"] = torch.where(mask > 0, r, torch.full_like(r, -big)).max()
        metrics["ratio_min"] = torch.where(mask > 0, r, torch.full_like(r, big)).min()
        metrics["tokens"] = mask.sum()
    return loss, metrics


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Negative log-likelihood of the masked-in tokens (prompt and tool output are out), token mean."""
    return -masked_sum(logp, mask.to(logp.dtype)) / max(1, counts.tokens)
