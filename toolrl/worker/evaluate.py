"""Evaluation through the same tool-interleaved rollout engine the gen workers use.

Accuracy, unbiased pass@k, format compliance and tool use on a held-out set. A model is a built-in
name, an HF id or path, or a run directory (its latest export).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import statistics
from pathlib import Path

import httpx

from toolrl.config import Config
from toolrl.format import extract_code
from toolrl.tasks import Problem
from toolrl.tasks.code.judge import TestSpec, complete_program, run_tests
from toolrl.tasks.code.loaders import find_task


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


@contextlib.contextmanager
def executor_available(cfg: Config, log=print):
    """Use the configured executor; if nothing answers there, run a private one for the duration."""
    try:
        if httpx.get(f"{cfg.executor.url}/health", timeout=2).status_code == 200:
            yield cfg
            return
    except httpx.HTTPError:
        pass
    from toolrl.executor.local import LocalExecutor

    with LocalExecutor(startup_timeout_s=60) as ex:
        log(f"[eval] no executor at {cfg.executor.url}; started a private one at {ex.url}")
        yield cfg.model_copy(update={"executor": cfg.executor.model_copy(update={"url": ex.url})})


def score_program(cfg: Config, task_id: str, text: str, mode: str = "fraction", log=print) -> dict:
    """`evaluate.py score`: run one program (a file's text, or a completion with a code fence)
    against one task's tests in the executor service."""
    from toolrl.executor.client import ExecutorClient

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
    fmt = "code_format" if problems and all(p.grading == "tests" for p in problems) else "format"
    pak = {}
    for k in ks:
        vals = [pass_at_k(r["n"], r["correct"], k) for r in per_problem if r["n"] >= k]
        if vals:
            pak[str(k)] = statistics.fmean(vals)
    out = {"n_problems": len(problems), "n_samples": n, **rates(samples, fmt), "pass_at_k": pak,
           "per_problem": per_problem}
    levels = sorted({p.level for p in problems if p.level is not None})
    if len(levels) > 1:  # e.g. arithmetic:1-3: the same figures per curriculum level
        out["by_level"] = {str(lv): {"n_samples": len(g), **rates(g, fmt)} for lv in levels
                           for g in [[s for p in problems if p.level == lv for s in groups.get(p.id, [])]]}
    return out


def rates(samples: list, fmt: str = "format") -> dict:
    """Accuracy, format, tool use and length over samples."""
    n = len(samples)
    if not n:
        return {k: 0.0 for k in ("accuracy", "format_rate", "tool_calls_per_answer", "tool_error_rate",
                                 "code_written_rate", "code_executed_rate", "mean_completion_tokens")}
    calls = [t for s in samples for t in s.tool_calls]
    return {
        "accuracy": statistics.fmean([s.rewards.get("correct", 0.0) for s in samples]),
        "format_rate": statistics.fmean([s.rewards.get(fmt, 0.0) for s in samples]),
        "tool_calls_per_answer": len(calls) / n,
        "tool_error_rate": sum(t.status != "ok" for t in calls) / len(calls) if calls else 0.0,
        "code_written_rate": statistics.fmean([bool(s.tool_calls) for s in samples]),
        "code_executed_rate": statistics.fmean([any(t.status == "ok" for t in s.tool_calls) for s in samples]),
        "mean_completion_tokens": statistics.fmean([len(s.completion_ids) for s in samples]),
    }


async def run_eval(cfg: Config, problems: list[Problem], samples_per_problem: int, ks: list[int],
                   progress: bool = True, samples_out: str | None = None) -> dict:
    """evaluate.py: a private engine for the model in cfg, then GenWorker.evaluate (the same code a
    live gen worker runs for the learner's in-run evaluations). `samples_out`: a jsonl file that
    gets every rollout's text and scores, to read what the model actually wrote."""
    from tqdm import tqdm

    from toolrl.worker.producer import GenWorker

    by_id = {p.id: p for p in problems}
    worker = GenWorker(cfg, worker_id="eval")
    correct = [0.0, 0]
    dump = None
    if samples_out:
        Path(samples_out).parent.mkdir(parents=True, exist_ok=True)
        dump = open(samples_out, "w")
    try:
        with tqdm(total=len(problems), desc="eval", unit="problem", disable=not progress) as bar:
            def on_problem(pid, group):
                correct[0] += sum(s.rewards.get("correct", 0.0) for s in group)
                correct[1] += len(group)
                bar.update(1)
                bar.set_postfix(acc=f"{correct[0] / max(1, correct[1]):.3f}")
                for s in group if dump else ():
                    p = by_id[pid]
                    dump.write(json.dumps({"id": pid, "level": p.level, "question": p.question, "answer": p.answer,
                                           "text": s.text, "rewards": s.rewards, "stop_reason": s.stop_reason,
                                           "tool_calls": len(s.tool_calls)}) + "\n")

            return await worker.evaluate(problems, samples_per_problem, ks, cfg.eval.concurrency, on_problem)
    finally:
        if dump:
            dump.close()
        await worker.executor.aclose()
        worker.close()


def evaluate_on_worker(cfg: Config, workers: list[dict], version: int, pushed: dict | None = None) -> dict:
    """The learner's in-run evaluation: a live worker holding policy `version` (as the registry, or
    the learner's own record of what it pushed, says) runs the `eval` section's problems with its
    engine. Raises RuntimeError when no worker holds it or the request fails."""
    from toolrl.net import auth_headers

    pushed = pushed or {}
    holding = [w for w in workers
               if int(w.get("policy_version", -1)) == version or pushed.get((w["id"], w["url"])) == version]
    if not holding:
        raise RuntimeError(f"no live worker holds policy version {version} "
                           f"(workers: {[(w['id'], w.get('policy_version')) for w in workers]})")
    w, e = holding[0], cfg.eval
    body = {"task": e.task, "n_problems": e.n_problems, "samples": e.samples, "ks": e.ks, "seed": e.seed,
            "concurrency": e.concurrency}
    try:
        r = httpx.post(f"{w['url']}/evaluate", json=body, headers=auth_headers(cfg.rollout.token), timeout=e.timeout_s)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"evaluation on worker {w['id']} failed: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        raise RuntimeError(f"evaluation on worker {w['id']} failed: HTTP {r.status_code}: {r.text[:300]}")
    res = r.json()
    if res.get("policy_version") != version:
        raise RuntimeError(f"worker {w['id']} evaluated version {res.get('policy_version')}, not {version}")
    res["worker_id"] = w["id"]
    return res


def evaluate(cfg: Config, problems: list[Problem], samples_per_problem: int, ks: list[int],
             progress: bool = True, samples_out: str | None = None) -> dict:
    with executor_available(cfg) as cfg2:
        return asyncio.run(run_eval(cfg2, problems, samples_per_problem, ks, progress, samples_out))
