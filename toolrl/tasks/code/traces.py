"""Collect teacher traces for code tasks from any OpenAI-compatible chat endpoint (a large model
behind `vllm serve`, or a hosted API), keep those whose code passes the task's tests, and save
them as jsonl for `teacher.traces_path` (read back by toolrl.tasks.code.task): one row per kept
answer, its reasoning (`thinking`) and its program (`code`) apart.

    python -m toolrl.tasks.code.traces --base-url http://127.0.0.1:8000/v1 --model NAME \\
        --tasks prepared:data/code --samples 4 --concurrency 8 --out runs/traces.jsonl

Before any task is asked, GET /models checks that the server answers, speaks the API at --base-url
and serves --model. Requests run concurrently with retries (429, 5xx and connection errors back off
and retry; other errors are reported and counted); the code is scored in the executor service with
the same harness as the rewards. Exit status 2: bad input (arguments, tasks, a server that cannot
be used as named), one line on stderr; 1: no answer came, or none passed its tests (--out is then
not written).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import NoReturn

import httpx
from tqdm import tqdm

from toolrl.config import add_config_args, config_from_args
from toolrl.executor.client import AsyncExecutorClient, ExecutorError
from toolrl.net import AUTH_REFUSED
from toolrl.executor.local import ExecutorRefused, executor_available
from toolrl.prompts import load_chat_prompt
from toolrl.tasks.base import DataError, Problem
from toolrl.tasks.code.judge import MAX_TIMEOUT_S, TestSpec, arun_tests, program_in
from toolrl.tasks.code.loaders import load_code_task
from toolrl.tasks.code.prepared import code_side, parse_prepared

_THINK = re.compile(r"<think>(.*?)</think>", re.S)


def thinking_of(message: dict) -> str:
    """The teacher's reasoning in a chat message: a separate field where the server splits it off
    (`reasoning` in vLLM's reasoning parsers, `reasoning_content` in older vLLM and other APIs), else
    the <think> block, else the prose before the first code fence."""
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        return reasoning.strip()
    content = message.get("content") or ""
    m = _THINK.search(content)
    if m:
        return m.group(1).strip()
    return content.split("```", 1)[0].strip()


class TeacherError(Exception):
    """The teacher server cannot be used as named: one line that says why."""


def check_server(base_url: str, model: str, api_key: str | None, retries: int = 3, timeout_s: float = 10.0) -> None:
    """GET /models (every OpenAI-compatible server has it: vLLM, llama.cpp, TGI, hosted APIs): the
    server answers, --base-url is its API root, and it serves `model`. Connection errors are retried
    with back-off, as a server that is still starting refuses them."""
    url = base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for attempt in range(retries + 1):
        try:
            resp = httpx.get(url, headers=headers, timeout=timeout_s)
            if not _retryable(resp.status_code):
                break
            err = f"HTTP {resp.status_code}"  # busy or still loading the model: it may answer later
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:  # no retry makes it one
            raise TeacherError(f"--base-url {base_url}: not an http(s) URL ({exc}); e.g. http://127.0.0.1:8000/v1") \
                from None
        except httpx.TransportError as exc:
            err = f"{type(exc).__name__}: {exc}"
        if attempt < retries:
            time.sleep(min(10.0, 0.5 * 2 ** attempt))
    else:
        raise TeacherError(f"cannot reach {base_url} ({err}): is the server up, and is --base-url its /v1 URL?")
    root = "--base-url should be the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1"
    if resp.status_code in AUTH_REFUSED:
        raise TeacherError(f"{url}: HTTP {resp.status_code}: the server wants a key (--api-key or OPENAI_API_KEY)")
    if resp.status_code != 200:
        raise TeacherError(f"{url}: HTTP {resp.status_code}: {root}")
    try:
        served = [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise TeacherError(f"{url}: not an OpenAI model list: {root}") from None
    if model not in served:
        raise TeacherError(f"model {model!r} is not served at {base_url}; it serves: {', '.join(served) or 'none'}")


def _retryable(status: int) -> bool:
    return status in (408, 409, 429) or status >= 500


def _message(body) -> dict:
    """The first choice's message with its content as text (a string, null, or a list of parts,
    as some APIs send it); ValueError for anything else."""
    message = body["choices"][0]["message"]
    if not isinstance(message, dict):
        raise ValueError("no message")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    if content is not None and not isinstance(content, str):
        raise ValueError("content is neither text nor parts")
    for key in ("reasoning", "reasoning_content"):
        if not isinstance(message.get(key) or "", str):
            raise ValueError(f"{key} is not text")
    if not (content or message.get("reasoning") or message.get("reasoning_content")):
        raise ValueError("an empty message")
    return {**message, "content": content}


async def _ask(http: httpx.AsyncClient, url: str, payload: dict, retries: int, stats: dict) -> dict | None:
    for attempt in range(retries + 1):
        try:
            resp = await http.post(url, json=payload)
        except httpx.TransportError as exc:
            err = f"{type(exc).__name__}: {exc}"
        else:
            if resp.status_code == 200:
                try:
                    return _message(resp.json())
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    err = f"not an OpenAI chat completion ({exc}): {resp.text[:200]}"
                    break  # it will not become one
            err = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if not _retryable(resp.status_code):
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
                  per_test_timeout_s: float = 2.0, max_timeout_s: float = MAX_TIMEOUT_S, progress: bool = True,
                  request_seed: int | None = None) -> tuple[list[dict], list[dict], dict]:
    """(kept traces, rejected answers, stats). Each problem is asked `samples` times, at most
    `concurrency` requests in flight; with `request_seed`, request k of a problem carries seed
    request_seed + k (reproducible sampling where the server honours the OpenAI `seed` field, as vLLM
    does)."""
    chat = load_chat_prompt(prompt)
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stats = {"requested": len(problems) * samples, "answered": 0, "failed_requests": 0, "retries": 0, "kept": 0,
             "unscored_tasks": 0}
    sem = asyncio.Semaphore(concurrency)
    kept, rejected = [], []

    async def one(http: httpx.AsyncClient, problem: Problem, bar) -> None:
        async def asked(pl: dict) -> dict | None:
            async with sem:  # requests, not tasks: --samples 8 --concurrency 4 is 4 in flight
                return await _ask(http, url, pl, retries, stats)
        payload = {"model": model, "messages": chat.messages(problem.question), "temperature": temperature,
                   "max_tokens": max_tokens, "n": 1}
        payloads = [payload if request_seed is None else {**payload, "seed": request_seed + k}
                    for k in range(samples)]
        msgs = await asyncio.gather(*[asked(pl) for pl in payloads])
        answers = [m for m in msgs if m is not None]
        stats["answered"] += len(answers)
        spec = TestSpec.from_json(problem.answer)
        codes = [program_in(m.get("content") or "", spec) for m in answers]
        try:
            results = await arun_tests(executor, codes, [spec] * len(codes), per_test_timeout_s, max_timeout_s)
        except ExecutorError as exc:  # the executor's failure, not the answers': unscored, the rest kept
            stats["unscored_tasks"] += 1
            tqdm.write(f"teacher_traces: could not test the answers for {problem.id}: {exc}", file=sys.stderr)
            bar.update(1)
            return
        for m, code, r in zip(answers, codes, results):
            row = {"id": problem.id, "model": model, "thinking": thinking_of(m), "code": code,
                   "passed": r.passed, "total": r.total}
            (kept if r.total and r.passed == r.total else rejected).append(row)
        stats["kept"] = len(kept)
        bar.update(1)
        bar.set_postfix(kept=len(kept), failed=stats["failed_requests"])

    # as many connections as requests in flight: httpx's default pool (100) made requests past it
    # wait for a connection, and time out there
    async with httpx.AsyncClient(headers=headers, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=concurrency)) as http:
        with tqdm(total=len(problems), desc="teacher", unit="task", disable=not progress) as bar:
            await asyncio.gather(*[one(http, p, bar) for p in problems])
    return kept, rejected, stats


def write_jsonl(path: str, rows: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def select_problems(tasks: str, which: str, seed: int, train_fraction: float) -> list[Problem]:
    """The tasks to ask: one side of their split (`prepared:DIR`: as written), or all of them."""
    if which == "all" and parse_prepared(tasks) is None:
        return load_code_task(tasks)
    sides = ["train", "test"] if which == "all" else ["test" if which == "heldout" else "train"]
    return [p for side in sides for p in code_side(tasks, side, seed, train_fraction)]


def fail(message: str, status: int = 2) -> NoReturn:
    print(f"teacher_traces: {message}", file=sys.stderr)
    raise SystemExit(status)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="teacher_traces", description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="the endpoint's /v1 URL")
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", help="sent as a bearer token (or set OPENAI_API_KEY)")
    ap.add_argument("--tasks", default="humaneval",
                    help="prepared:DIR, or humaneval, mbpp[:PATH][@SPLIT], apps[:PATH][@SPLIT][@DIFFICULTY] "
                    "joined by +")
    ap.add_argument("--split", choices=["train", "heldout", "all"], default="train",
                    help="which side of the split (teach on train; never on what you evaluate)")
    ap.add_argument("--seed", type=int, default=0, help="the split's seed (the training run's data.seed)")
    ap.add_argument("--train-fraction", type=float, default=0.8, help="the split's data.train_fraction")
    ap.add_argument("--n", type=int, help="at most this many tasks")
    ap.add_argument("--samples", type=int, default=1, help="answers asked per task")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--request-seed", type=int, help="seed request k of each task with this + k (reproducible)")
    add_config_args(ap)  # for the executor (executor.url; a private one starts if none answers)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rejected", help="also save the answers that failed their tests here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    for name, least in (("samples", 1), ("concurrency", 1), ("retries", 0), ("max_tokens", 1), ("n", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            fail(f"--{name.replace('_', '-')} {value}: must be at least {least}")
    if not 0.0 < args.train_fraction <= 1.0 or args.temperature < 0:
        fail("--train-fraction must be in (0, 1] and --temperature at least 0")
    args.config = args.config or "configs/cpu_demo.yaml"
    cfg = config_from_args(args)

    try:
        problems = select_problems(args.tasks, args.split, args.seed, args.train_fraction)
    except DataError as exc:
        fail(str(exc))
    problems = problems[:args.n] if args.n else problems
    if not problems:
        fail(f"no tasks: --tasks {args.tasks} --split {args.split} selects none")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        check_server(args.base_url, args.model, api_key, retries=args.retries)
    except TeacherError as exc:
        fail(str(exc))
    try:
        with executor_available(cfg, log=lambda m: print(m, file=sys.stderr)) as c2:
            async def run():
                async with AsyncExecutorClient(c2.executor.url, token=c2.executor.token) as ex:
                    return await collect(problems, args.base_url, args.model, ex, args.samples, args.concurrency,
                                         args.retries, args.temperature, args.max_tokens, api_key,
                                         per_test_timeout_s=c2.rewards.code_test_timeout_s,
                                         max_timeout_s=c2.executor.max_timeout_s,  # the rewards' budget
                                         progress=not args.quiet, request_seed=args.request_seed)
            kept, rejected, stats = asyncio.run(run())
    except ExecutorRefused as exc:
        fail(str(exc))
    errors = stats.pop("errors", [])
    if errors:
        stats["errors"] = errors[:5]
    print(json.dumps(stats))
    if args.rejected:
        write_jsonl(args.rejected, rejected)
    if stats["answered"] == 0:
        fail(f"no answer from {args.base_url} ({stats['requested']} asked; first error: "
             f"{errors[0] if errors else 'none given'})", 1)
    if not kept and stats["unscored_tasks"]:  # the executor's failure, not the answers'
        fail(f"the executor could not test the answers of {stats['unscored_tasks']} of {len(problems)} tasks (see "
             f"above) and none of the others passed; nothing written to {args.out}", 1)
    if not kept:
        where = f" (saved to {args.rejected})" if args.rejected else " (--rejected saves them)"
        fail(f"none of the {stats['answered']} answers passed its tests{where}; nothing written to {args.out}", 1)
    write_jsonl(args.out, kept)
    if not args.quiet:
        print(f"teacher_traces: kept {len(kept)} of {stats['answered']} answers -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
