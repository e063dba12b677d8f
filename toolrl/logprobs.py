"""Per-token logprobs, computed one way for every caller (reference server and learner).

The full-vocabulary logits of a batch are the largest tensor in an LLM step ([tokens, vocab] in
fp32: 1.6 GB for 8k tokens of a 49k vocabulary). These functions never build it: they run the
model's backbone once, then apply the output head and an fp32 log-softmax to `chunk_rows` rows at
a time, keeping only each row's target logprob (and optionally its entropy).

API
---
`token_logprobs(model, input_ids, attention_mask=None, *, temperature=1.0, chunk_rows=1024,
with_entropy=False) -> float32 [B, T-1]`
    logprob of token t+1 given tokens <= t, i.e. `log_softmax(logits[:, :-1] / T).gather(ids[:, 1:])`,
    with logits computed in the model's dtype and upcast to fp32 before scaling (what a plain
    `model(ids).logits.float()` gives). With `with_entropy`, returns `(logprobs, entropy)`.
    Rows must be right-padded (positions are taken as 0..T-1), as `pack_samples` makes them.

`pack_samples(samples, pad_id=0, device="cpu") -> PackedBatch`
    right-padded `input_ids`/`attention_mask` of prompt+completion per Sample, plus completion
    masks aligned to `[B, Cmax]`.

`completion_logprobs(model, packed, *, temperature=1.0, chunk_rows=1024, with_entropy=False)
-> float32 [B, Cmax]`
    logprobs of the completion tokens only (0 beyond each completion; use
    `packed.completion_mask`). The head runs only at completion positions, so prompt tokens cost
    a backbone pass and nothing more.

`shared_prompt_logprobs(model, samples, ...) -> float32 [B, Cmax]`
    the same values, with each distinct prompt computed once (its KV cache shared by the
    completions of a GRPO group). The learner's default.

`sample_logprobs(model, samples, ...) -> list[list[float]]`: the same, per Sample, no grad.

`logprobs_from_hidden(hidden [N, H], head, targets [N], ...) -> float32 [N]`: the chunked core.

Autograd: every function is differentiable. When grad is enabled, each chunk runs under
`torch.utils.checkpoint`, so backward also holds one chunk of logits at a time (the head is
recomputed per chunk: one extra head matmul, traded for O(chunk) memory).

The head is called as a module (`model.get_output_embeddings()(h)`), so hooks that gather
partitioned weights (DeepSpeed ZeRO-3) or adapters on the head (peft) apply. Pass the bare
`transformers` model (for a DeepSpeed engine, `engine.module`). Models whose logits are
post-processed after the head (softcapping, logit scale) are refused rather than silently wrong.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

# Config attributes that mean "logits are not just head(hidden)"; we refuse such models.
_UNSUPPORTED_LOGIT_ATTRS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _check_model(model) -> None:
    cfg = getattr(model, "config", None)
    for attr in _UNSUPPORTED_LOGIT_ATTRS:
        value = getattr(cfg, attr, None)
        if value not in (None, 1, 1.0):
            raise NotImplementedError(f"{type(model).__name__} post-processes logits ({attr}={value}); "
                                      "toolrl.logprobs computes head(hidden) only")


def _scaled_fp32(logits: torch.Tensor, inv_t: float) -> torch.Tensor:
    """A new fp32 tensor holding logits * inv_t (never the input itself, which backward reads)."""
    z = logits.float()
    if z is logits:
        return z * inv_t if inv_t != 1.0 else z.clone()
    return z.mul_(inv_t) if inv_t != 1.0 else z


class _TokenLogprob(torch.autograd.Function):
    """logits [N, V] in the head's dtype -> each row's fp32 logprob of its target (and its entropy)
    at temperature 1 / inv_t, with the backward written out. Autograd's graph of the same math
    (upcast, divide, logsumexp, gather, softmax, product, sum) passes over the [N, V] tensor some
    thirty times in all; this does about a dozen, and keeps only the input logits and two numbers
    a row for backward. On a CPU the head takes a quarter to a half less time (bench/learner.py).

    With z = logits * inv_t, p = softmax(z) and H = -sum(p log p):
    d logp_t / dz = onehot(t) - p, and dH / dz = -p (log p + H)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, inv_t: float, with_entropy: bool):
        z = _scaled_fp32(logits, inv_t)
        z_max = z.amax(-1, keepdim=True)
        z.sub_(z_max)  # logp and H are the same for z - max, and exp cannot overflow
        e = z.exp()
        s = e.sum(-1, keepdim=True)
        log_s = s.log()
        logp = (z.gather(-1, targets.unsqueeze(-1)) - log_s).squeeze(-1)
        ent = (log_s - e.mul_(z).sum(-1, keepdim=True) / s).squeeze(-1) if with_entropy else None
        ctx.save_for_backward(logits, targets, (log_s + z_max).squeeze(-1), ent)
        ctx.inv_t = inv_t
        return (logp, ent) if with_entropy else logp

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None = None):
        logits, targets, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None
        log_p = _scaled_fp32(logits, ctx.inv_t).sub_(lse.unsqueeze(-1))
        p = log_p.exp()
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
        if g_ent is not None:  # -p (g_logp + g_ent (log p + H)), built in log_p's memory
            grad = log_p.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(g_logp.unsqueeze(-1)).mul_(p).neg_()
        else:
            grad = p.mul_(-g_logp.unsqueeze(-1))
        grad.scatter_add_(-1, targets.unsqueeze(-1), g_logp.unsqueeze(-1))
        if ctx.inv_t != 1.0:
            grad.mul_(ctx.inv_t)
        return grad.to(logits.dtype), None, None, None


def _chunk_fn(head: Callable, temperature: float, with_entropy: bool):
    def fn(h: torch.Tensor, tgt: torch.Tensor):
        return _TokenLogprob.apply(head(h), tgt, 1.0 / temperature, with_entropy)

    return fn


def logprobs_from_hidden(hidden: torch.Tensor, head: Callable, targets: torch.Tensor, *, temperature: float = 1.0,
                         chunk_rows: int = 1024, with_entropy: bool = False, use_checkpoint: bool | None = None):
    """hidden [N, H] (final normed hidden states), targets [N] -> fp32 logprobs [N] (and entropy [N])."""
    if hidden.ndim != 2 or targets.ndim != 1 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"expected hidden [N, H] and targets [N], "
                         f"got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if use_checkpoint is None:
        use_checkpoint = torch.is_grad_enabled() and (hidden.requires_grad or any(
            p.requires_grad for p in getattr(head, "parameters", list)()))
    fn = _chunk_fn(head, temperature, with_entropy)
    targets = targets.to(hidden.device, torch.long)
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        h, t = hidden[start:start + chunk_rows], targets[start:start + chunk_rows]
        out = checkpoint(fn, h, t, use_reentrant=False) if use_checkpoint else fn(h, t)
        if with_entropy:
            logps.append(out[0])
            ents.append(out[1])
        else:
            logps.append(out)
    if not logps:  # N == 0
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return (empty, empty.clone()) if with_entropy else empty
    logp = torch.cat(logps)
    return (logp, torch.cat(ents)) if with_entropy else logp


def _hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    _check_model(model)
    backbone = model.get_decoder()
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   temperature: float = 1.0, chunk_rows: int = 1024, with_entropy: bool = False):
    """fp32 [B, T-1]: logprob of input_ids[:, t+1] given input_ids[:, :t+1]. See the module docstring."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    hidden = _hidden_states(model, input_ids, attention_mask)
    flat_h = hidden[:, :-1].reshape(B * (T - 1), hidden.shape[-1])
    out = logprobs_from_hidden(flat_h, model.get_output_embeddings(), input_ids[:, 1:].reshape(-1),
                               temperature=temperature, chunk_rows=chunk_rows, with_entropy=with_entropy)
    if with_entropy:
        return out[0].view(B, T - 1), out[1].view(B, T - 1)
    return out.view(B, T - 1)


@dataclass
class PackedBatch:
    """Right-padded prompt+completion rows. Completion token j of row i sits at prompt_lens[i] + j."""

    input_ids: torch.Tensor  # long [B, T]
    attention_mask: torch.Tensor  # long [B, T]
    prompt_lens: list[int]
    completion_lens: list[int]
    completion_ids: torch.Tensor  # long [B, Cmax], pad_id beyond each completion
    completion_mask: torch.Tensor  # bool [B, Cmax]: a real completion token
    loss_mask: torch.Tensor  # float32 [B, Cmax]: the sample's loss mask (0 for tool output and padding)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.prompt_lens) + sum(self.completion_lens))

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device) -> PackedBatch:
        return PackedBatch(self.input_ids.to(device), self.attention_mask.to(device), self.prompt_lens,
                           self.completion_lens, self.completion_ids.to(device), self.completion_mask.to(device),
                           self.loss_mask.to(device))


def pack_samples(samples: Sequence, pad_id: int = 0, device: str | torch.device = "cpu") -> PackedBatch:
    """Samples (anything with prompt_ids, completion_ids, loss_mask) -> a right-padded PackedBatch."""
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    p_lens = [len(s.prompt_ids) for s in samples]
    c_lens = [len(s.completion_ids) for s in samples]
    if min(p_lens) < 1:
        raise ValueError("every sample needs at least one prompt token")
    B, T, C = len(samples), max(p + c for p, c in zip(p_lens, c_lens)), max(c_lens)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    comp = torch.full((B, C), pad_id, dtype=torch.long)
    cmask = torch.zeros((B, C), dtype=torch.bool)
    lmask = torch.zeros((B, C), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, c = p_lens[i], c_lens[i]
        row = torch.tensor(list(s.prompt_ids) + list(s.completion_ids), dtype=torch.long)
        ids[i, :p + c] = row
        attn[i, :p + c] = 1
        if c:
            comp[i, :c] = row[p:]
            cmask[i, :c] = True
            lmask[i, :c] = torch.tensor(s.loss_mask, dtype=torch.float32)
    return PackedBatch(ids, attn, p_lens, c_lens, comp, cmask, lmask).to(device)


def completion_logprobs(model, packed: PackedBatch, *, temperature: float = 1.0, chunk_rows: int = 1024,
                        with_entropy: bool = False):
    """fp32 [B, Cmax] logprobs of each completion token (0 where `packed.completion_mask` is False)."""
    hidden = _hidden_states(model, packed.input_ids, packed.attention_mask)
    B, C = packed.completion_mask.shape
    # Token j of the completion is predicted by the hidden state just before it: row i, col p_i + j - 1.
    cols = torch.tensor(packed.prompt_lens, device=hidden.device).unsqueeze(1) - 1 \
        + torch.arange(C, device=hidden.device).unsqueeze(0)
    mask = packed.completion_mask.to(hidden.device)
    rows = torch.arange(B, device=hidden.device).unsqueeze(1).expand(B, C)
    sel_h = hidden[rows[mask], cols[mask]]  # [N, H], only the positions we need
    targets = packed.completion_ids.to(hidden.device)[mask]
    out = logprobs_from_hidden(sel_h, model.get_output_embeddings(), targets, temperature=temperature,
                               chunk_rows=chunk_rows, with_entropy=with_entropy)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        full = values.new_zeros(B, C)
        return full.masked_scatter(mask, values)

    return (scatter(out[0]), scatter(out[1])) if with_entropy else scatter(out)


def shared_prompt_logprobs(model, samples: Sequence, *, temperature: float = 1.0, chunk_rows: int = 1024,
                           with_entropy: bool = False, pad_id: int = 0):
    """`completion_logprobs(model, pack_samples(samples))`, computing each distinct prompt once.

    A GRPO group's samples share their prompt, which is often most of a sample's tokens (a few
    hundred tokens of system prompt against a ~100-token answer). Each distinct prompt runs once as
    a batch of one with a KV cache; the cache is repeated for the completions that share it, and
    they run on top of it. Gradients flow through the cache into the prompt's pass, so the result
    and its gradient equal the packed computation's (to float tolerance). Same output layout
    [B, Cmax] as `completion_logprobs` on `pack_samples(samples)`.
    """
    _check_model(model)
    backbone, head = model.get_decoder(), model.get_output_embeddings()
    device = next(model.parameters()).device
    groups: dict[tuple, list[int]] = {}
    for i, smp in enumerate(samples):
        if len(smp.prompt_ids) < 1:
            raise ValueError("every sample needs at least one prompt token")
        groups.setdefault(tuple(smp.prompt_ids), []).append(i)
    B, C = len(samples), max(len(smp.completion_ids) for smp in samples)
    hidden_rows, targets, where = [], [], []
    for prompt, idxs in groups.items():
        comps = [list(samples[i].completion_ids) for i in idxs]
        idxs = [i for i, c in zip(idxs, comps) if c]
        comps = [c for c in comps if c]
        if not comps:
            continue
        out = backbone(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        cache = out.past_key_values
        if cache is None:
            raise RuntimeError("the model returned no KV cache (gradient checkpointing disables it): "
                               "use the packed path")
        last = out.last_hidden_state[0, -1:]  # predicts every completion's first token
        cg = max(len(c) for c in comps)
        if cg > 1:
            ids = torch.full((len(comps), cg - 1), pad_id, dtype=torch.long, device=device)
            for j, c in enumerate(comps):
                ids[j, :len(c) - 1] = torch.tensor(c[:-1], device=device)
            cache.batch_repeat_interleave(len(comps))
            # right padding needs no mask: causal attention never lets a real token see a later pad
            h = backbone(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
        for j, (i, c) in enumerate(zip(idxs, comps)):
            hidden_rows.append(last)
            if len(c) > 1:
                hidden_rows.append(h[j, :len(c) - 1])
            targets.extend(c)
            where.extend((i, t) for t in range(len(c)))
    if not targets:
        zeros = torch.zeros(B, C, device=device)
        return (zeros, zeros.clone()) if with_entropy else zeros
    out = logprobs_from_hidden(torch.cat(hidden_rows), head, torch.tensor(targets, device=device),
                               temperature=temperature, chunk_rows=chunk_rows, with_entropy=with_entropy)
    rows = torch.tensor([w[0] for w in where], device=device)
    cols = torch.tensor([w[1] for w in where], device=device)

    def place(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(B, C).index_put((rows, cols), values)

    return (place(out[0]), place(out[1])) if with_entropy else place(out)


@torch.no_grad()
def sample_logprobs(model, samples: Sequence, *, temperature: float = 1.0, chunk_rows: int = 1024,
                    pad_id: int = 0) -> list[list[float]]:
    """Completion logprobs per Sample, as Python floats (no grad). One forward pass for the whole list."""
    device = next(model.parameters()).device
    packed = pack_samples(samples, pad_id=pad_id, device=device)
    lp = completion_logprobs(model, packed, temperature=temperature, chunk_rows=chunk_rows).cpu()
    return [lp[i, :c].tolist() for i, c in enumerate(packed.completion_lens)]
