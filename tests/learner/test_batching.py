"""Gathering a batch (dynamic sampling, token budget, deadline) and cutting it into micro-batches."""
import time

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
