"""GRPO, in one place: group advantages, the roles a sample plays in the loss, and the objective.

Advantages are group-relative: each prompt's n samples are scored against each other,
(r - mean) / (std + eps) with the population std (`std: sample` for TRL's n - 1), or r - mean with
`scale_rewards: false` (Dr. GRPO). With `downsample_to` (PODS) the learner keeps the m of each
group's n rollouts whose rewards vary most and scores them against each other.

A sample plays up to three roles: GRPO (a policy sample), teacher SFT (a teacher trace) and self
SFT (the best policy sample of its group that solved the problem). The learner's loss is
    w_grpo * GRPO + w_teacher * SFT(teacher traces) + w_self * SFT(self-chosen samples).

Inputs of the losses are per-token tensors of shape [B, T] over completion positions (right-padded), with
`mask` 1 only where the policy generated the token: tool output and padding never count. Three
policies meet: π_θ (`logp`, the learner now), π_behaviour (the sampler's logprobs, per token: a
rollout interrupted by a weight update holds tokens of two versions, each with its own) and, optionally,
π_old (`old_logp`: the learner's logprobs before the batch's first update, detached).

    base       = π_old if given; else sg(π_θ) with an IS correction on; else π_behaviour
    r          = π_θ / base                                     (per token; GSPO: per sequence)
    policy     = POLICY_LOSSES[loss_type](r, A)                 (clipped surrogate, CISPO, ...)
    w          = IS weight from π_proximal / π_behaviour, π_proximal = π_old or sg(π_θ)   (no gradient)
    per token  = w * policy + beta * k3(ref, θ) - entropy_coef * entropy
    loss       = aggregate(per token)                           (token / sequence / constant normaliser)

What clips: without an IS correction the ratio is π_θ/π_behaviour (or π_θ/π_old when given), so the
clip bounds the whole gap, sampler numerics and staleness included. With one (`tis_cap` or
`vllm_importance_sampling_correction`) and no π_old the ratio is π_θ/sg(π_θ) = 1: nothing clips
(clip_frac is 0 by construction) and the gap is left to w. With π_old the ratio is π_θ/π_old: the
trust region of decoupled PPO (AReaL), 1 at the first update and clipping from the second on.

With gradient accumulation each micro-batch passes the *whole batch's* sequence and token counts,
so the micro-batch losses add up exactly to the full-batch loss. docs/ARCHITECTURE.md, "The
objective", has every formula.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

import torch

from toolrl.config import GRPOConfig
from toolrl.protocol import Sample


# ---------------------------------------------------------------------------------------------
# Advantages

def group_advantages(rewards: list[float], scale: bool = True, eps: float = 1e-4,
                     std: Literal["population", "sample"] = "population") -> list[float]:
    """(r - mean) / (std + eps) as in GRPO, or r - mean when `scale` is False (Dr. GRPO).

    `std`: "population" divides the squared deviations by n (the default, as always here);
    "sample" by n - 1 (Bessel's correction), which is what TRL uses (`nanstd` in its GRPOTrainer).
    A group whose rewards are all equal gets zero advantages: it carries no learning signal
    (callers decide whether to drop it).
    """
    if zero_variance(rewards):  # exactly zero, not float dust: the learner skips zero-advantage samples
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not scale:
        return centred
    dof = len(rewards) - 1 if std == "sample" else len(rewards)  # n >= 2 here: one reward is zero-variance
    sd = math.sqrt(sum(c * c for c in centred) / dof)
    return [c / (sd + eps) for c in centred]


def advantages(rewards: list[float], g: GRPOConfig) -> list[float]:
    """`group_advantages` as the config asks (grpo.scale_rewards, grpo.std): what the worker gives
    each group and the learner each down-sampled group."""
    return group_advantages(rewards, scale=g.scale_rewards, std=g.std)


def zero_variance(rewards: list[float], tol: float = 1e-9) -> bool:
    return max(rewards) - min(rewards) <= tol if rewards else True


def max_variance_subset(rewards: list[float], m: int) -> list[int]:
    """The indices (ascending) of the `m` rewards with the largest variance: PODS's max-variance
    down-sampling (Xu et al. 2025, "Not All Rollouts are Useful"). The best subset is always some
    k highest and m - k lowest rewards, so the m + 1 splits of the sorted rewards are tried; ties go
    to the earliest split, and within equal rewards to the earlier index."""
    if m >= len(rewards):
        return list(range(len(rewards)))
    if m < 1:
        raise ValueError(f"a subset needs at least one sample, got m={m}")
    low = sorted(range(len(rewards)), key=lambda i: (rewards[i], i))
    high = sorted(range(len(rewards)), key=lambda i: (-rewards[i], i))
    best, best_var = None, -1.0
    for k in range(m + 1):  # k from the top, m - k from the bottom
        bottom = low[:m - k]
        taken = set(bottom)
        pick = bottom + [i for i in high if i not in taken][:k]
        vals = [rewards[i] for i in pick]
        mean = sum(vals) / m
        var = sum((v - mean) ** 2 for v in vals) / m
        if var > best_var + 1e-12:
            best, best_var = pick, var
    return sorted(best)


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


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, counts: BatchCounts,
              max_completion_len: int) -> torch.Tensor:
    """Whole-batch normalisers only, so micro-batch losses add up to the batch loss."""
    if how == "token":  # sum over all tokens / tokens in the whole batch (DAPO)
        return masked_sum(per_token, mask) / max(1, counts.tokens)
    if how == "sequence":  # mean over each sequence's tokens, then over the batch's sequences (GRPO)
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(1, counts.sequences)
    if how == "constant":  # sum over all tokens / (sequences * max_completion_len) (Dr. GRPO)
        return masked_sum(per_token, mask) / (max(1, counts.sequences) * max_completion_len)
    raise ValueError(f"unknown aggregation {how!r}")


@dataclass
class PolicyInputs:
    logp: torch.Tensor  # [B, T] log π_θ, with gradient
    base: torch.Tensor  # [B, T] the ratio's denominator (π_old, sg(π_θ) or π_behaviour), no gradient
    adv: torch.Tensor  # [B, 1]
    mask: torch.Tensor  # [B, T] 1.0 where the policy generated the token


# fn(x, cfg) -> (per-token policy loss [B, T], clipped [B, T] bool: the tokens the clip (or cap) held)
PolicyLoss = Callable[[PolicyInputs, GRPOConfig], tuple[torch.Tensor, torch.Tensor]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}
AGGREGATION: dict[str, str] = {}  # loss_type -> how its per-token loss is aggregated


def register_policy_loss(name: str, aggregation: str = "token") -> Callable[[PolicyLoss], PolicyLoss]:
    """Make `fn` the policy loss of `grpo.loss_type: name` (as verl's register_policy_loss). Its per-token
    loss, times the IS weight, plus the KL and entropy terms, is aggregated as `aggregation` ("token",
    "sequence" or "constant"). A new loss is one function here, its name in GRPOConfig.loss_type and
    a test against a reference loop in tests/test_grpo.py."""
    if aggregation not in ("token", "sequence", "constant"):
        raise ValueError(f"unknown aggregation {aggregation!r}")

    def register(fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES[name], AGGREGATION[name] = fn, aggregation
        return fn
    return register


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), clip-higher (DAPO); and where the clip holds."""
    clipped = ratio.clamp(1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    held = ((ratio < 1 - cfg.epsilon_low) & (adv < 0)) | ((ratio > 1 + cfg.epsilon_high) & (adv > 0))
    return loss, held


@register_policy_loss("token", aggregation="token")  # DAPO
@register_policy_loss("sequence", aggregation="sequence")  # GRPO paper
@register_policy_loss("dr_grpo", aggregation="constant")  # Dr. GRPO
def ppo_clip(x: PolicyInputs, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return clipped_surrogate(torch.exp(x.logp - x.base), x.adv, cfg)


@register_policy_loss("gspo", aggregation="sequence")
def gspo(x: PolicyInputs, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025), as TRL's importance_sampling_level="sequence" with loss_type="grpo": one
    ratio per sequence, s = exp(mean over its tokens of (logp - base)), clipped at the sequence level,
    sequence-mean aggregation. The gradient flows through s: each token gets s A / |y| (GSPO-token's
    sg(s) π_θ/sg(π_θ) has the same value and gradient for sequence-level advantages)."""
    n = x.mask.sum(-1, keepdim=True).clamp(min=1)
    s = torch.exp(((x.logp - x.base) * x.mask).sum(-1, keepdim=True) / n)
    loss, held = clipped_surrogate(s, x.adv, cfg)
    return loss.expand_as(x.logp), held.expand_as(x.logp)


@register_policy_loss("cispo", aggregation="token")
def cispo(x: PolicyInputs, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1) as in TRL: -sg(min(r, epsilon_high)) A logp, epsilon_high being an absolute cap
    on r (TRL suggests 5.0), no lower clip, token aggregation. The cap scales tokens, it never drops
    them; counted as clipped where r > cap and A > 0 (TRL's cispo_clip_ratio)."""
    ratio = torch.exp(x.logp.detach() - x.base)
    return -ratio.clamp(max=cfg.epsilon_high) * x.adv * x.logp, (ratio > cfg.epsilon_high) & (x.adv > 0)


def is_correction(cfg: GRPOConfig) -> tuple[str, float | None, float | None] | None:
    """(mode, lo, hi) of the importance-sampling correction, or None. `tis_cap: c` is token_truncate
    with hi = c (the config forbids setting it together with vllm_importance_sampling_correction)."""
    if cfg.tis_cap is not None:
        return "token_truncate", None, cfg.tis_cap
    if cfg.vllm_importance_sampling_correction:
        return (cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_min,
                cfg.vllm_importance_sampling_clip_max)
    return None


def is_weight(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, lo: float | None,
              hi: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The IS weight of each token's policy loss, from log π_proximal/π_behaviour (no gradient), and the
    tokens it masks out. TRL's vllm_importance_sampling_mode, with ρ a token's ratio, ρ_seq the product
    over the sequence's tokens and ρ_geo its geometric mean (verl's geometric rejection sampling):
        token_truncate     clamp(ρ, lo, hi)              token_mask     ρ if lo <= ρ <= hi else 0
        sequence_truncate  clamp(ρ_seq, lo, hi)          sequence_mask  ρ_seq if lo <= ρ_seq <= hi else 0
        geometric_mask     1 if lo <= ρ_geo <= hi else 0 (drops the sequence, does not reweight it)
    """
    if mode.startswith("token"):
        ratio = torch.exp(log_ratio)
    else:
        total = (log_ratio * mask).sum(-1, keepdim=True)
        ratio = torch.exp(total / mask.sum(-1, keepdim=True).clamp(min=1) if mode == "geometric_mask" else total)
    if mode.endswith("truncate"):
        return ratio.clamp(min=lo, max=hi), torch.zeros_like(mask, dtype=torch.bool)
    keep = torch.ones_like(ratio, dtype=torch.bool)
    if lo is not None:
        keep &= ratio >= lo
    if hi is not None:
        keep &= ratio <= hi
    weight = torch.where(keep, torch.ones_like(ratio) if mode == "geometric_mask" else ratio, torch.zeros_like(ratio))
    return weight, (~keep).expand_as(mask)


def grpo_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              cfg: GRPOConfig, counts: BatchCounts, ref_logp: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None,
              old_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of one micro-batch, and detached sums for metrics (divide by tokens).

    `old_logp` (π_old, the learner's logprobs before the batch's first update) is what the ratio is
    taken against when given; without it: sg(logp) when an IS correction is on (ratio 1, nothing
    clips), else the sampler's `behaviour_logp`. The IS weight uses π_old, else sg(logp), against the
    sampler. Metrics: kl_sum, entropy_sum, clip_sum (tokens the clip held), ratio_sum/max/min (per
    token π_θ/π_behaviour, whatever the loss), tokens; with a correction on, mis_masked_tokens.
    """
    mask = mask.to(logp.dtype)
    # Masked positions may hold anything (NaN logprobs for tool output): zero them before exp.
    behaviour_logp = torch.where(mask > 0, behaviour_logp, logp.detach())
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    correction = is_correction(cfg)
    proximal = logp.detach() if old_logp is None else torch.where(mask > 0, old_logp.detach(), logp.detach())
    base = proximal if old_logp is not None or correction is not None else behaviour_logp
    per_token, held = POLICY_LOSSES[cfg.loss_type](PolicyInputs(logp, base, adv, mask), cfg)
    metrics: dict[str, torch.Tensor] = {}
    if correction is not None:
        weight, rejected = is_weight(proximal - behaviour_logp, mask, *correction)
        per_token = per_token * weight
        metrics["mis_masked_tokens"] = masked_sum(rejected.to(logp.dtype), mask)
    if ref_logp is not None and cfg.beta > 0:
        d = torch.where(mask > 0, ref_logp, logp.detach()) - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + cfg.beta * kl
        metrics["kl_sum"] = masked_sum(kl.detach(), mask)
    if entropy is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy
    if entropy is not None:
        metrics["entropy_sum"] = masked_sum(entropy.detach(), mask)
    loss = aggregate(per_token, mask, AGGREGATION[cfg.loss_type], counts, cfg.max_completion_len)
    with torch.no_grad():
        r = torch.exp(logp.detach() - behaviour_logp)
        metrics["clip_sum"] = masked_sum(held.to(logp.dtype), mask)
        metrics["ratio_sum"] = masked_sum(r, mask)
        # no token of the term: ±inf, which the learner's step metrics leave out (never a ±3.4e38)
        metrics["ratio_max"] = torch.where(mask > 0, r, torch.full_like(r, -math.inf)).max()
        metrics["ratio_min"] = torch.where(mask > 0, r, torch.full_like(r, math.inf)).min()
        metrics["tokens"] = mask.sum()
    return loss, metrics


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """Negative log-likelihood of the masked-in tokens (prompt and tool output are out), token mean."""
    return -masked_sum(logp, mask.to(logp.dtype)) / max(1, counts.tokens)
