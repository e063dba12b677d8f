"""The agent: the policy acting on problems. A question becomes prompt ids, `n` rollouts with the
Python tool loop (toolrl.worker.rollout), and scored samples with group advantages.

This is all that generating text needs: the training worker (toolrl.worker.service), evaluate.py and
inference.py each build one. Training adds the producer (problems, curriculum, teacher) and the
weight gate around it; an agent without a gate runs with whatever weights its engine holds.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import zlib

from toolrl.config import Config
from toolrl.executor.client import AsyncExecutorClient, ExecutorError
from toolrl.grpo import advantages
from toolrl.metrics import summarize
from toolrl.models import load_tokenizer, resolve_model
from toolrl.prompts import load_chat_prompt
from toolrl.protocol import INFRA_FAILED, Sample
from toolrl.tasks import Problem
from toolrl.tasks.code.judge import TestSpec, arun_tests, program_in
from toolrl.worker.engine import VllmEngine
from toolrl.worker.rewards import Completion, VerifierUnavailable, check_names, score, weights_at
from toolrl.worker.rollout import (ExecutorTool, FixedVersion, Rollout, Versions, pending_program, request_seed,
                                   run_rollout)

log = logging.getLogger("gen_worker")


def agent_seed(name: str, data_seed: int) -> int:
    """Each agent's own sampling seed: data.seed moves every random choice of a run (problems,
    sampling, teacher wording), so runs with different seeds are independent repeats."""
    return zlib.crc32(name.encode()) + 7919 * data_seed


class EvaluationUnscored(RuntimeError):
    """No held-out sample could be scored, every one lost to infrastructure failures (the executor or
    the engine): an accuracy would be theirs, not the model's."""


class Agent:
    def __init__(self, cfg: Config, name: str, engine: VllmEngine | None = None):
        """`name` makes request and session ids unique (the worker id); `engine` defaults to a new
        vLLM engine for cfg.model (tests pass a scripted one)."""
        check_names(weights_at(cfg.rewards, 0))
        self.cfg, self.name = cfg, name
        self.tokenizer = load_tokenizer(cfg.model.name)
        self.engine = engine or VllmEngine(cfg, resolve_model(cfg.model.name),
                                           seed=agent_seed(name, cfg.data.seed) % 2**31)
        ex = cfg.executor
        self.executor = AsyncExecutorClient(ex.url, token=ex.token, timeout_s=ex.client_timeout_s,
                                            retries=ex.client_retries)
        self.tool = ExecutorTool(self.executor, timeout_s=ex.timeout_s)
        self.chat_prompt = load_chat_prompt(cfg.prompt.system)
        self.pending_code = pending_program(cfg.prompt.prefill, cfg.rollout.stop_marker)
        self.gate = None  # a toolrl.weightsync.gate.WeightGate when weights are updated live
        self._ids = itertools.count()

    def group_id(self, problem_id: str, kind: str = "") -> str:
        return f"{self.name}:{kind}{problem_id}:{next(self._ids)}"

    def prompt_ids(self, question: str) -> list[int]:
        return self.chat_prompt.ids(self.tokenizer, question, self.cfg.prompt.prefill)

    def gated(self):
        """Rollouts run inside this; yields the policy version they run under (0 without a gate)."""
        return self.gate.rollout() if self.gate is not None else contextlib.nullcontext(0)

    # -- acting ---------------------------------------------------------------------------------
    async def rollouts(self, prompt: list[int], gid: str, n: int, versions: Versions | None = None,
                       seed_key: str | None = None, temperature: float | None = None) -> list[Rollout]:
        """n rollouts of one prompt; `{gid}.{i}` are the request ids and the executor session ids.
        Each is its own request, so one sample's tool call never stalls the others. `versions`:
        the gate for interruptible rollouts, else FixedVersion(the version they run under).
        `seed_key`: with rollout.seeded, the group's place in the problem stream, whence each
        sample's seed (toolrl.worker.rollout.request_seed). `temperature`: None for the rollout
        temperature, 0 for greedy decoding."""
        seeds = [request_seed(self.cfg.data.seed, seed_key, i) if self.cfg.rollout.seeded and seed_key else None
                 for i in range(n)]
        return await asyncio.gather(*[run_rollout(self.engine, self.tool, self.tokenizer, prompt, self.cfg.rollout,
                                                  f"{gid}.{i}", self.pending_code, versions, seeds[i], temperature)
                                      for i in range(n)])

    async def answer(self, question: str, request_id: str) -> Rollout:
        """One rollout of a free-form question (inference.py)."""
        async with self.gated() as v:
            return (await self.rollouts(self.prompt_ids(question), request_id, 1, FixedVersion(v)))[0]

    # -- scoring --------------------------------------------------------------------------------
    async def run_tests(self, problem: Problem, rolls: list[Rollout]) -> list | None:
        """Problems graded by tests: every rollout's program against them, one executor batch per
        group. None for other problems. Raises ExecutorError when the executor could not run them:
        the caller leaves the group out (a reward of 0 for an unscored program is no signal)."""
        if problem.grading != "tests":
            return None
        spec = TestSpec.from_json(problem.answer)
        programs = [program_in(r.texts(self.tokenizer, self.cfg.prompt.prefill)[1], spec) for r in rolls]
        return await arun_tests(self.executor, programs, [spec] * len(programs),
                                self.cfg.rewards.code_test_timeout_s, self.cfg.executor.max_timeout_s)

    def score(self, problem: Problem, rolls: list[Rollout], gid: str, version: int,
              tests: list | None = None) -> list[Sample]:
        """The rollouts of one problem as samples: rewards at `version` (where the group began), then
        group advantages. Each sample's version is its oldest token's (a rollout interrupted by an
        update holds several: Sample.version_runs)."""
        samples = []
        for i, r in enumerate(rolls):
            text, final = r.texts(self.tokenizer, self.cfg.prompt.prefill)
            c = Completion(text, final, r.tool_calls, tests[i] if tests else None, problem.grading)
            rewards, total = score(c, problem.answer, self.cfg.rewards, version)
            runs = r.version_runs if len(r.version_runs) > 1 else []  # one version: policy_version says it
            samples.append(Sample(prompt_ids=r.prompt_ids, completion_ids=r.completion_ids, loss_mask=r.loss_mask,
                                  logprobs=r.logprobs, rewards=rewards, reward=total, group_id=gid,
                                  policy_version=r.version_runs[0][1] if r.version_runs else version,
                                  version_runs=runs, stop_reason=r.stop_reason, tool_calls=r.tool_calls, text=text))
        for s, a in zip(samples, advantages([s.reward for s in samples], self.cfg.grpo)):
            s.advantage = a
        return samples

    # -- held-out evaluation --------------------------------------------------------------------
    async def evaluate(self, problems: list[Problem], samples: int, ks: list[int], concurrency: int = 16,
                       on_problem=None, temperature: float | None = None) -> dict:
        """`samples` rollouts of each problem with the weights held now: the policy alone (no teacher
        traces), scored as in training, counted in no training statistic. Behind a gate, a weight
        update drains these rollouts like any others. `temperature`: None samples at the rollout
        temperature, 0 decodes greedily (eval.temperature); the result names the one used."""
        sem = asyncio.Semaphore(concurrency)
        version = self.gate.version if self.gate is not None else 0
        versions: set[int] = set()  # the policies the problems were evaluated under (each within the gate)
        groups: dict[str, list[Sample]] = {}
        aborted = unscored = 0
        t0 = time.time()

        async def one(problem: Problem) -> None:
            nonlocal aborted, unscored
            async with sem:
                async with self.gated() as v:
                    versions.add(v)
                    gid = self.group_id(problem.id, "eval:")
                    rolls = await self.rollouts(self.prompt_ids(problem.question), gid, samples, FixedVersion(v),
                                                temperature=temperature)
                kept = [r for r in rolls if r.stop_reason not in INFRA_FAILED]  # not the model's doing
                aborted += len(rolls) - len(kept)
                try:
                    tests = await self.run_tests(problem, kept) if kept else None
                except ExecutorError as exc:
                    unscored += 1
                    log.warning("could not run the tests of %s, left out of the evaluation: %s", problem.id, exc)
                    return
                try:
                    groups[problem.id] = await asyncio.to_thread(self.score, problem, kept, gid, v, tests)
                except VerifierUnavailable as exc:
                    unscored += 1
                    log.warning("could not grade %s, left out of the evaluation: %s", problem.id, exc)
                    return
                if on_problem is not None:
                    on_problem(problem.id, groups[problem.id])

        tasks = [asyncio.ensure_future(one(p)) for p in problems]
        try:
            await asyncio.gather(*tasks)
        except ExecutorError as exc:  # only a refused token (401/403) gets here: every problem would fail alike
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise EvaluationUnscored(f"the executor refused this worker: {exc}") from None
        if problems and not any(groups.values()):
            raise EvaluationUnscored(f"no held-out sample of {len(problems)} problems could be scored: {aborted} "
                                     f"rollouts ended by infrastructure failures, {unscored} problems could not be "
                                     "tested or graded (is the executor up?)")
        out = summarize(problems, groups, ks)
        # the oldest and newest policy a problem was evaluated under: the version read before the
        # first problem passed the gate could be one an update in progress was replacing (found in review)
        out.update(policy_version=min(versions, default=version), policy_version_end=max(versions, default=version),
                   aborted_samples=aborted, unscored_problems=unscored, wall_s=time.time() - t0,
                   temperature=self.cfg.rollout.temperature if temperature is None else temperature)
        return out

    async def aclose(self) -> None:
        await self.executor.aclose()
        self.engine.shutdown()
