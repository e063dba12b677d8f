"""Collect teacher traces for code tasks from any OpenAI-compatible chat endpoint (a large model
behind `vllm serve`, or a hosted API), keep those whose code passes the task's tests, and save
them as jsonl for `teacher.traces_path` (read back by toolrl.tasks.code.task).

    python -m toolrl.tasks.code.traces --base-url http://127.0.0.1:8000/v1 --model NAME \\
        --tasks humaneval --samples 4 --concurrency 8 --out runs/traces.jsonl

Requests run concurrently with retries (429, 5xx and connection errors back off and retry; other
errors are reported and counted); the code is scored in the executor service with the same
harness as the rewards.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
from pathlib import Path

import httpx
from tqdm import tqdm

from toolrl.config import load_config
from toolrl.executor.client import AsyncExecutorClient
from toolrl.prompts import load_chat_prompt
from toolrl.tasks.base import Problem
from toolrl.tasks.code.judge import TestSpec, arun_tests, program_in
from toolrl.tasks.code.loaders import load_code_task, split
from toolrl.executor.local import executor_available

_THINK = re.compile(r"<think>(.*?)</think>", re.S)


def split_thinking(content: str, reasoning: str | None = None) -> str:
    """The teacher's reasoning: a separate `reasoning_content` (vLLM reasoning parsers), else the
    <think> block, else the prose before the first code fence."""
    if reasoning:
        return reasoning.strip()
    m = _THINK.search(content)
    if m:
        return m.group(1).strip()
    return content.split("```", 1)[0].strip()


async def _ask(http: httpx.AsyncClient, url: str, payload: dict, retries: int, stats: dict) -> dict | None:
    for attempt in range(retries + 1):
        try:
            resp = await http.post(url, json=payload)
        except httpx.TransportError as exc:
            err = f"{type(exc).__name__}: {exc}"
        else:
            if resp.status_code == 200:
                return resp.json()["choices"][0]["message"]
            err = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if resp.status_code not in (408, 409, 429) and resp.status_code < 500:
                break  # a bad request stays bad
        if attempt < retries:
            stats["retries"] += 1
            await asyncio.sleep(min(30.0, 0.5 * 2 ** attempt) * (0.5 + random.random()))
    stats["failed_requests"] += 1
    stats.setdefault("errors", []).append(err)
    return None


async def collect(problems: list[Problem], base_url: str, model: str, executor, samples: int = 1,
                  concurrency: int = 8, retries: int = 3, temperature: float = 0.7, max_tokens: int = 1024,
                  api_key: str | None = None, prompt: str = "code", timeout_s: float = 300.0,
                  per_test_timeout_s: float = 2.0, progress: bool = True,
                  request_seed: int | None = None) -> tuple[list[dict], list[dict], dict]:
    """(kept traces, rejected answers, stats). Each problem is asked `samples` times; with
    `request_seed`, request k of a problem carries seed request_seed + k (reproducible sampling
    where the server honours the OpenAI `seed` field, as vLLM does)."""
    chat = load_chat_prompt(prompt)
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stats = {"requested": len(problems) * samples, "answered": 0, "failed_requests": 0, "retries": 0, "kept": 0}
    sem = asyncio.Semaphore(concurrency)
    kept, rejected = [], []

    async def one(http: httpx.AsyncClient, problem: Problem, bar) -> None:
        async with sem:
            payload = {"model": model, "messages": chat.messages(problem.question), "temperature": temperature,
                       "max_tokens": max_tokens, "n": 1}
            payloads = [payload if request_seed is None else {**payload, "seed": request_seed + k}
                        for k in range(samples)]
            msgs = await asyncio.gather(*[_ask(http, url, pl, retries, stats) for pl in payloads])
        answers = [m for m in msgs if m is not None]
        stats["answered"] += len(answers)
        spec = TestSpec.from_json(problem.answer)
        codes = [program_in(m.get("content") or "", spec) for m in answers]
        results = await arun_tests(executor, codes, [spec] * len(codes), per_test_timeout_s)
        for m, code, r in zip(answers, codes, results):
            row = {"id": problem.id, "model": model, "thinking": split_thinking(m.get("content") or "",
                                                                                 m.get("reasoning_content")),
                   "code": code, "passed": r.passed, "total": r.total}
            (kept if r.total and r.passed == r.total else rejected).append(row)
        stats["kept"] = len(kept)
        bar.update(1)
        bar.set_postfix(kept=len(kept), failed=stats["failed_requests"])

    async with httpx.AsyncClient(headers=headers, timeout=timeout_s) as http:
        with tqdm(total=len(problems), desc="teacher", unit="task", disable=not progress) as bar:
            await asyncio.gather(*[one(http, p, bar) for p in problems])
    return kept, rejected, stats


def write_jsonl(path: str, rows: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="the endpoint's /v1 URL")
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", help="sent as a bearer token (or set OPENAI_API_KEY)")
    ap.add_argument("--tasks", default="humaneval",
                    help="humaneval, mbpp[:PATH][@SPLIT], apps[:PATH][@SPLIT][@DIFFICULTY], joined by +")
    ap.add_argument("--split", choices=["train", "heldout", "all"], default="train",
                    help="which side of the seeded split (teach on train; never on what you evaluate)")
    ap.add_argument("--seed", type=int, default=0, help="the split's seed (the training run's data.seed)")
    ap.add_argument("--n", type=int, help="at most this many tasks")
    ap.add_argument("--samples", type=int, default=1, help="answers asked per task")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--request-seed", type=int, help="seed request k of each task with this + k (reproducible)")
    ap.add_argument("--config", default="configs/cpu_demo.yaml", help="for the executor URL")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rejected", help="also save the answers that failed their tests here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    problems = load_code_task(args.tasks)
    if args.split != "all":
        train, held = split(problems, args.seed)
        problems = train if args.split == "train" else held
    problems = problems[:args.n] if args.n else problems
    cfg = load_config(args.config)
    with executor_available(cfg, log=lambda m: print(m, file=sys.stderr)) as c2:
        async def run():
            async with AsyncExecutorClient(c2.executor.url, token=c2.executor.token) as ex:
                return await collect(problems, args.base_url, args.model, ex, args.samples, args.concurrency,
                                     args.retries, args.temperature, args.max_tokens,
                                     args.api_key or os.environ.get("OPENAI_API_KEY"), progress=not args.quiet,
                                     request_seed=args.request_seed)
        kept, rejected, stats = asyncio.run(run())
    write_jsonl(args.out, kept)
    if args.rejected:
        write_jsonl(args.rejected, rejected)
    stats.pop("errors", None) if not stats.get("errors") else stats.update(errors=stats["errors"][:5])
    print(json.dumps(stats))
    if stats["answered"] == 0:
        raise SystemExit(f"teacher_traces: no answer from {args.base_url}")


if __name__ == "__main__":
    main()
