"""The GRPO loss against a plain loop-over-scalars reference, on hand-made tensors."""
import math
import typing

import pytest
import torch

from toolrl.config import GRPOConfig
from toolrl.grpo import (AGGREGATION, POLICY_LOSSES, BatchCounts, Role, group_advantages, grpo_loss, is_correction,
                         max_variance_subset, sample_roles, sft_loss, zero_variance)
from toolrl.protocol import Sample

# Two sequences, four completion positions. Sequence 0: tokens 0-2 generated, 3 is tool output.
# Sequence 1: tokens 0 and 2 generated, 1 is tool output, 3 is padding.
MASK = [[1, 1, 1, 0], [1, 0, 1, 0]]
LOGP = [[-1.0, -0.5, -2.0, -0.3], [-0.2, -3.0, -1.5, -9.0]]
# Ratios: e^0.5 = 1.65 (high), e^-0.5 = 0.61 (low), e^0.1 = 1.105 (inside), e^-0.05, e^0.4 = 1.49
BEHAV = [[-1.5, 0.0, -2.1, float("nan")], [-0.15, float("nan"), -1.9, float("nan")]]
REF = [[-1.2, -0.4, -2.5, 0.0], [-0.1, 0.0, -1.0, 0.0]]
ADV = [1.0, -2.0]


def reference(cfg: GRPOConfig, with_ref: bool) -> float:
    per_seq, total, n_tok = [], 0.0, 0
    for b in range(2):
        s, n = 0.0, 0
        for t in range(4):
            if not MASK[b][t]:
                continue
            ratio = math.exp(LOGP[b][t] - BEHAV[b][t])
            clipped = min(max(ratio, 1 - cfg.epsilon_low), 1 + cfg.epsilon_high)
            v = -min(ratio * ADV[b], clipped * ADV[b])
            if with_ref:
                d = REF[b][t] - LOGP[b][t]
                v += cfg.beta * (math.exp(d) - d - 1)
            s += v
            n += 1
        per_seq.append(s / n)
        total += s
        n_tok += n
    if cfg.loss_type == "token":
        return total / n_tok
    if cfg.loss_type == "sequence":
        return sum(per_seq) / 2
    return total / (2 * cfg.max_completion_len)


def run(cfg, with_ref):
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    loss, m = grpo_loss(logp, torch.tensor(BEHAV, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64),
                        torch.tensor(MASK), cfg, BatchCounts(sequences=2, tokens=5),
                        ref_logp=torch.tensor(REF, dtype=torch.float64) if with_ref else None)
    return logp, loss, m


@pytest.mark.parametrize("loss_type", ["token", "sequence", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("eps", [(0.2, 0.28), (0.2, 0.2), (0.05, 0.6)])
def test_matches_reference(loss_type, beta, eps):
    cfg = GRPOConfig(loss_type=loss_type, beta=beta, epsilon_low=eps[0], epsilon_high=eps[1], max_completion_len=16)
    _, loss, m = run(cfg, with_ref=beta > 0)
    assert loss.item() == pytest.approx(reference(cfg, beta > 0), rel=1e-12)
    assert m["tokens"].item() == 5


def test_both_clip_sides_counted():
    cfg = GRPOConfig(epsilon_low=0.2, epsilon_high=0.28)
    _, _, m = run(cfg, False)
    # seq 0 (A>0): ratio 1.65 is clipped high; ratio 0.61 is low but A>0, so not clipped.
    # seq 1 (A<0): ratio e^-0.05 is inside; e^0.4 is high but A<0, so not clipped.
    assert m["clip_sum"].item() == 1
    cfg = GRPOConfig(epsilon_low=0.01, epsilon_high=0.01)
    _, _, m = run(cfg, False)
    # now also seq 0 token 2 (1.105 > 1.01, A>0) high and seq 1 token 0 (0.95 < 0.99, A<0) low
    assert m["clip_sum"].item() == 3


def test_clipped_tokens_get_no_gradient_and_masked_positions_none():
    cfg = GRPOConfig(epsilon_low=0.2, epsilon_high=0.28)
    logp, loss, _ = run(cfg, False)
    loss.backward()
    g = logp.grad
    assert g[0, 3] == 0 and g[1, 1] == 0 and g[1, 3] == 0  # tool output and padding
    assert g[0, 0] == 0  # clipped on the high side with A>0: no gradient
    assert g[0, 1] != 0 and g[0, 2] != 0 and g[1, 0] != 0 and g[1, 2] != 0


def test_k3_kl_is_nonnegative_and_zero_at_ref():
    cfg = GRPOConfig(beta=1.0)
    logp = torch.tensor(LOGP, dtype=torch.float64)
    _, m = grpo_loss(logp, logp, torch.zeros(2, dtype=torch.float64), torch.tensor(MASK), cfg,
                     BatchCounts(2, 5), ref_logp=logp.clone())
    assert m["kl_sum"].item() == pytest.approx(0.0, abs=1e-12)
    _, m = grpo_loss(logp, logp, torch.zeros(2, dtype=torch.float64), torch.tensor(MASK), cfg,
                     BatchCounts(2, 5), ref_logp=torch.tensor(REF, dtype=torch.float64))
    assert m["kl_sum"].item() > 0


def test_tis_caps_stale_weights():
    cfg = GRPOConfig(tis_cap=1.2)
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    loss, m = grpo_loss(logp, torch.tensor(BEHAV, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64),
                        torch.tensor(MASK), cfg, BatchCounts(2, 5))
    # value: -(A * min(w, cap)) summed over tokens / 5, since the proximal ratio is exactly 1
    expect = 0.0
    for b in range(2):
        for t in range(4):
            if MASK[b][t]:
                expect += -ADV[b] * min(math.exp(LOGP[b][t] - BEHAV[b][t]), 1.2)
    assert loss.item() == pytest.approx(expect / 5, rel=1e-12)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.5))


def test_a_term_without_tokens_reports_no_ratio_range():
    """±inf, which the learner's step metrics leave out; a finite placeholder (±3.4e38) leaked into them."""
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    _, m = grpo_loss(logp, torch.tensor(BEHAV, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64),
                     torch.zeros_like(torch.tensor(MASK)), GRPOConfig(), BatchCounts(2, 5))
    assert m["ratio_max"].item() == -math.inf and m["ratio_min"].item() == math.inf


def test_micro_batches_add_up_to_full_batch():
    cfg = GRPOConfig(loss_type="token", beta=0.1)
    full = run(cfg, True)[1].item()
    parts = 0.0
    for b in range(2):
        loss, _ = grpo_loss(torch.tensor([LOGP[b]], dtype=torch.float64), torch.tensor([BEHAV[b]], dtype=torch.float64),
                            torch.tensor([ADV[b]], dtype=torch.float64), torch.tensor([MASK[b]]), cfg,
                            BatchCounts(sequences=2, tokens=5), ref_logp=torch.tensor([REF[b]], dtype=torch.float64))
        parts += loss.item()
    assert parts == pytest.approx(full, rel=1e-12)


def test_sft_loss_masks_prompt_and_tool_output():
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    loss = sft_loss(logp, torch.tensor(MASK), BatchCounts(2, 5))
    assert loss.item() == pytest.approx(-(-1.0 - 0.5 - 2.0 - 0.2 - 1.5) / 5)
    loss.backward()
    assert logp.grad[0, 3] == 0 and logp.grad[1, 1] == 0


def test_group_advantages():
    a = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert a == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-3)
    assert group_advantages([1.0, 0.0, 0.0, 1.0], scale=False) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    # exactly zero where the float mean is off by dust (0.1 * 3 / 3 != 0.1): the learner skips
    # zero-advantage samples, and 1e-13 is not zero
    for scale in (True, False):
        assert group_advantages([0.1, 0.1, 0.1], scale=scale) == [0.0, 0.0, 0.0]
        assert group_advantages([1.15] * 5, scale=scale) == [0.0] * 5
    assert zero_variance([0.3, 0.3]) and not zero_variance([0.3, 0.31])
    assert sum(group_advantages([0.1, 0.7, 0.2])) == pytest.approx(0.0, abs=1e-9)


def test_max_variance_subset_is_the_best_of_all_subsets():
    """PODS's down-sampling: the m rewards with the largest variance, checked against every subset."""
    import itertools
    import random
    import statistics

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(2, 9)
        rewards = [rng.choice([0.0, 0.2, 0.4, 1.0, 1.2, 1.4]) for _ in range(n)]
        m = rng.randint(1, n)
        got = max_variance_subset(rewards, m)
        assert len(got) == m and got == sorted(set(got))
        best = max(statistics.pvariance([rewards[i] for i in c]) for c in itertools.combinations(range(n), m))
        assert statistics.pvariance([rewards[i] for i in got]) == pytest.approx(best, abs=1e-12)
    # one right answer among eight: it is kept, beside three wrong ones (the earliest)
    assert max_variance_subset([0.2, 0.2, 1.4, 0.2, 0.2, 0.0, 0.2, 0.2], 4) == [0, 1, 2, 5]
    assert max_variance_subset([1.0, 0.0, 1.0, 0.0, 1.0, 1.0], 2) == [0, 1]
    assert max_variance_subset([0.5] * 5, 3) == [0, 1, 2]  # no variance anywhere: the first m
    assert max_variance_subset([0.1, 0.9], 4) == [0, 1]
    with pytest.raises(ValueError):
        max_variance_subset([0.1, 0.9, 0.3], 0)


def test_roles_and_the_self_sft_choice():
    def s(gid, source="policy", correct=0.0, reward=0.0):
        return Sample(prompt_ids=[1], completion_ids=[2], loss_mask=[1], logprobs=[-0.1], group_id=gid,
                      source=source, rewards={"correct": correct}, reward=reward)

    batch = [s("a", correct=1.0, reward=1.0), s("a", correct=1.0, reward=1.2), s("a"), s("a", "teacher", 1.0, 1.0),
             s("b")]
    roles = sample_roles(batch, with_self=True)
    assert [r[Role.GRPO] for r in roles] == [True, True, True, False, True]
    assert [r[Role.TEACHER] for r in roles] == [False, False, False, True, False]
    # the best solved policy sample of each group; a teacher trace is never chosen, an unsolved group gives none
    assert [r[Role.SELF] for r in roles] == [False, True, False, False, False]
    assert not any(r[Role.SELF] for r in sample_roles(batch, with_self=False))


# ---------------------------------------------------------------------------------------------
# Every loss_type and IS correction against an independent loop over scalars, values and gradients

# π_old, the learner's logprobs before the batch's first update. Against LOGP the ratios are
# seq 0: e^0.3 = 1.35 (A>0: clipped high at eps_high 0.28), e^-0.05, e^-0.1; seq 1: e^0.3, e^-0.3 = 0.74
# (A<0: clipped low at eps_low 0.2). Against BEHAV: e^0.2, e^-0.45, e^0.2; e^-0.35, e^0.7. Masked
# positions are NaN, as the behaviour's are: nothing may read them.
OLD = [[-1.3, -0.45, -1.9, float("nan")], [-0.5, float("nan"), -1.2, float("nan")]]
ENT = [[0.7, 1.1, 0.2, 5.0], [0.4, 5.0, 0.9, 5.0]]


def clamp(x, lo, hi):
    if lo is not None and x < lo:
        return lo
    if hi is not None and x > hi:
        return hi
    return x


def inside(x, lo, hi):
    return (lo is None or x >= lo) and (hi is None or x <= hi)


def reference_full(cfg, logp, old=None, with_ref=False, with_ent=False):
    """(loss, tokens clipped, tokens masked by the IS correction), term by term over 0-d elements of the
    leaf `logp`, so that autograd on the result is the reference gradient. Constants are Python floats."""
    corr = is_correction(cfg)
    lo_eps, hi_eps = 1 - cfg.epsilon_low, 1 + cfg.epsilon_high
    total, per_seq, n_clip, n_masked = torch.zeros((), dtype=torch.float64), [], 0, 0
    for b in range(2):
        toks = [t for t in range(4) if MASK[b][t]]
        a = ADV[b]
        lp = {t: logp[b, t] for t in toks}
        beh = {t: BEHAV[b][t] for t in toks}
        prox = {t: old[b][t] if old is not None else lp[t].item() for t in toks}
        base = prox if old is not None or corr is not None else beh  # the ratio's denominator
        w = {t: 1.0 for t in toks}
        if corr is not None:
            mode, lo, hi = corr
            rho = {t: math.exp(prox[t] - beh[t]) for t in toks}
            seq = math.prod(rho.values())
            geo = seq ** (1 / len(toks))
            for t in toks:
                if mode == "token_truncate":
                    w[t] = clamp(rho[t], lo, hi)
                elif mode == "token_mask":
                    w[t] = rho[t] if inside(rho[t], lo, hi) else 0.0
                elif mode == "sequence_truncate":
                    w[t] = clamp(seq, lo, hi)
                elif mode == "sequence_mask":
                    w[t] = seq if inside(seq, lo, hi) else 0.0
                else:
                    w[t] = 1.0 if inside(geo, lo, hi) else 0.0
                n_masked += mode.endswith("mask") and w[t] == 0.0

        def ppo(r, a=a):
            return -min(r * a, clamp(r, lo_eps, hi_eps) * a), (r < lo_eps and a < 0) or (r > hi_eps and a > 0)

        s = torch.exp(sum(lp[t] - base[t] for t in toks) / len(toks))  # GSPO's sequence ratio
        seq_sum = 0.0
        for t in toks:
            if cfg.loss_type == "gspo":
                v, held = ppo(s)
            elif cfg.loss_type == "cispo":
                r = math.exp(lp[t].item() - base[t])
                v, held = -min(r, cfg.epsilon_high) * a * lp[t], r > cfg.epsilon_high and a > 0
            else:
                v, held = ppo(torch.exp(lp[t] - base[t]))
            v = v * w[t]
            n_clip += bool(held)
            if with_ref:
                d = REF[b][t] - lp[t]
                v = v + cfg.beta * (torch.exp(d) - d - 1)
            if with_ent:
                v = v - cfg.entropy_coef * ENT[b][t]
            seq_sum = seq_sum + v
        total = total + seq_sum
        per_seq.append(seq_sum / len(toks))
    if cfg.loss_type in ("token", "cispo"):
        loss = total / 5
    elif cfg.loss_type in ("sequence", "gspo"):
        loss = (per_seq[0] + per_seq[1]) / 2
    else:
        loss = total / (2 * cfg.max_completion_len)
    return loss, n_clip, n_masked


def run_full(cfg, old=None, with_ref=False, with_ent=False, rows=(0, 1), logp=None):
    r = list(rows)
    logp = torch.tensor([LOGP[b] for b in r], dtype=torch.float64, requires_grad=True) if logp is None else logp
    t64 = lambda x: torch.tensor([x[b] for b in r], dtype=torch.float64)  # noqa: E731
    loss, m = grpo_loss(logp, t64(BEHAV), t64(ADV), torch.tensor([MASK[b] for b in r]), cfg,
                        BatchCounts(sequences=2, tokens=5), ref_logp=t64(REF) if with_ref else None,
                        entropy=t64(ENT) if with_ent else None, old_logp=None if old is None else t64(old))
    return logp, loss, m


LOSSES = {  # (loss_type, epsilon_low, epsilon_high)
    "token": ("token", 0.2, 0.28), "token-tight": ("token", 0.02, 0.03), "sequence": ("sequence", 0.2, 0.28),
    "dr_grpo": ("dr_grpo", 0.2, 0.28), "gspo": ("gspo", 0.2, 0.28), "gspo-tight": ("gspo", 0.02, 0.03),
    "cispo": ("cispo", 0.2, 1.3), "cispo-5": ("cispo", 0.2, 5.0),
}
MODES = {  # config fields, and whether π_old is passed
    "behaviour": ({}, False),
    "old": ({}, True),
    "tis": ({"tis_cap": 1.2}, False),
    "tis+old": ({"tis_cap": 1.2}, True),
    "token_truncate+old": ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": 0.8,
                            "vllm_importance_sampling_clip_max": 1.5}, True),
    "token_mask": ({"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.7,
                    "vllm_importance_sampling_clip_max": 1.3}, False),
    "token_mask+old": ({"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.7,
                        "vllm_importance_sampling_clip_max": 1.3}, True),
    "sequence_truncate": ({"vllm_importance_sampling_mode": "sequence_truncate",
                           "vllm_importance_sampling_clip_max": 1.3}, False),
    "sequence_mask": ({"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 1.3},
                      False),
    "sequence_mask+old": ({"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_min": 0.96,
                           "vllm_importance_sampling_clip_max": 3.0}, True),
    "geometric_mask": ({"vllm_importance_sampling_mode": "geometric_mask", "vllm_importance_sampling_clip_max": 1.1},
                       False),
    "geometric_mask+old": ({"vllm_importance_sampling_mode": "geometric_mask",
                            "vllm_importance_sampling_clip_min": 0.99, "vllm_importance_sampling_clip_max": None},
                           True),
}


def make_cfg(loss, mode, beta=0.0, entropy_coef=0.0):
    loss_type, lo, hi = LOSSES[loss]
    fields, _ = MODES[mode]
    vllm = {"vllm_importance_sampling_correction": True} if "vllm_importance_sampling_mode" in fields else {}
    return GRPOConfig(loss_type=loss_type, epsilon_low=lo, epsilon_high=hi, beta=beta, entropy_coef=entropy_coef,
                      max_completion_len=16, **fields, **vllm)


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("extras", [False, True])
def test_value_gradient_and_counts_match_the_reference(loss, mode, extras):
    cfg = make_cfg(loss, mode, beta=0.1 if extras else 0.0, entropy_coef=0.05 if extras else 0.0)
    old = OLD if MODES[mode][1] else None
    logp, loss_v, m = run_full(cfg, old=old, with_ref=extras, with_ent=extras)
    loss_v.backward()
    leaf = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    expect, n_clip, n_masked = reference_full(cfg, leaf, old=old, with_ref=extras, with_ent=extras)
    expect.backward()
    assert loss_v.item() == pytest.approx(expect.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(logp.grad, leaf.grad, rtol=1e-10, atol=1e-14), (logp.grad, leaf.grad)
    assert m["clip_sum"].item() == n_clip
    assert ("mis_masked_tokens" in m) == (is_correction(cfg) is not None)
    assert m.get("mis_masked_tokens", torch.tensor(0.0)).item() == n_masked
    assert m["tokens"].item() == 5 and m["ratio_max"].item() == pytest.approx(math.exp(0.5))


def test_the_reference_exercises_clipping_and_masking():
    """The cases above are only worth something if clips and masks happen in them (not in every case:
    gspo's loose clip and cispo's cap of 5 hold nothing here, the tight variants do)."""
    seen_clip = {loss_type: 0 for loss_type, _, _ in LOSSES.values()}
    seen_mask = {mode: 0 for mode in MODES if "mask" in mode}
    for loss in LOSSES:
        for mode in MODES:
            cfg = make_cfg(loss, mode)
            old = OLD if MODES[mode][1] else None
            _, n_clip, n_masked = reference_full(cfg, torch.tensor(LOGP, dtype=torch.float64), old=old)
            seen_clip[LOSSES[loss][0]] += n_clip
            if mode in seen_mask:
                seen_mask[mode] += n_masked
    assert all(seen_clip.values()), seen_clip
    assert all(seen_mask.values()), seen_mask


def test_registry_matches_the_config():
    names = set(typing.get_args(GRPOConfig.model_fields["loss_type"].annotation))
    assert set(POLICY_LOSSES) == names == set(AGGREGATION)
    assert AGGREGATION == {"token": "token", "sequence": "sequence", "dr_grpo": "constant", "gspo": "sequence",
                           "cispo": "token"}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("mode", ["behaviour", "tis+old", "sequence_mask", "geometric_mask+old"])
def test_every_loss_adds_up_over_micro_batches(loss, mode):
    cfg = make_cfg(loss, mode, beta=0.1, entropy_coef=0.05)
    old = OLD if MODES[mode][1] else None
    logp, full, _ = run_full(cfg, old=old, with_ref=True, with_ent=True)
    full.backward()
    parts, grads = 0.0, []
    for b in range(2):
        lp, part, _ = run_full(cfg, old=old, with_ref=True, with_ent=True, rows=(b,))
        part.backward()
        parts += part.item()
        grads.append(lp.grad)
    assert parts == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(torch.cat(grads), logp.grad, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# What clips in each mode

@pytest.mark.parametrize("loss", ["token-tight", "gspo-tight", "cispo"])
@pytest.mark.parametrize("mode", ["tis", "token_truncate+old", "sequence_mask"])
def test_with_a_correction_and_no_old_logp_nothing_clips(loss, mode):
    """The ratio is π_θ / sg(π_θ) = 1: clip_frac is 0 by construction, every generated token has gradient."""
    cfg = make_cfg(loss, mode)
    logp, loss_v, m = run_full(cfg)  # token_truncate+old's config, without π_old
    loss_v.backward()
    assert m["clip_sum"].item() == 0
    kept = torch.tensor(MASK).bool()
    if "mask" in mode:  # sequence_mask at 1.3 drops seq 1 (product ratio e^0.35) and nothing else
        kept[1] = False
    assert (logp.grad[kept] != 0).all() and (logp.grad[~kept] == 0).all()


def test_with_old_logp_ratios_away_from_one_clip():
    cfg = GRPOConfig(tis_cap=1.2)
    logp, loss_v, m = run_full(cfg, old=OLD)
    loss_v.backward()
    # seq 0 token 0: π_θ/π_old = e^0.3 > 1.28 with A>0; seq 1 token 2: e^-0.3 < 0.8 with A<0
    assert m["clip_sum"].item() == 2
    assert logp.grad[0, 0] == 0 and logp.grad[1, 2] == 0
    assert logp.grad[0, 1] != 0 and logp.grad[0, 2] != 0 and logp.grad[1, 0] != 0
    # the IS weight is π_old/π_behaviour, capped: token (0, 1) has ratio e^-0.05 and weight e^-0.45
    assert logp.grad[0, 1].item() == pytest.approx(-ADV[0] * math.exp(-0.05) * math.exp(-0.45) / 5, rel=1e-12)


def test_old_logp_equal_to_the_current_logp_is_the_first_update():
    for cfg in (GRPOConfig(tis_cap=1.2), GRPOConfig(loss_type="gspo", tis_cap=1.2),
                GRPOConfig(loss_type="cispo", epsilon_high=1.3, vllm_importance_sampling_correction=True)):
        logp, loss_a, m_a = run_full(cfg, old=LOGP)
        loss_a.backward()
        logp_b, loss_b, m_b = run_full(cfg)
        loss_b.backward()
        assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-15)
        assert torch.equal(logp.grad, logp_b.grad) and m_a["clip_sum"] == m_b["clip_sum"] == 0


def test_without_correction_old_logp_replaces_the_sampler_in_the_ratio():
    logp, loss_v, m = run_full(GRPOConfig(), old=OLD)
    # surrogate against OLD, no weight: seq 0 token 0 clipped at 1.28, seq 1 token 2 clipped at 0.8
    expect = (-(1.28 * 1) - math.exp(-0.05) - math.exp(-0.1) + 2 * math.exp(0.3) + 2 * 0.8) / 5
    assert loss_v.item() == pytest.approx(expect, rel=1e-12)
    assert m["clip_sum"].item() == 2


# ---------------------------------------------------------------------------------------------
# Signs and gradients, by hand

def test_tis_weight_scales_the_gradient_and_carries_none():
    """The ratio is 1 in value with gradient 1, so d loss / d logp = -A w / tokens exactly, w the capped
    weight: a weight that carried gradient would add -A w' to uncapped tokens."""
    for cap in (1.2, 100.0):
        logp, loss_v, _ = run_full(GRPOConfig(tis_cap=cap))
        loss_v.backward()
        for b in range(2):
            for t in range(4):
                w = min(math.exp(LOGP[b][t] - BEHAV[b][t]), cap) if MASK[b][t] else 0.0
                assert logp.grad[b, t].item() == pytest.approx(-ADV[b] * w / 5, rel=1e-12, abs=1e-15)


def test_gspo_gives_each_token_its_sequence_ratio_over_length():
    logp, loss_v, _ = run_full(make_cfg("gspo", "behaviour"))
    loss_v.backward()
    s0, s1 = math.exp(0.1 / 3), math.exp(0.35 / 2)  # 1.034 and 1.191, both inside the clip
    assert loss_v.item() == pytest.approx((-1 * s0 + 2 * s1) / 2, rel=1e-12)
    for t in (0, 1, 2):
        assert logp.grad[0, t].item() == pytest.approx(-1 * s0 / 3 / 2, rel=1e-12)
    for t in (0, 2):
        assert logp.grad[1, t].item() == pytest.approx(2 * s1 / 2 / 2, rel=1e-12)
    # a clip of 0.02 holds seq 0 (1.034 > 1.02, A>0): no gradient on any of its tokens, 3 tokens counted
    logp, loss_v, m = run_full(make_cfg("gspo-tight", "behaviour"))
    loss_v.backward()
    assert (logp.grad[0] == 0).all() and m["clip_sum"].item() == 3


def test_cispo_caps_the_ratio_absolutely_and_keeps_every_gradient():
    logp, loss_v, m = run_full(make_cfg("cispo", "behaviour"))  # cap 1.3: e^0.5 and e^0.4 are capped
    loss_v.backward()
    for b in range(2):
        for t in range(4):
            if MASK[b][t]:
                w = min(math.exp(LOGP[b][t] - BEHAV[b][t]), 1.3)
                assert logp.grad[b, t].item() == pytest.approx(-ADV[b] * w / 5, rel=1e-12)
    assert m["clip_sum"].item() == 1  # TRL counts r > cap with A > 0 only: seq 0 token 0
    with pytest.raises(ValueError, match="absolute cap"):
        GRPOConfig(loss_type="cispo")  # epsilon_high 0.28 would cap every ratio below 1


def _entropy_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 4, 6, dtype=torch.float64, generator=g).mul(3).requires_grad_(True)
    tokens = torch.randint(0, 6, (2, 4), generator=g)

    def forward():
        lp_all = torch.log_softmax(logits, -1)
        return lp_all.gather(-1, tokens[..., None])[..., 0], -(lp_all.exp() * lp_all).sum(-1)
    return logits, forward


@pytest.mark.parametrize("loss", ["token", "sequence", "dr_grpo", "gspo", "cispo"])
def test_entropy_bonus_raises_entropy(loss):
    """A gradient step on the logits lowers the loss by raising entropy (advantages 0: the bonus alone)."""
    cfg = make_cfg(loss, "behaviour", entropy_coef=0.5)
    logits, forward = _entropy_model()
    mask = torch.tensor(MASK, dtype=torch.float64)

    def loss_and_entropy():
        logp, ent = forward()
        loss_v, m = grpo_loss(logp, logp.detach(), torch.zeros(2, dtype=torch.float64), mask, cfg, BatchCounts(2, 5),
                              entropy=ent)
        return loss_v, m["entropy_sum"].item() / 5

    loss0, h0 = loss_and_entropy()
    assert loss0.item() < 0  # -entropy_coef * (mean entropy) with a positive entropy
    loss0.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    loss1, h1 = loss_and_entropy()
    assert h1 > h0 and loss1.item() < loss0.item()


def test_entropy_term_value():
    logp, loss_e, m = run_full(GRPOConfig(entropy_coef=0.5), with_ent=True)
    _, loss_0, _ = run_full(GRPOConfig())
    h = sum(ENT[b][t] for b in range(2) for t in range(4) if MASK[b][t])
    assert m["entropy_sum"].item() == pytest.approx(h)
    assert loss_e.item() - loss_0.item() == pytest.approx(-0.5 * h / 5, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Masked importance sampling, by hand (old_logp None: the surrogate ratio is 1, the loss is -A w)

def test_sequence_mask_drops_whole_sequences():
    cfg = make_cfg("token", "sequence_mask")  # product ratios: seq 0 e^0.1 kept, seq 1 e^0.35 > 1.3 dropped
    logp, loss_v, m = run_full(cfg)
    loss_v.backward()
    assert loss_v.item() == pytest.approx(-1 * math.exp(0.1) * 3 / 5, rel=1e-12)
    assert m["mis_masked_tokens"].item() == 2 and (logp.grad[1] == 0).all() and (logp.grad[0, :3] != 0).all()


def test_geometric_mask_keeps_what_the_product_drops():
    """Geometric means: seq 0 e^(0.1/3) = 1.034, seq 1 e^(0.35/2) = 1.191; seq 1's product e^0.35 = 1.42."""
    def loss_at(**bounds):
        cfg = GRPOConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="geometric_mask",
                         **bounds)
        _, loss_v, m = run_full(cfg)
        return loss_v.item(), m["mis_masked_tokens"].item()

    assert loss_at(vllm_importance_sampling_clip_max=1.3) == pytest.approx((-(1 * 3 - 2 * 2) / 5, 0))  # weight 1
    assert loss_at(vllm_importance_sampling_clip_max=1.1) == pytest.approx((-3 / 5, 2))
    assert loss_at(vllm_importance_sampling_clip_min=1.05, vllm_importance_sampling_clip_max=None) == \
        pytest.approx((4 / 5, 3))


def test_token_mask_zeroes_tokens_outside():
    cfg = make_cfg("token", "token_mask")  # [0.7, 1.3]: e^0.1 and e^-0.05 stay; e^0.5, e^-0.5, e^0.4 go
    _, loss_v, m = run_full(cfg)
    assert loss_v.item() == pytest.approx((-1 * math.exp(0.1) + 2 * math.exp(-0.05)) / 5, rel=1e-12)
    assert m["mis_masked_tokens"].item() == 3


def test_mask_bounds_are_inclusive():
    """As TRL: a ratio equal to a bound is kept. Here every ratio is exactly 1 (behaviour = π_θ)."""
    for mode in ("token_mask", "sequence_mask", "geometric_mask"):
        cfg = GRPOConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                         vllm_importance_sampling_clip_min=1.0, vllm_importance_sampling_clip_max=1.0)
        logp = torch.tensor(LOGP, dtype=torch.float64)
        loss_v, m = grpo_loss(logp, logp, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK), cfg,
                              BatchCounts(2, 5))
        assert m["mis_masked_tokens"].item() == 0 and loss_v.item() == pytest.approx((-3 + 4) / 5)


# ---------------------------------------------------------------------------------------------
# Advantages' std, and the config

def test_group_advantages_population_and_sample_std():
    # [3, 1, 2]: mean 2, deviations [1, -1, 0]; population std sqrt(2/3) = 0.8164966, sample std sqrt(2/2) = 1
    assert group_advantages([3.0, 1.0, 2.0]) == pytest.approx([1.2245949, -1.2245949, 0.0], abs=1e-7)
    assert group_advantages([3.0, 1.0, 2.0], std="population") == group_advantages([3.0, 1.0, 2.0])
    assert group_advantages([3.0, 1.0, 2.0], std="sample") == pytest.approx([0.99990001, -0.99990001, 0.0], abs=1e-8)
    # [1, 0]: deviations ±0.5; population std 0.5, sample std 0.7071068
    assert group_advantages([1.0, 0.0], std="sample") == pytest.approx([0.7070068, -0.7070068], abs=1e-7)
    assert group_advantages([1.0, 0.0], std="sample", scale=False) == [0.5, -0.5]
    assert group_advantages([0.4], std="sample") == [0.0] and group_advantages([0.4, 0.4], std="sample") == [0.0, 0.0]


def test_config_defaults_and_checks():
    cfg = GRPOConfig()
    assert (cfg.loss_type, cfg.std, cfg.tis_cap, cfg.vllm_importance_sampling_correction) == \
        ("token", "population", None, False)
    with pytest.raises(ValueError, match="not both"):
        GRPOConfig(tis_cap=2.0, vllm_importance_sampling_correction=True)
    with pytest.raises(ValueError, match="needs"):
        GRPOConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
                   vllm_importance_sampling_clip_max=None)
    with pytest.raises(ValueError, match="above"):
        GRPOConfig(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.5)
    with pytest.raises(ValueError):
        GRPOConfig(std="bessel")
    GRPOConfig(loss_type="cispo", epsilon_high=5.0)
    GRPOConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_mask",
               vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=None)
    with pytest.raises(ValueError, match="unbounded"):  # a sequence's ratio overflows without an upper bound
        GRPOConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
                   vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=None)
