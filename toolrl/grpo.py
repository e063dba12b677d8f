"""The GRPO objective, in one place.

Inputs are per-token tensors of shape [B, T] over completion positions (right-padded), with
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

from dataclasses import dataclass

import torch

from toolrl.config import GRPOConfig


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
