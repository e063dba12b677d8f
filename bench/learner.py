"""Learner benchmark: GRPO step throughput vs a plain forward+backward, and weight-sync cost.

    python bench/learner.py [--model smollm2-135m-instruct] [--dtype bfloat16] [--skip-sync]

1. In one DeepSpeed engine, alternating: toolrl's GRPO `train_step` (chunked fp32 logprobs at the
   sampling temperature, entropy, clip-higher loss, micro-batching, the step) vs a plain
   `model(ids, labels=ids)` forward + backward + step on the same tokens. Ratio of tokens/s.
   The batch is GRPO groups sharing a prompt; the GRPO step runs each prompt once
   (learner.share_prompts) and, for comparison, once per row as the plain step does.
   The plain step runs the head at every position, the GRPO step only at completion positions, so
   a third baseline does the same work plainly: the body, then the head and an fp32 log-softmax at
   the temperature at completion positions only, a policy-gradient loss, backward, step (no entropy,
   no chunking or recompute). `ratio_like_for_like_unshared` = that step's time over the unshared
   GRPO step's: what the learner's own code costs, prompt sharing left out.
   The GRPO step runs with updates_per_batch 1 and 2 side by side (tis_cap set, so the second
   update's ratio is against pi_old, kept from the first pass: `second_update_ratio` is the second
   update's time over the first's inside the same step, median over repeats; at most about 1 when
   pi_old costs no extra forward).
   And the GRPO step once more with the output head's logprob and entropy left to autograd (the
   code before toolrl.logprobs wrote their backward out; kept here as the baseline), and the head
   alone both ways on the batch's completion rows: `fused_head_step_speedup` and
   `fused_head_speedup`.
2. Weight sync, in the same run: a real gen worker (vLLM, idle) taking a full HTTP sync
   (learner-side `push_weights`: buckets streamed from the tensors' memory, written to /dev/shm
   as they arrive, loaded while the rest arrives) vs the same engine's in-place reload alone of
   weights already in /dev/shm (the faster of vLLM's whole-file reload and toolrl's bucket-file
   loader). Ratio of times. The same worker then takes the same weights by broadcast on a gloo
   process group (learner.sync_transport: process_group), for comparison.

Last line: JSON with ratio_vs_fwd_bwd, ratio_like_for_like_unshared and sync_ratio_vs_reload.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from procs import Proc, free_port  # noqa: E402  (tests/procs.py: real services as subprocesses)


def make_batch(n: int, prompt_len: int, comp_len: int, group: int = 4, seed: int = 0):
    """n samples in GRPO groups of `group` that share their prompt, as a gen worker uploads them."""
    from toolrl.protocol import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % group == 0:
            prompt = [rng.randint(0, 40000) for _ in range(prompt_len)]
        mask = [1] * comp_len
        for j in range(comp_len // 3, comp_len // 3 + 16):  # a tool-output span
            mask[j] = 0
        out.append(Sample(prompt_ids=prompt,
                          completion_ids=[rng.randint(0, 40000) for _ in range(comp_len)], loss_mask=mask,
                          logprobs=[-2.0 if m else None for m in mask], rewards={"correct": float(i % 2)},
                          reward=float(i % 2), advantage=1.0 if i % 2 else -1.0, group_id=f"g{i // group}"))
    return out


def autograd_chunk_fn(head, temperature: float, with_entropy: bool):
    """toolrl.logprobs' per-chunk head before its backward was written out: the same math, autograd's
    graph (the baseline of `fused_head_speedup`)."""
    import torch

    def fn(h, tgt):
        logits = head(h).float()
        if temperature != 1.0:
            logits = logits / temperature
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse
        if not with_entropy:
            return logp
        return logp, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)

    return fn


@contextlib.contextmanager
def head_math(chunk_fn):
    """toolrl.logprobs computes the head with `chunk_fn` inside the block."""
    import toolrl.logprobs as lp

    kept, lp._chunk_fn = lp._chunk_fn, chunk_fn
    try:
        yield
    finally:
        lp._chunk_fn = kept


def bench_head(tr, rows: int, temperature: float, chunk_rows: int, repeats: int) -> dict:
    """The head alone on `rows` completion positions, forward and backward of logprob + entropy,
    toolrl's written-out backward against autograd's, alternating."""
    import torch

    import toolrl.logprobs as lp

    head = tr.module.get_output_embeddings()
    hidden = torch.randn(rows, head.weight.shape[1], dtype=head.weight.dtype, requires_grad=True)
    targets = torch.randint(0, head.weight.shape[0], (rows,))
    fused_fn = lp._chunk_fn

    def run(chunk_fn):
        with head_math(chunk_fn):
            t = time.perf_counter()
            logp, ent = lp.logprobs_from_hidden(hidden, head, targets, temperature=temperature,
                                                chunk_rows=chunk_rows, with_entropy=True)
            logp.sum().backward()
            took = time.perf_counter() - t
        tr.engine.zero_grad()
        return took

    run(fused_fn), run(autograd_chunk_fn)
    fused, plain = [], []
    for _ in range(repeats):
        fused.append(run(fused_fn))
        plain.append(run(autograd_chunk_fn))
    print(f"  head alone, {rows} rows: written-out backward {min(fused):.3f}s, autograd {min(plain):.3f}s", flush=True)
    return {"head_rows": rows, "head_s_fused": round(min(fused), 3), "head_s_autograd": round(min(plain), 3),
            "fused_head_speedup": round(min(plain) / min(fused), 3)}


def bench_step(args) -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    import torch

    from toolrl.config import load_config
    from toolrl.logprobs import pack_samples
    from toolrl.models import resolve_dtype, resolve_model
    from toolrl.learner.trainer import Trainer

    cfg = load_config("configs/cpu_demo.yaml", [f"model.name={args.model}", f"learner.dtype={args.dtype}",
                                                "learner.micro_batch_tokens=4096", "logging.wandb_mode=disabled"])
    tr = Trainer(cfg, resolve_model(args.model))
    batch = make_batch(args.samples, args.prompt_len, args.completion_len, args.group)
    tokens = sum(s.num_tokens for s in batch)
    engine = tr.engine

    def plain_step():
        from toolrl.learner.batching import micro_batches

        mbs = micro_batches(batch, cfg.learner.micro_batch_tokens)
        for k, mb in enumerate(mbs):
            engine.set_gradient_accumulation_boundary(k == len(mbs) - 1)
            p = pack_samples(mb, pad_id=tr.pad_id)
            out = tr.module(input_ids=p.input_ids, attention_mask=p.attention_mask, labels=p.input_ids)
            engine.backward(out.loss, scale_wrt_gas=False)
        engine.step()

    def completion_step():
        # The unshared GRPO step's work in plain torch: same micro-batches and rows, the head only at
        # completion positions (tool-output spans included, as the learner computes them), fp32
        # log-softmax at the temperature, loss over the loss mask, backward, step.
        from toolrl.learner.batching import micro_batches

        body, head, temp = tr.module.get_decoder(), tr.module.get_output_embeddings(), cfg.rollout.temperature
        mbs = micro_batches(batch, cfg.learner.micro_batch_tokens)
        for k, mb in enumerate(mbs):
            engine.set_gradient_accumulation_boundary(k == len(mbs) - 1)
            p = pack_samples(mb, pad_id=tr.pad_id)
            hidden = body(input_ids=p.input_ids, attention_mask=p.attention_mask, use_cache=False).last_hidden_state
            mask = p.completion_mask
            rows = torch.arange(len(mb)).unsqueeze(1).expand_as(mask)[mask]
            cols = (torch.tensor(p.prompt_lens).unsqueeze(1) - 1 + torch.arange(mask.shape[1]))[mask]
            logits = head(hidden[rows, cols]).float() / temp
            logp = logits.gather(-1, p.completion_ids[mask].unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
            adv = torch.tensor([s.advantage for s in mb]).unsqueeze(1).expand_as(mask)[mask]
            lmask = p.loss_mask[mask]
            loss = -(adv * logp * lmask).sum() / lmask.sum().clamp(min=1)
            engine.backward(loss, scale_wrt_gas=False)
        engine.step()

    base_grpo = cfg.grpo

    def grpo_step(share: bool, updates: int = 1):
        # updates_per_batch 1 and 2 both with tis_cap, so the second pass takes its ratio against
        # pi_old (kept from the first pass's forward: no extra forward)
        tr.cfg = cfg.model_copy(update={"grpo": base_grpo.model_copy(update={"updates_per_batch": updates,
                                                                             "tis_cap": 2.0})})
        tr.share_prompts = share
        tr.train_step(batch)

    # Each optimizer step's time, so the two updates of one step are compared inside that step (a
    # difference of two steps' minima mixes in their repeat-to-repeat noise, 5-7% here).
    update_s: list[float] = []
    optimizer_step = tr._optimizer_step

    def timed_update(*a):
        t = time.perf_counter()
        optimizer_step(*a)
        update_s.append(time.perf_counter() - t)
    tr._optimizer_step = timed_update

    plain_step()
    completion_step()
    def grpo_step_autograd_head():
        with head_math(autograd_chunk_fn):
            grpo_step(True)

    grpo_step(True)  # warm-up all six
    grpo_step(False)
    grpo_step(True, 2)
    grpo_step_autograd_head()
    t_plain, t_comp, t_grpo, t_packed, t_two, t_auto, second_over_first = [], [], [], [], [], [], []
    for _ in range(args.repeats):
        for times, fn in ((t_plain, plain_step), (t_comp, completion_step), (t_grpo, lambda: grpo_step(True)),
                          (t_packed, lambda: grpo_step(False)), (t_auto, grpo_step_autograd_head),
                          (t_two, lambda: grpo_step(True, 2))):  # last: update_s holds its two updates
            update_s.clear()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        second_over_first.append(update_s[1] / update_s[0])  # the 2-update step's own two updates
        print(f"  plain {t_plain[-1]:.2f}s  plain, head at completion {t_comp[-1]:.2f}s  grpo {t_grpo[-1]:.2f}s  "
              f"grpo, every row its own prompt {t_packed[-1]:.2f}s  grpo, 2 updates {t_two[-1]:.2f}s "
              f"(update 1 {update_s[0]:.2f}s, update 2 {update_s[1]:.2f}s)  grpo, autograd's head "
              f"{t_auto[-1]:.2f}s", flush=True)
    res = {"step_tokens": tokens, "plain_tokens_per_s": round(tokens / min(t_plain), 1),
           "grpo_tokens_per_s": round(tokens / min(t_grpo), 1),
           "ratio_vs_fwd_bwd": round(min(t_plain) / min(t_grpo), 3),
           # against the full-head plain step: not the same work (kept for the history)
           "ratio_unshared_vs_fwd_bwd": round(min(t_plain) / min(t_packed), 3),
           # the like-for-like figure: the same rows and head positions, no prompt sharing on either side
           "head_at_completion_tokens_per_s": round(tokens / min(t_comp), 1),
           "ratio_like_for_like_unshared": round(min(t_comp) / min(t_packed), 3),
           "prompt_sharing_speedup": round(min(t_packed) / min(t_grpo), 3), "dtype": args.dtype,
           "step_s_updates_1": round(min(t_grpo), 3), "step_s_updates_2": round(min(t_two), 3),
           # the second update's time over the first's, in the same step (median over repeats): at
           # most 1 when it costs no more than its own forward and backward (pi_old not recomputed)
           "second_update_ratio": round(statistics.median(second_over_first), 3),
           "second_update_ratios": [round(r, 3) for r in second_over_first],
           # the same from whole steps: (2-update step - 1-update step) / 1-update step, best of each
           "second_update_ratio_from_steps": round((min(t_two) - min(t_grpo)) / min(t_grpo), 3),
           # the same GRPO step with the head's logprob and entropy left to autograd, over toolrl's
           "fused_head_step_speedup": round(min(t_auto) / min(t_grpo), 3),
           "threads": torch.get_num_threads()}
    res.update(bench_head(tr, sum(len(s.completion_ids) for s in batch), cfg.rollout.temperature,
                          cfg.learner.logprob_chunk, args.repeats))
    named = tr.export_state(getattr(torch, resolve_dtype(cfg.model.dtype)))
    return res, named


def write_buckets(named, d: Path, bucket_mb: int = 64) -> int:
    """The update as a worker holds it once received: one safetensors file per bucket."""
    from toolrl.weightsync.buckets import bucketize, encode_weight_bucket
    from toolrl.weightsync.receiver import bucket_file, ready_file

    buckets = bucketize(named, bucket_mb << 20)
    for i, b in enumerate(buckets):
        (d / bucket_file(i)).write_bytes(encode_weight_bucket(b, 1, i, len(buckets)))
        (d / ready_file(1, i)).touch()
    return len(buckets)


def bench_reload(args, named) -> dict:
    """The baseline: the worker's engine loading weights already in /dev/shm, nothing on the wire.
    Two ways, both timed: vLLM's own reload of one complete safetensors file, and toolrl's loader
    reading the bucket files (what a sync runs, minus the transfer). The faster is the baseline."""
    import asyncio

    from safetensors.torch import save_file

    from toolrl.config import load_config
    from toolrl.worker.engine import VllmEngine
    from toolrl.models import resolve_model

    cfg = load_config("configs/cpu_demo.yaml", [f"model.name={args.model}"])
    d = Path(tempfile.mkdtemp(prefix="bench-reload-", dir="/dev/shm"))  # RAM: removed in the finally below
    one = d / "whole"

    async def run():
        engine = VllmEngine(cfg, resolve_model(args.model))
        try:
            whole, buckets = [], []
            for _ in range(args.repeats + 1):  # the first of each warms caches
                t = time.perf_counter()
                await engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(one),
                                                                         "is_checkpoint_format": True})
                whole.append(time.perf_counter() - t)
                count = write_buckets(named, d)
                t = time.perf_counter()
                await engine.llm.collective_rpc("toolrl_load_buckets", kwargs={"weights_dir": str(d), "update_id": 1,
                                                                               "count": count, "timeout_s": 5})
                buckets.append(time.perf_counter() - t)
                print(f"  reload alone: whole file {whole[-1]:.2f}s, bucket files {buckets[-1]:.2f}s", flush=True)
            return min(whole[1:]), min(buckets[1:])
        finally:
            engine.shutdown()

    try:
        one.mkdir()
        save_file({n: t for n, t in named}, str(one / "model.safetensors"))
        whole, buckets = asyncio.run(run())
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    return {"reload_whole_file_s": round(whole, 3), "reload_bucket_files_s": round(buckets, 3),
            "reload_s": round(min(whole, buckets), 3)}


def bench_sync(args, named) -> dict:
    from toolrl.weightsync.http import push_weights

    before = bench_reload(args, named)
    d = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    ref_port, w_port = free_port(), free_port()
    sets = [f"ref_server.url=http://127.0.0.1:{ref_port}", "grpo.beta=0", f"model.name={args.model}",
            "executor.url=http://127.0.0.1:9"]  # no executor needed: the worker stays idle
    cli = ["--config", "configs/cpu_demo.yaml"] + [x for s in sets for x in ("--set", s)]
    ref = Proc("ref", ["ref_server.py", *cli, "--port", str(ref_port)], d)
    worker = None
    try:
        ref.wait_http(f"http://127.0.0.1:{ref_port}/health", 300)
        worker = Proc("worker", ["gen_worker.py", *cli, "--port", str(w_port), "--max-groups", "0"], d)
        url = f"http://127.0.0.1:{w_port}"
        worker.wait_http(f"{url}/health", 900)
        time.sleep(3)
        pushes, loads = [], []
        for v in range(1, args.repeats + 2):
            a = push_weights(url, named, version=v, bucket_mb=64, timeout_s=600)
            if v > 1:  # the first load also warms caches
                pushes.append(a["push_s"])
                loads.append(a["reload_s"])
            print(f"  sync v{v}: push {a['push_s']:.2f}s (load while receiving {a['reload_s']:.2f}s, "
                  f"drain {a['drain_s']:.2f}s)", flush=True)
        # the other transport, same worker: a broadcast on a gloo process group (NCCL on GPUs)
        from toolrl.weightsync.process_group import LearnerGroup

        group, broadcasts = LearnerGroup({"id": "bench", "url": url}, "127.0.0.1", timeout_s=600), []
        for v in range(args.repeats + 2, 2 * args.repeats + 3):
            a = group.push(named, v)
            if v > args.repeats + 2:
                broadcasts.append(a["push_s"])
            print(f"  process-group sync v{v}: {a['push_s']:.2f}s", flush=True)
    finally:
        if worker:
            worker.stop()
        ref.stop()
    after = bench_reload(args, named)  # the baseline before and after the syncs: this machine drifts
    base = {k: min(before[k], after[k]) for k in before}
    size = sum(t.numel() * t.element_size() for _, t in named)
    return {"sync_bytes": size, "sync_s": round(min(pushes), 3), "sync_median_s": round(statistics.median(pushes), 3),
            **base, "sync_ratio_vs_reload": round(min(pushes) / base["reload_s"], 3),
            "process_group_sync_s": round(min(broadcasts), 3),
            "process_group_ratio_vs_reload": round(min(broadcasts) / base["reload_s"], 3)}


def hf_state(args):
    """The weights as the learner exports them (HF names, tied lm_head included), without a step."""
    import torch

    from toolrl.models import load_hf_model

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = load_hf_model(args.model, args.dtype)
    return [(n, t.detach().to(dtype, copy=True).contiguous()) for n, t in model.state_dict().items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (a GRPO group)")
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--completion-len", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-sync", action="store_true")
    ap.add_argument("--skip-step", action="store_true", help="only the sync part (weights from the checkpoint)")
    args = ap.parse_args()
    if args.skip_step:
        res, named = {}, hf_state(args)
    else:
        res, named = bench_step(args)
        print(f"GRPO step {res['grpo_tokens_per_s']} tok/s vs plain fwd+bwd {res['plain_tokens_per_s']} tok/s; "
              f"unshared GRPO step vs head-at-completion fwd+bwd: {res['ratio_like_for_like_unshared']}", flush=True)
    if not args.skip_sync:
        res.update(bench_sync(args, named))
    res["model"] = args.model
    print(json.dumps(res))


if __name__ == "__main__":
    main()
