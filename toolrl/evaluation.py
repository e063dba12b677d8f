"""Evaluation through the same tool-interleaved rollout engine the gen workers use.

Accuracy, unbiased pass@k, format compliance and tool use on a held-out set. A model is a built-in
name, an HF id or path, or a run directory (its latest export).
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

from .config import Config
from .data import DataError, Problem, arithmetic_problems, load_gsm8k, load_jsonl, load_math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), for n samples with c correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def resolve_eval_model(model: str) -> str:
    """A run directory means its latest export; anything else goes to the model layer as is."""
    p = Path(model).expanduser()
    if p.is_dir() and not (p / "config.json").is_file():
        if (p / "export" / "config.json").is_file():
            return str(p / "export")
        raise FileNotFoundError(f"{p} is neither a model directory nor a run directory with an export/")
    return model


def latest_export(runs_dir: str = "runs") -> str | None:
    exports = sorted(Path(runs_dir).glob("*/export/config.json"), key=lambda f: f.stat().st_mtime)
    return str(exports[-1].parent) if exports else None


def load_task(task: str, n: int, seed: int, level: int, train_fraction: float = 0.8) -> list[Problem]:
    """`arithmetic[:LEVEL]`, `gsm8k:PATH`, `math:PATH`, `jsonl:PATH` (question/answer fields), or
    `code:TASKS` (the held-out split of code tasks, e.g. code:humaneval; seed = the training data.seed)."""
    kind, _, arg = task.partition(":")
    if kind == "arithmetic":
        return arithmetic_problems(n, seed=seed, level=int(arg) if arg else level)
    if kind == "code":  # the held-out side of data.source=code's seeded split
        from .codetasks import load_code_task, split

        _, held = split(load_code_task(arg or "humaneval"), seed, train_fraction)
        return held[:n]
    if not arg:
        raise DataError(f"task {task!r} needs a file or hub id: {kind}:PATH")
    loaders = {"gsm8k": load_gsm8k, "math": load_math, "jsonl": load_jsonl}
    if kind not in loaders:
        raise DataError(f"unknown task {task!r}; use arithmetic[:LEVEL], gsm8k:PATH, math:PATH or jsonl:PATH")
    return loaders[kind](arg)[:n]


@contextlib.contextmanager
def executor_available(cfg: Config, log=print):
    """Use the configured executor; if nothing answers there, run a private one for the duration."""
    try:
        if httpx.get(f"{cfg.executor.url}/health", timeout=2).status_code == 200:
            yield cfg
            return
    except httpx.HTTPError:
        pass
    import subprocess

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    root = Path(__file__).resolve().parent.parent
    log(f"[eval] no executor at {cfg.executor.url}; starting a private one on port {port}")
    proc = subprocess.Popen([sys.executable, str(root / "executor_service.py"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("could not start a private executor_service")
            time.sleep(0.3)
        yield cfg.model_copy(update={"executor": cfg.executor.model_copy(update={"url": url})})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def score_program(cfg: Config, task_id: str, text: str, mode: str = "fraction", log=print) -> dict:
    """`evaluate.py score`: run one program (a file's text, or a completion with a code fence)
    against one task's tests in the executor service."""
    from .codetasks import find_task
    from .codetests import TestSpec, complete_program, extract_code, run_tests
    from .sandbox.client import ExecutorClient

    problem = find_task(task_id)
    spec = TestSpec.from_json(problem.answer)
    code = complete_program(extract_code(text) if "```" in text or "</think>" in text else text, spec)
    with executor_available(cfg, log) as c2, ExecutorClient(c2.executor.url, token=c2.executor.token) as ex:
        res = run_tests(ex, [code], [spec], per_test_timeout_s=cfg.rewards.code_test_timeout_s)[0]
    return {"task": task_id, "passed": res.passed, "total": res.total, "reward": res.reward(mode),
            "status": res.status, "detail": res.detail}


def summarize(problems: list[Problem], groups: dict[str, list], ks: list[int]) -> dict:
    samples = [s for g in groups.values() for s in g]
    n = len(samples)
    per_problem = []
    for p in problems:
        g = groups.get(p.id, [])
        answer = p.answer if len(p.answer) < 200 else p.answer[:200] + "…"  # code tasks: tests, cut
        per_problem.append({"id": p.id, "answer": answer, "n": len(g),
                            "correct": int(sum(s.rewards.get("correct", 0.0) >= 1.0 for s in g))})
    calls = [t for s in samples for t in s.tool_calls]
    from .codetests import is_spec

    fmt = "code_format" if problems and all(is_spec(p.answer) for p in problems) else "format"
    pak = {}
    for k in ks:
        vals = [pass_at_k(r["n"], r["correct"], k) for r in per_problem if r["n"] >= k]
        if vals:
            pak[str(k)] = statistics.fmean(vals)
    return {
        "n_problems": len(problems), "n_samples": n,
        "accuracy": statistics.fmean([s.rewards.get("correct", 0.0) for s in samples]) if n else 0.0,
        "pass_at_k": pak,
        "format_rate": statistics.fmean([s.rewards.get(fmt, 0.0) for s in samples]) if n else 0.0,
        "tool_calls_per_answer": len(calls) / n if n else 0.0,
        "tool_error_rate": sum(t.status != "ok" for t in calls) / len(calls) if calls else 0.0,
        "code_written_rate": statistics.fmean([bool(s.tool_calls) for s in samples]) if n else 0.0,
        "code_executed_rate": statistics.fmean([any(t.status == "ok" for t in s.tool_calls) for s in samples])
        if n else 0.0,
        "mean_completion_tokens": statistics.fmean([len(s.completion_ids) for s in samples]) if n else 0.0,
        "per_problem": per_problem,
    }


def eval_config(cfg: Config, samples_per_problem: int) -> Config:
    """The policy alone, `samples_per_problem` per group: no teacher traces in an evaluation (they
    are correct by construction and would count as the model's answers)."""
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"group_size": samples_per_problem}),
                                  "teacher": cfg.teacher.model_copy(update={"traces_per_group": 0})})


def problem_of(group_id: str) -> str:
    """The problem id in a group id `worker:problem_id:n`; problem ids may hold colons."""
    return group_id.split(":", 1)[1].rsplit(":", 1)[0]


async def run_eval(cfg: Config, problems: list[Problem], samples_per_problem: int, ks: list[int],
                   progress: bool = True) -> dict:
    from tqdm import tqdm

    from .genworker import GenWorker

    cfg = eval_config(cfg, samples_per_problem)
    worker = GenWorker(cfg, worker_id="eval")
    worker.problems = iter(problems)
    groups: dict[str, list] = {}
    t0 = time.time()
    try:
        with tqdm(total=len(problems), desc="eval", unit="problem", disable=not progress) as bar:
            async for group in worker.produce(n_groups=len(problems)):
                groups[problem_of(group[0].group_id)] = [s for s in group if s.source == "policy"]
                bar.update(1)
                done = [s for g in groups.values() for s in g]
                bar.set_postfix(acc=f"{statistics.fmean(s.rewards.get('correct', 0.0) for s in done):.3f}")
    finally:
        await worker.executor.aclose()
        worker.close()
    out = summarize(problems, groups, ks)
    out["wall_s"] = time.time() - t0
    return out


def evaluate(cfg: Config, problems: list[Problem], samples_per_problem: int, ks: list[int],
             progress: bool = True) -> dict:
    with executor_available(cfg) as cfg2:
        return asyncio.run(run_eval(cfg2, problems, samples_per_problem, ks, progress))
