"""toolrl.logprobs against the plain full-logits computation: values, padding, gradients."""
import pytest
import torch

from toolrl.logprobs import (
    completion_logprobs,
    logprobs_from_hidden,
    pack_samples,
    sample_logprobs,
    shared_prompt_logprobs,
    token_logprobs,
)
from toolrl.models import load_hf_model
from toolrl.protocol import Sample


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = load_hf_model("tiny-random", dtype="float32")
    # The tiny model's random init gives nearly uniform logits; sharpen them so errors would show.
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(30.0)
    return m


def plain(model, ids, temperature=1.0, attention_mask=None):
    logits = model(input_ids=ids, attention_mask=attention_mask).logits.float() / temperature
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def sample(p, c, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49152, (p + c,), generator=g).tolist()
    mask = [1 if (j % 5) else 0 for j in range(c)]
    return Sample(prompt_ids=ids[:p], completion_ids=ids[p:], loss_mask=mask,
                  logprobs=[-1.0 if m else None for m in mask], group_id=f"g{seed}")


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (0.7, 1024), (1.3, 1)])
def test_token_logprobs_equal_plain(model, temperature, chunk):
    ids = torch.randint(0, 49152, (3, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = token_logprobs(model, ids, temperature=temperature, chunk_rows=chunk)
        want = plain(model, ids, temperature)
    assert got.dtype == torch.float32 and got.shape == (3, 18)
    assert want.std() > 0.5  # a meaningful comparison, not near-uniform logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_entropy_matches_plain(model):
    ids = torch.randint(0, 49152, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, ent = token_logprobs(model, ids, chunk_rows=5, with_entropy=True)
        logp = model(ids).logits.float()[:, :-1].log_softmax(-1)
        want = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(ent, want, atol=1e-4, rtol=1e-4)


def test_completion_logprobs_mixed_lengths_match_unpadded(model):
    samples = [sample(5, 3, 10), sample(1, 30, 11), sample(17, 0, 12), sample(12, 9, 13)]
    packed = pack_samples(samples, pad_id=7)
    assert packed.input_ids.shape == (4, 31) and packed.num_tokens == 5 + 3 + 1 + 30 + 17 + 12 + 9
    with torch.no_grad():
        got = completion_logprobs(model, packed, temperature=0.9, chunk_rows=8)
    for i, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            want = plain(model, ids, 0.9)[0, len(s.prompt_ids) - 1:]
        c = len(s.completion_ids)
        torch.testing.assert_close(got[i, :c], want, atol=1e-4, rtol=1e-4)
        assert torch.all(got[i, c:] == 0)
        assert packed.loss_mask[i, :c].tolist() == [float(m) for m in s.loss_mask]
    lists = sample_logprobs(model, samples, temperature=0.9, chunk_rows=8)
    assert [len(x) for x in lists] == [3, 30, 0, 9]
    assert lists[1] == pytest.approx(got[1, :30].tolist(), abs=1e-5)


def test_gradients_match_plain(model):
    samples = [sample(4, 6, 20), sample(2, 11, 21)]
    packed = pack_samples(samples)
    weights = torch.randn(packed.completion_mask.shape, generator=torch.Generator().manual_seed(3))
    params = [p for p in model.parameters()]

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in params]

    lp, ent = completion_logprobs(model, packed, temperature=0.8, chunk_rows=4, with_entropy=True)
    got = grads((lp * weights * packed.completion_mask).sum() + 0.1 * (ent * packed.completion_mask).sum())

    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits.float() / 0.8
    full = logits.log_softmax(-1)
    loss = 0
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        rows = full[i, p - 1:p - 1 + c]
        lp_i = rows.gather(-1, packed.completion_ids[i, :c].unsqueeze(-1)).squeeze(-1)
        ent_i = -(rows.exp() * rows).sum(-1)
        loss = loss + (lp_i * weights[i, :c]).sum() + 0.1 * ent_i.sum()
    want = grads(loss)
    assert any(g.abs().max() > 0 for g in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use", ["logp", "logp, entropy computed", "entropy", "both"])
def test_the_written_out_backward_matches_autograd(dtype, temperature, use):
    """The head's logprob and entropy have a hand-written backward: its gradients (into the hidden
    states and the head) equal autograd's through the plain math, whichever outputs the loss uses
    (the learner computes the entropy as a metric and leaves it out of the loss by default)."""
    g = torch.Generator().manual_seed(7)
    head = torch.nn.Linear(16, 300, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 16, generator=g) * 2)
    head = head.to(dtype)
    hidden = torch.randn(11, 16, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, 300, (11,), generator=g)
    w_lp, w_ent = torch.randn(11, generator=g), torch.randn(11, generator=g)

    def loss_of(lp, ent):
        by_logp = (lp * w_lp).sum() if use != "entropy" else 0
        return by_logp + ((ent * w_ent).sum() if use in ("entropy", "both") else 0)

    def grads(loss):
        return [t.float() for t in torch.autograd.grad(loss, [hidden, head.weight])]

    out = logprobs_from_hidden(hidden, head, targets, temperature=temperature, chunk_rows=4,
                               with_entropy=use != "logp")
    lp, ent = out if use != "logp" else (out, None)
    got = grads(loss_of(lp, ent))
    logits = head(hidden).float() / temperature
    logp_all = logits.log_softmax(-1)
    want_lp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_ent = -(logp_all.exp() * logp_all).sum(-1)
    want = grads(loss_of(want_lp, want_ent))
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    if ent is not None:
        torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for x, y in zip(got, want):
        assert y.abs().max() > 0.1
        torch.testing.assert_close(x, y, **tol)


def test_checkpointed_chunks_keep_backward_memory_to_one_chunk():
    # A head whose forward output we can watch: backward must recompute chunk by chunk.
    calls = []
    head = torch.nn.Linear(8, 50, bias=False)
    orig = head.forward
    head.forward = lambda h: calls.append(h.shape[0]) or orig(h)
    hidden = torch.randn(10, 8, requires_grad=True)
    lp = logprobs_from_hidden(hidden, head, torch.arange(10) % 50, chunk_rows=4)
    assert calls == [4, 4, 2]
    lp.sum().backward()
    assert calls == [4, 4, 2, 2, 4, 4] or sorted(calls[3:]) == [2, 4, 4]  # recomputed per chunk
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_bad_inputs_are_refused(model):
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_hidden(torch.zeros(2, 4), torch.nn.Linear(4, 5), torch.zeros(2), temperature=0)
    with pytest.raises(ValueError, match="empty"):
        pack_samples([])
    model.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(NotImplementedError, match="softcapping"):
            token_logprobs(model, torch.zeros(1, 3, dtype=torch.long))
    finally:
        model.config.final_logit_softcapping = None


def test_shared_prompts_give_the_packed_values_and_gradients(model):
    """Each distinct prompt computed once, its KV cache repeated for its completions: the same
    logprobs, entropies and parameter gradients as every row running its own prompt."""
    a, b = sample(13, 5, 1), sample(7, 4, 2)
    def on(prompt, completion):
        return Sample(prompt_ids=prompt, completion_ids=completion, loss_mask=[1] * len(completion),
                      logprobs=[-1.0] * len(completion), group_id="g")

    rows = [a, on(b.prompt_ids, b.completion_ids[:1]), on(a.prompt_ids, sample(1, 9, 3).completion_ids),
            b, sample(3, 6, 4), on(a.prompt_ids, [])]
    packed = pack_samples(rows)
    mask = packed.completion_mask
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))
    params = list(model.parameters())
    out = {}
    for name, fn in (("packed", lambda: completion_logprobs(model, packed, temperature=0.8, chunk_rows=4,
                                                            with_entropy=True)),
                     ("shared", lambda: shared_prompt_logprobs(model, rows, temperature=0.8, chunk_rows=4,
                                                               with_entropy=True))):
        lp, ent = fn()
        grads = torch.autograd.grad((lp * weights * mask).sum() + (ent * mask).sum(), params)
        out[name] = (lp.detach(), ent.detach(), grads)
    (lp1, e1, g1), (lp2, e2, g2) = out["packed"], out["shared"]
    assert lp2.shape == lp1.shape and lp1[mask].std() > 0.5
    torch.testing.assert_close(lp2[mask], lp1[mask], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(e2[mask], e1[mask], atol=1e-4, rtol=1e-4)
    assert (lp2[~mask] == 0).all()
    for x, y in zip(g1, g2):
        torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-3)
    assert max(x.abs().max() for x in g1) > 1e-2  # gradients that could differ
