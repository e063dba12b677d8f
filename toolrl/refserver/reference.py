"""The frozen reference model and the loop that fills in `ref_logprobs`.

The loop takes a window of pending samples (in delivery order, up to two token budgets), sorts it
by length and cuts it into forward batches of at most `token_budget` padded tokens, so each batch
holds samples of similar length and padding stays small. Logprobs come from
`toolrl.logprobs.completion_logprobs` (fp32 log-softmax in chunks, at the sampling temperature,
the head applied only at completion positions). A window is completed all at once so delivery
order holds. Compute runs in one dedicated thread; the event loop stays free to serve requests.

With `grpo.beta == 0` no model is loaded and samples pass straight through without ref_logprobs
(still checked against the model's config: `validate`). With `ref_server.local_reference` false no
model is loaded either, and reference replicas compute every window (toolrl.refserver.replicas);
they run this same `compute_all`.
A batch that raises is retried sample by sample; a sample that fails alone is dropped, counted
and logged with its group id (never silently).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
import threading
from queue import SimpleQueue
from typing import Any

import torch

from toolrl.config import Config
from toolrl.logprobs import completion_logprobs, pack_samples
from toolrl.models import resolve_dtype, resolve_model
from toolrl.protocol import Sample
from toolrl.refserver.checks import check_samples
from toolrl.refserver.queue import AsyncSampleQueue, Entry

WINDOW_BUDGETS = 2  # a window spans this many token budgets: room to sort by length, bounded latency


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_reference_model(cfg: Config):
    """The frozen reference: cfg.model.name in cfg.model.dtype on cfg.ref_server.device."""
    from transformers import AutoModelForCausalLM  # lazy: with beta = 0 no reference model is loaded

    dtype = getattr(torch, resolve_dtype(cfg.model.dtype))
    model = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.model.name), dtype=dtype,
                                                 trust_remote_code=cfg.model.trust_remote_code)
    model = model.to(resolve_device(cfg.ref_server.device)).eval()
    model.requires_grad_(False)
    return model


def load_model_config(cfg: Config):
    """cfg.model.name's config (config.json only: cheap), resolved as load_reference_model resolves it."""
    from transformers import AutoConfig  # lazy, as above

    try:
        return AutoConfig.from_pretrained(resolve_model(cfg.model.name), trust_remote_code=cfg.model.trust_remote_code)
    except Exception as exc:  # the server cannot check token ids without it: refuse to start, clearly
        raise RuntimeError(f"cannot read the config of model {cfg.model.name!r} (its vocabulary size bounds the "
                           f"token ids the server accepts, also with grpo.beta = 0): {exc}") from exc


BATCH_OVERHEAD_TOKENS = 64  # what one extra forward call costs, in padded-token equivalents
MAX_BATCH_ROWS = 256


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped into batches, each with rows * longest <= token_budget (a sample longer than
    the budget goes alone). Batches are runs of the length-sorted order, chosen by dynamic programming
    to minimise padded tokens + BATCH_OVERHEAD_TOKENS per batch: similar lengths share a batch, and a
    long sample does not pad a batch of short ones."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0] + [float("inf")] * n  # best[j]: cost of batching the first j sorted samples
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j - 1, max(-1, j - 1 - MAX_BATCH_ROWS), -1):  # batch = sorted[i:j]
            rows = j - i
            if rows > 1 and rows * longest > token_budget:
                break
            cost = best[i] + rows * longest + BATCH_OVERHEAD_TOKENS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    batches, j = [], n
    while j > 0:
        batches.append(order[cut[j]:j])
        j = cut[j]
    return batches[::-1]


class ComputeThread:
    """One daemon thread that owns the model's compute. Daemon, so shutting down never waits for a
    forward pass in progress (minutes on a loaded CPU); the queue is in memory and goes with it anyway."""

    def __init__(self, name: str = "ref-compute"):
        self._jobs: SimpleQueue = SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, arg, loop, fut = job
            try:
                ok, value = True, fn(arg)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                ok, value = False, exc
            try:
                loop.call_soon_threadsafe(_settle, fut, ok, value)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is waiting
                pass

    async def run(self, fn, arg):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((fn, arg, loop, fut))
        return await fut

    def close(self) -> None:
        self._jobs.put(None)


def _settle(fut: asyncio.Future, ok: bool, value) -> None:
    if not fut.done():
        fut.set_result(value) if ok else fut.set_exception(value)


class Reference:
    def __init__(self, cfg: Config, model=None, log: logging.Logger | None = None):
        rs = cfg.ref_server
        self.log = log or logging.getLogger("ref_server")
        self.enabled = cfg.grpo.beta > 0  # samples need reference logprobs
        self.local = self.enabled and (rs.local_reference or model is not None)  # ... computed here
        self.token_budget, self.chunk_rows = rs.token_budget, rs.logprob_chunk
        self.temperature = cfg.rollout.temperature
        self.model = None
        self.model_name = cfg.model.name
        if self.local:
            self.model = model if model is not None else load_reference_model(cfg)
            self.model.eval()
            self.device = next(self.model.parameters()).device
            mcfg = self.model.config
            self.pad_id = int(mcfg.pad_token_id if getattr(mcfg, "pad_token_id", None) is not None else 0)
        else:  # no model, but uploads are still checked against its vocabulary: the learner's forward needs it
            mcfg = load_model_config(cfg)
        text_cfg = mcfg.get_text_config() if hasattr(mcfg, "get_text_config") else mcfg
        self.vocab_size = int(text_cfg.vocab_size)
        self.max_len = int(getattr(text_cfg, "max_position_embeddings", 0) or cfg.model.max_model_len)
        self._compute = ComputeThread() if self.local else None
        # Stats
        self.tokens_total = self.samples_total = self.batches_total = 0
        # Padding is this process's: its forward batches' real and padded tokens (replicas' not counted)
        self.local_tokens_total = self.padded_total = 0
        self.compute_s_total = 0.0
        self.failed_total = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=4096)  # (end time, tokens) for a wall rate
        self.alive = False
        self.forward_since: float | None = None  # monotonic start of the forward running now

    def forward_running_s(self) -> float:
        """How long the forward running now has run (0 when none is)."""
        since = self.forward_since
        return 0.0 if since is None else time.monotonic() - since

    # -- validation at the door --------------------------------------------------------------
    def validate(self, samples: Sequence[Sample]) -> None:
        """Raise checks.Refused (-> HTTP 400) for a sample the model (this one, and the learner's) cannot
        take, or that could derail the learner. Also with beta = 0, when no model is loaded."""
        check_samples(samples, self.vocab_size, self.max_len)

    # -- compute (runs in the compute thread) ------------------------------------------------
    def compute(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Reference logprobs of each sample's completion tokens: one padded forward batch."""
        with torch.inference_mode():
            packed = pack_samples(samples, pad_id=self.pad_id, device=self.device)
            lp = completion_logprobs(self.model, packed, temperature=self.temperature, chunk_rows=self.chunk_rows)
            lp = lp.cpu()
        self.padded_total += packed.padded_tokens
        self.local_tokens_total += packed.num_tokens
        return [lp[i, :c].tolist() for i, c in enumerate(packed.completion_lens)]

    def compute_all(self, window: Sequence[Sample]) -> list[list[float] | None]:
        """A window's reference logprobs in length-sorted forward batches; None for a sample that failed
        even alone."""
        out: list[list[float] | None] = [None] * len(window)
        for batch in plan_batches([s.num_tokens for s in window], self.token_budget):
            try:
                for i, lp in zip(batch, self.compute([window[i] for i in batch])):
                    out[i] = lp
                self.batches_total += 1
            except Exception as exc:  # noqa: BLE001 - any failure: retry alone, never lose the window
                self.log.warning("reference batch of %d failed (%s: %s); retrying one by one",
                                 len(batch), type(exc).__name__, exc)
                for i in batch:
                    try:
                        out[i] = self.compute([window[i]])[0]
                        self.batches_total += 1
                    except Exception as exc1:  # noqa: BLE001 - counted and logged below
                        self.log.error("reference failed for a sample of group %r (%d tokens): %s: %s",
                                       window[i].group_id, window[i].num_tokens, type(exc1).__name__, exc1)
        return out

    def settle(self, queue: AsyncSampleQueue, window: list[Entry], results: list[list[float] | None],
               compute_s: float) -> tuple[int, int]:
        """Hand a computed window (here or by a replica) to the queue and count it -> (done, failed).
        Failed ones first, then the rest: the window still completes as one unit."""
        ok = [(e, r) for e, r in zip(window, results) if r is not None]
        failed = [e for e, r in zip(window, results) if r is None]
        tokens = sum(e.tokens for e, _ in ok)
        self.tokens_total += tokens
        self.samples_total += len(ok)
        self.compute_s_total += compute_s
        self._recent.append((time.monotonic(), tokens))
        if failed:
            self.failed_total += len(failed)
            queue.fail(failed)
        queue.complete([e for e, _ in ok], [r for _, r in ok], compute_s)
        return len(ok), len(failed)

    # -- the loop ----------------------------------------------------------------------------
    async def run(self, queue: AsyncSampleQueue) -> None:
        self.alive = True
        try:
            if self.enabled and not self.local:
                await asyncio.Event().wait()  # replicas take every window; nothing to do here
            while True:
                # The timeout only bounds the wait; an idle loop wakes once a second and sleeps again.
                window = await queue.take_window(WINDOW_BUDGETS * self.token_budget, timeout_s=1.0)
                if not window:
                    continue
                if not self.enabled:
                    queue.complete(window, None)
                    continue
                t0 = time.perf_counter()
                self.forward_since = time.monotonic()
                try:
                    results = await self._compute.run(self.compute_all, [e.sample for e in window])
                finally:
                    self.forward_since = None
                self.settle(queue, window, results, time.perf_counter() - t0)
        finally:
            self.alive = False

    def close(self) -> None:
        if self._compute is not None:
            self._compute.close()

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        recent = sum(t for end, t in self._recent if now - end <= 60.0)
        return {"enabled": self.enabled, "local": self.local, "model": self.model_name if self.enabled else None,
                "temperature": self.temperature, "token_budget": self.token_budget,
                "tokens_total": self.tokens_total, "samples_total": self.samples_total,
                "batches_total": self.batches_total, "compute_s_total": round(self.compute_s_total, 4),
                "tokens_per_s": round(self.tokens_total / self.compute_s_total, 2) if self.compute_s_total else 0.0,
                "tokens_per_s_last_60s": round(recent / 60.0, 2),
                "padding_fraction": (round(1 - self.local_tokens_total / self.padded_total, 4)
                                     if self.padded_total else 0.0),
                "failed_total": self.failed_total, "loop_alive": self.alive}
