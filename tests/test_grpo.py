"""The GRPO loss against a plain loop-over-scalars reference, on hand-made tensors."""
import math

import pytest
import torch

from toolrl.config import GRPOConfig
from toolrl.grpo import BatchCounts, Role, group_advantages, grpo_loss, sample_roles, sft_loss, zero_variance
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
