"""The frozen reference model and the loop that fills in `ref_logprobs`.

The loop takes a window of pending samples (in delivery order, up to two token budgets), sorts it
by length and cuts it into forward batches of at most `token_budget` padded tokens, so each batch
holds samples of similar length and padding stays small. Logprobs come from
`toolrl.logprobs.completion_logprobs` (fp32 log-softmax in chunks, at the sampling temperature,
the head applied only at completion positions). A window is completed all at once so delivery
order holds. Compute runs in one dedicated thread; the event loop stays free to serve requests.

With `grpo.beta == 0` no model is loaded and samples pass straight through without ref_logprobs.
A batch that raises is retried sample by sample; a sample that fails alone is dropped, counted
and logged with its group id (never silently).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..config import Config
from ..logprobs import completion_logprobs, pack_samples
from ..protocol import Sample
from .queue import AsyncSampleQueue, Entry

WINDOW_BUDGETS = 2  # a window spans this many token budgets: room to sort by length, bounded latency


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_reference_model(cfg: Config):
    """The frozen reference: cfg.model.name in cfg.model.dtype on cfg.ref_server.device."""
    from transformers import AutoModelForCausalLM

    from ..models import resolve_model

    dtype = cfg.model.dtype if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.model.name), dtype=dtype,
                                                 trust_remote_code=cfg.model.trust_remote_code)
    model = model.to(resolve_device(cfg.ref_server.device)).eval()
    model.requires_grad_(False)
    return model


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped into batches of similar length, each with rows * longest <= token_budget
    (a sample longer than the budget goes alone). Sorted ascending, so padding per batch is bounded
    by the spread of lengths inside it."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class Reference:
    def __init__(self, cfg: Config, model=None, log: logging.Logger | None = None):
        rs = cfg.ref_server
        self.log = log or logging.getLogger("ref_server")
        self.enabled = cfg.grpo.beta > 0
        self.token_budget, self.chunk_rows = rs.token_budget, rs.logprob_chunk
        self.temperature = cfg.rollout.temperature
        self.model = None
        self.model_name = cfg.model.name
        if self.enabled:
            self.model = model if model is not None else load_reference_model(cfg)
            self.model.eval()
            self.device = next(self.model.parameters()).device
            mcfg = self.model.config
            self.vocab_size = int(mcfg.vocab_size)
            self.max_len = int(getattr(mcfg, "max_position_embeddings", 0) or cfg.model.max_model_len)
            self.pad_id = int(mcfg.pad_token_id if getattr(mcfg, "pad_token_id", None) is not None else 0)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ref-compute") if self.enabled else None
        # Stats
        self.tokens_total = self.samples_total = self.batches_total = self.padded_total = 0
        self.compute_s_total = 0.0
        self.failed_total = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=4096)  # (end time, tokens) for a wall rate
        self.alive = False

    # -- validation at the door --------------------------------------------------------------
    def validate(self, samples: Sequence[Sample]) -> None:
        """Raise ValueError (-> HTTP 400) for a sample this model cannot score."""
        if not self.enabled:
            return
        for i, s in enumerate(samples):
            if s.num_tokens > self.max_len:
                raise ValueError(f"sample {i} has {s.num_tokens} tokens, over the reference model's "
                                 f"{self.max_len} positions")
            lo = min(min(s.prompt_ids), min(s.completion_ids, default=0))
            hi = max(max(s.prompt_ids), max(s.completion_ids, default=0))
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"sample {i} has token ids in [{lo}, {hi}], outside the reference "
                                 f"vocabulary [0, {self.vocab_size})")

    # -- compute (runs in the compute thread) ------------------------------------------------
    def compute(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Reference logprobs of each sample's completion tokens: one padded forward batch."""
        with torch.inference_mode():
            packed = pack_samples(samples, pad_id=self.pad_id, device=self.device)
            lp = completion_logprobs(self.model, packed, temperature=self.temperature, chunk_rows=self.chunk_rows)
            lp = lp.cpu()
        self.padded_total += packed.padded_tokens
        return [lp[i, :c].tolist() for i, c in enumerate(packed.completion_lens)]

    def _compute_window(self, window: list[Entry]) -> list[list[float] | None]:
        out: list[list[float] | None] = [None] * len(window)
        for batch in plan_batches([e.tokens for e in window], self.token_budget):
            try:
                for i, lp in zip(batch, self.compute([window[i].sample for i in batch])):
                    out[i] = lp
                self.batches_total += 1
            except Exception as exc:  # noqa: BLE001 - any failure: retry alone, never lose the window
                self.log.warning("reference batch of %d failed (%s: %s); retrying one by one",
                                 len(batch), type(exc).__name__, exc)
                for i in batch:
                    try:
                        out[i] = self.compute([window[i].sample])[0]
                        self.batches_total += 1
                    except Exception as exc1:  # noqa: BLE001 - counted and logged below
                        self.log.error("reference failed for a sample of group %r (%d tokens): %s: %s",
                                       window[i].sample.group_id, window[i].tokens, type(exc1).__name__, exc1)
        return out

    # -- the loop ----------------------------------------------------------------------------
    async def run(self, queue: AsyncSampleQueue) -> None:
        loop = asyncio.get_running_loop()
        self.alive = True
        try:
            while True:
                # The timeout only bounds the wait; an idle loop wakes once a second and sleeps again.
                window = await queue.take_window(WINDOW_BUDGETS * self.token_budget, timeout_s=1.0)
                if not window:
                    continue
                if not self.enabled:
                    queue.complete(window, None)
                    continue
                t0 = time.perf_counter()
                results = await loop.run_in_executor(self._executor, self._compute_window, window)
                dt = time.perf_counter() - t0
                ok = [(e, r) for e, r in zip(window, results) if r is not None]
                failed = [e for e, r in zip(window, results) if r is None]
                tokens = sum(e.tokens for e, _ in ok)
                self.tokens_total += tokens
                self.samples_total += len(ok)
                self.compute_s_total += dt
                self._recent.append((time.monotonic(), tokens))
                # Failed ones first, then the rest: the window still completes as one unit.
                if failed:
                    self.failed_total += len(failed)
                    queue.fail(failed)
                queue.complete([e for e, _ in ok], [r for _, r in ok], dt)
        finally:
            self.alive = False

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        recent = sum(t for end, t in self._recent if now - end <= 60.0)
        return {"enabled": self.enabled, "model": self.model_name if self.enabled else None,
                "temperature": self.temperature, "token_budget": self.token_budget,
                "tokens_total": self.tokens_total, "samples_total": self.samples_total,
                "batches_total": self.batches_total, "compute_s_total": round(self.compute_s_total, 4),
                "tokens_per_s": round(self.tokens_total / self.compute_s_total, 2) if self.compute_s_total else 0.0,
                "tokens_per_s_last_60s": round(recent / 60.0, 2),
                "padding_fraction": round(1 - self.tokens_total / self.padded_total, 4) if self.padded_total else 0.0,
                "failed_total": self.failed_total, "loop_alive": self.alive}
