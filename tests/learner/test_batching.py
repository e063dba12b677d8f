"""Gathering a batch (dynamic sampling, token budget, deadline) and cutting it into micro-batches."""
import time

import pytest

from toolrl.learner.batching import micro_batches
from toolrl.protocol import Sample


def test_shared_prompt_micro_batches_keep_groups_whole_within_budget():
    def smp(prompt, c):
        return Sample(prompt_ids=[prompt] * 300, completion_ids=[1] * c, loss_mask=[1] * c, logprobs=[0.0] * c,
                      group_id=str(prompt))

    batch = [smp(p, 20 + 37 * ((p * 7 + i) % 5)) for p in range(6) for i in range(5)]
    mbs = micro_batches(batch, 1000, share_prompts=True)
    assert sorted(map(id, (s for mb in mbs for s in mb))) == sorted(map(id, batch))  # each sample once
    for mb in mbs:
        groups = {}
        for s in mb:
            groups.setdefault(s.prompt_ids[0], []).append(len(s.completion_ids))
        cost = sum(300 + len(cs) * max(cs) for cs in groups.values())
        assert cost <= 1000
    # each group (completions 20..168) costs 300 + 5 * 168 > 1000: split into 4 (824) + 1 (468);
    # then two 468-chunks of different prompts share a micro-batch
    assert sorted(len(mb) for mb in mbs) == [2, 2, 2] + [4] * 6
    assert len(micro_batches(batch, 5000, share_prompts=True)) == 2  # whole groups (1140 each), greedy
    assert len(micro_batches(batch, 10**6, share_prompts=True)) == 1


def group(gid, rewards, n_tokens=10):
    return [Sample(prompt_ids=[1] * 4, completion_ids=[2] * (n_tokens - 4), loss_mask=[1] * (n_tokens - 4),
                   logprobs=[0.0] * (n_tokens - 4), reward=r, group_id=gid) for r in rewards]


class Pieces:
    """What the reference server hands out, piece by piece, as the learner's draw() sees it."""

    def __init__(self, *pieces):
        self.pieces, self.asked = list(pieces), []

    def __call__(self, n, tokens):
        self.asked.append((n, tokens))
        return self.pieces.pop(0) if self.pieces else []


def test_a_batch_is_gathered_until_full_and_dynamic_sampling_draws_past_flat_groups():
    from toolrl.learner.batching import gather_batch

    flat, signal = group("a", [1, 1, 1, 1]), group("b", [0, 1, 0, 1])
    # without dynamic sampling, the first 8 samples drawn are the batch, flat group and all
    draw = Pieces(flat, signal, group("c", [0, 1, 1, 1]))
    got = gather_batch(draw, want=8, token_budget=10_000, deadline=float("inf"))
    assert [s.group_id for s in got.samples] == ["a"] * 4 + ["b"] * 4 and got.drawn == 8 and got.dropped == 0
    assert draw.asked == [(8, 10_000), (4, 10_000 - 40)]
    # with it, the flat group is left out and one more group is drawn to fill the batch
    draw = Pieces(flat, signal, group("c", [0, 1, 1, 1]))
    got = gather_batch(draw, want=8, token_budget=10_000, deadline=float("inf"), dynamic_sampling=True, max_draws=3)
    assert {s.group_id for s in got.samples} == {"b", "c"} and got.drawn == 12 and got.dropped == 4
    # draws are capped at max_draws batches: then the step trains on the signal found so far
    draw = Pieces(signal, flat, group("d", [2, 2, 2, 2]), group("e", [0, 1, 0, 0]))
    got = gather_batch(draw, want=8, token_budget=10_000, deadline=time.time() + 5, dynamic_sampling=True,
                       max_draws=1)
    assert {s.group_id for s in got.samples} == {"b"} and got.drawn == 8 and got.dropped == 4


def test_the_token_budget_ends_a_batch_early_and_the_deadline_stops_the_run():
    import pytest

    from toolrl.learner.batching import gather_batch

    draw = Pieces(group("a", [0, 1], n_tokens=30), group("b", [0, 1], n_tokens=30))
    got = gather_batch(draw, want=8, token_budget=50, deadline=float("inf"))
    assert len(got.samples) == 2 and draw.asked == [(8, 50)]  # 60 tokens >= 50: no more drawn
    t = iter([0.0, 5.0, 11.0])
    with pytest.raises(SystemExit, match="2/8 samples from the reference server"):
        gather_batch(Pieces(group("a", [0, 1]), []), want=8, token_budget=10_000, deadline=10.0,
                     clock=lambda: next(t))


def test_downsampling_keeps_each_groups_most_varied_rollouts_and_scores_them_again():
    """grpo.downsample_to (PODS): a group of 8 is cut to its 4 most varied rollouts, whose advantages
    are recomputed over those 4; the rest get advantage 0 (not trained). Teacher traces and groups
    already that small stay as they are, in the batch's order."""
    from toolrl.config import GRPOConfig
    from toolrl.grpo import group_advantages
    from toolrl.learner.batching import downsample

    rare = group("rare", [0.2, 0.2, 1.4, 0.2, 0.2, 0.0, 0.2, 0.2])
    small = group("small", [0.0, 1.0, 1.0])
    teacher = group("rare:teacher0", [1.4, 1.4])
    for s in teacher:
        s.source = "teacher"
    for s in rare + small:
        s.advantage = 0.5  # what the worker computed over the whole group: replaced below
    batch = rare[:4] + teacher + rare[4:] + small
    kept, out = downsample(batch, GRPOConfig(downsample_to=4))
    assert out == 4
    assert kept == [rare[0], rare[1], rare[2]] + teacher + [rare[5]] + small
    want = group_advantages([0.2, 0.2, 1.4, 0.0])
    assert [s.advantage for s in (rare[0], rare[1], rare[2], rare[5])] == pytest.approx(want)
    assert want[2] > 1.5  # the one right answer weighs more among 4 than among 8
    assert all(s.advantage == 0.0 for s in (rare[3], rare[4], rare[6], rare[7]))
    assert all(s.advantage == 0.5 for s in small)  # untouched
    # Dr. GRPO's mean-only advantages over the kept four
    rare = group("rare", [0.2, 0.2, 1.4, 0.2, 0.2, 0.0, 0.2, 0.2])
    kept, _ = downsample(rare, GRPOConfig(downsample_to=4, scale_rewards=False))
    assert [s.advantage for s in kept] == pytest.approx([0.2 - 0.45, 0.2 - 0.45, 1.4 - 0.45, 0.0 - 0.45])
    assert downsample(rare, GRPOConfig()) == (rare, 0)
