"""Micro-batches: a prompt's samples stay together, and each micro-batch keeps to the token budget."""
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
