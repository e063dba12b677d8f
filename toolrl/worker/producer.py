"""The producer: what the training worker feeds its agent and what it makes of the result.

It draws problems from the task's seeded stream (toolrl.tasks), keeps `prompts_per_step` groups in
flight, each of `group_size` rollouts by the agent, scores them, adds teacher traces, moves the
curriculum on accuracy, and yields whole groups. A group that cannot be scored for a reason that is
not the model's (an aborted rollout, a program or test run the executor could not do) is left out
and counted, never trained on as the model's failure.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from toolrl.config import Config
from toolrl.executor.client import ExecutorError
from toolrl.net import AUTH_REFUSED
from toolrl.grpo import zero_variance
from toolrl.protocol import Sample
from toolrl.tasks import Problem, get_task, problem_stream
from toolrl.worker.agent import Agent, agent_seed
from toolrl.worker.rewards import VerifierUnavailable
from toolrl.worker.rollout import FixedVersion, Rollout
from toolrl.worker.teacher import teacher_sample

log = logging.getLogger("gen_worker")


@dataclass
class Stats:
    started: float = field(default_factory=time.time)
    samples: int = 0
    groups: int = 0
    tokens: int = 0  # model-generated tokens
    tool_calls: int = 0
    tool_errors: int = 0
    zero_std_groups: int = 0
    dropped_groups: int = 0
    aborted_groups: int = 0
    stopped_at_end: int = 0  # groups in flight when the learner finished: stopped, never trained
    failed_groups: int = 0
    teacher_traces: int = 0
    unscored_groups: int = 0  # groups the machine could not grade: tests not run, no verifier
    tool_unavailable_groups: int = 0  # a program the executor could not run: left out, not scored 0
    flow_waits: int = 0  # times a group could not start for want of room (flow control)
    upload_waits: int = 0
    upload_wait_s: float = 0.0
    refused_groups: int = 0  # groups the reference server refused (a bad sample): left out, not retried
    updates: int = 0
    last_reload_s: float = 0.0
    reward_sum: float = 0.0
    correct_sum: float = 0.0
    interruptions: int = 0  # model segments cut short by a weight update and resumed
    mixed_version_samples: int = 0  # samples holding tokens of more than one policy version

    def count_group(self, rolls: list[Rollout], samples: list[Sample]) -> None:
        self.groups += 1
        self.samples += len(samples)
        self.tokens += sum(r.generated for r in rolls)
        self.tool_calls += sum(len(r.tool_calls) for r in rolls)
        self.tool_errors += sum(1 for r in rolls for t in r.tool_calls if t.status != "ok")
        self.reward_sum += sum(s.reward for s in samples)
        self.correct_sum += sum(s.rewards.get("correct", 0.0) for s in samples)
        self.interruptions += sum(r.interruptions for r in rolls)
        self.mixed_version_samples += sum(len(s.version_runs) > 1 for s in samples)
        if zero_variance([s.reward for s in samples]):
            self.zero_std_groups += 1

    def as_dict(self) -> dict:
        up = max(1e-9, time.time() - self.started)
        d = {k: v for k, v in self.__dict__.items() if k != "started"}
        d.update(uptime_s=up, samples_per_s=self.samples / up, tokens_per_s=self.tokens / up,
                 reward_mean=self.reward_sum / max(1, self.samples), accuracy=self.correct_sum / max(1, self.samples))
        return d


_STATE_KEYS = {"source", "level", "drawn", "recent_acc", "groups"}
GRANT_WAIT_S = 10.0  # with nothing in flight, how long one grant request waits on the server for room
FLOW_RECHECK_S = 1.0  # with groups in flight and no room, how often to ask again


class Flow(Protocol):
    """Flow control as the producer sees it (toolrl.worker.service binds it to the reference server)."""

    async def grant(self, wait_s: float) -> tuple[bool, str | None]: ...

    async def give_back(self, grant_id: str) -> None: ...


class Producer:
    def __init__(self, cfg: Config, agent: Agent, stats: Stats | None = None):
        self.cfg, self.agent = cfg, agent
        self.stats = stats or Stats()
        self.task = get_task(cfg.data.source)
        self.level = cfg.data.level
        self.problems = problem_stream(cfg.data, agent.name, self.level)
        self.drawn = 0  # problems drawn from the current level's stream (a restart skips as many)
        self.groups = 0  # groups started: the next group's index, which seeds its teacher traces
        self._restores = 0  # groups started before a restore must not move the restored curriculum
        self._recent_acc: collections.deque = collections.deque(maxlen=cfg.data.promote_window)
        self._teacher = self.task.teacher(cfg.teacher)
        self._seed = agent_seed(agent.name, cfg.data.seed)
        self.flow: Flow | None = None  # flow control (set by the training worker); None: no limit
        self._grants: dict[int, str] = {}  # id(yielded group) -> its grant, until uploaded
        self._pending: dict = {}  # the groups in flight (produce)
        self.training_over = False  # the learner has finished: no group starts (end_training)
        self._failures = 0  # groups in a row that raised
        # What one group uploads, which is what its grant asks for: its rollouts and teacher traces.
        self.group_samples = cfg.rollout.group_size + (cfg.teacher.traces_per_group if self._teacher else 0)

    # -- where the stream stands, for a restart from a checkpoint -------------------------------
    def state(self) -> dict:
        """Small JSON that `restore` turns back into this position: the stream, the curriculum and
        the teacher's randomness (a function of the group index) all continue where they were."""
        return {"source": self.cfg.data.source, "level": self.level, "drawn": self.drawn,
                "recent_acc": list(self._recent_acc), "groups": self.groups}

    def restore(self, state: dict) -> None:
        """Continue at `state` (from `state()`): the next problem drawn is the one this producer drew
        next when the state was taken. ValueError, and nothing changed, when the state does not fit."""
        d = self.cfg.data
        if not isinstance(state, dict) or set(state) != _STATE_KEYS:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"producer state must be an object with keys {sorted(_STATE_KEYS)}, got {got}")
        if state["source"] != d.source:
            raise ValueError(f"producer state is for data.source {state['source']!r}, this run trains on {d.source!r}")

        def count(key: str) -> int:
            v = state[key]
            if type(v) is not int or v < 0:
                raise ValueError(f"producer state: {key} must be a non-negative integer, got {v!r}")
            return v
        level, drawn, groups = count("level"), count("drawn"), count("groups")
        if not d.level <= level <= d.max_level:
            raise ValueError(f"producer state: level {level} is outside data.level..data.max_level "
                             f"({d.level}..{d.max_level})")
        if drawn > groups:  # every draw starts a group, so a larger count is not one of ours
            raise ValueError(f"producer state: drawn ({drawn}) is more than groups ({groups})")
        acc = state["recent_acc"]
        if not isinstance(acc, list) or not all(type(a) in (int, float) and math.isfinite(a) and 0 <= a <= 1
                                                for a in acc):
            raise ValueError(f"producer state: recent_acc must be a list of accuracies in [0, 1], got {acc!r}")
        problems = problem_stream(d, self.agent.name, level)
        next(itertools.islice(problems, drawn, drawn), None)  # skip what was drawn before
        self.level, self.problems, self.drawn, self.groups = level, problems, drawn, groups
        self._recent_acc.clear()
        self._recent_acc.extend(float(a) for a in acc)
        self._restores += 1

    def next_problem(self) -> tuple[int, Problem]:
        """The next problem of the stream and its group index; counted, so `state` knows where we are."""
        problem = next(self.problems)
        self.drawn += 1
        self.groups += 1
        return self.groups - 1, problem

    def teacher_rng(self, key: int | str) -> random.Random:
        """The teacher's randomness for one group, from its position rather than one sequence shared
        by all groups: a restored producer (or groups finishing in another order) word traces the same."""
        return random.Random(f"{self._seed}:{key}")

    # -- one group ------------------------------------------------------------------------------
    async def rollout_group(self, problem: Problem, index: int | None = None) -> list[Sample] | None:
        """group_size rollouts of one problem, scored, with group advantages and teacher traces.
        None when the group is left out (aborted, or its tests could not be run). `index`: the group's
        place in the stream (from `next_problem`); a problem from elsewhere seeds the teacher by its id."""
        a, restores, level = self.agent, self._restores, self.level
        gid, prompt = a.group_id(problem.id), a.prompt_ids(problem.question)
        key = f"{a.name}:{problem.id if index is None else index}"  # the sampler's seeds (rollout.seeded)
        if a.gate is not None and self.cfg.rollout.interruptible:  # updates cut in; versions per token
            version = a.gate.version
            rolls = await a.rollouts(prompt, gid, self.cfg.rollout.group_size, a.gate, seed_key=key)
        else:
            async with a.gated() as version:
                rolls = await a.rollouts(prompt, gid, self.cfg.rollout.group_size, FixedVersion(version),
                                         seed_key=key)
        if any(r.stop_reason == "abort" for r in rolls):
            self.stats.aborted_groups += 1
            return None
        if any(r.stop_reason == "tool_unavailable" for r in rolls):
            self.stats.tool_unavailable_groups += 1
            log.warning("the executor could not run a program of %s; group left out of training", problem.id)
            return None
        try:
            tests = await a.run_tests(problem, rolls)
        except ExecutorError as exc:
            if exc.status_code in AUTH_REFUSED:
                raise  # a wrong token refuses every test run: stop, and say why
            self.stats.unscored_groups += 1
            log.warning("could not run the tests of %s, group dropped: %s", problem.id, exc)
            return None
        try:
            group = await asyncio.to_thread(a.score, problem, rolls, gid, version, tests)
        except VerifierUnavailable as exc:  # the machine's failure: no answer could be graded
            self.stats.unscored_groups += 1
            log.warning("could not grade the answers of %s, group left out: %s", problem.id, exc)
            return None
        self.stats.count_group(rolls, group)
        # else it was drawn at a position a restore replaced, or before a promotion (an easier
        # level's group must not count toward the new level's window)
        if restores == self._restores and level == self.level:
            self._curriculum(group)
        rng = self.teacher_rng(problem.id if index is None else index)
        for k in range(self.cfg.teacher.traces_per_group if self._teacher else 0):
            t = await teacher_sample(self._teacher(problem, rng), prompt, a.tokenizer, a.tool,
                                     self.cfg.rollout.max_tool_output_tokens, f"{gid}:teacher{k}", version,
                                     self.cfg.prompt.prefill)
            if t is not None:
                group.append(t)
                self.stats.teacher_traces += 1
        return group

    def _curriculum(self, group: list[Sample]) -> None:
        """Tasks with a curriculum (arithmetic): move to the next level when recent accuracy passes the threshold."""
        d = self.cfg.data
        if not self.task.curriculum:
            return
        self._recent_acc.append(sum(s.rewards.get("correct", 0.0) for s in group) / len(group))
        full = len(self._recent_acc) == self._recent_acc.maxlen
        if full and self.level < d.max_level and sum(self._recent_acc) / len(self._recent_acc) >= d.promote_at_accuracy:
            self.level += 1
            self._recent_acc.clear()
            self.problems, self.drawn = problem_stream(d, self.agent.name, self.level), 0
            log.info("curriculum: accuracy passed %.2f, moving to level %d", d.promote_at_accuracy, self.level)

    # -- the stream of groups -------------------------------------------------------------------
    async def produce(self, n_groups: int | None = None) -> AsyncIterator[list[Sample]]:
        """Yield scored groups, keeping up to `prompts_per_step` groups in flight. With flow control
        (`self.flow`), a group starts only under a grant from the reference server: room the learner
        can still use within max_staleness (toolrl.refserver.flow). A yielded group's grant is handed
        to whoever uploads it (`take_grant`); a group left out gives its grant back."""
        width = self.cfg.rollout.prompts_per_step
        pending: dict[asyncio.Task, str | None] = {}  # task -> its grant
        self._pending = pending
        started = 0
        while True:
            while len(pending) < width and (n_groups is None or started < n_groups) and not self.training_over:
                grant = None
                if self.flow is not None:
                    # With groups in flight only a quick look: their results must not wait on the server.
                    ok, grant = await self.flow.grant(0.0 if pending else GRANT_WAIT_S)
                    if not ok:
                        self.stats.flow_waits += 1
                        break
                    if self.training_over:  # granted just before the learner finished
                        await self.give_back(grant)
                        break
                index, problem = self.next_problem()
                task = asyncio.create_task(self.rollout_group(problem, index))
                if self.agent.gate is not None and not self.cfg.rollout.interruptible:
                    self.agent.gate.track(task)  # cancelled, not awaited, if a drain times out
                pending[task] = grant
                started += 1
            if not pending:
                if n_groups is not None and started >= n_groups:
                    return
                if self.training_over:
                    await asyncio.sleep(FLOW_RECHECK_S)  # until the learner trains again (end_training)
                continue  # no room yet: the grant request above waited on the server; ask again
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED,
                                         timeout=FLOW_RECHECK_S if self.flow is not None else None)
            for task in done:
                grant = pending.pop(task)
                group = self._result(task)
                if group is None:
                    await self.give_back(grant)
                    continue
                if grant is not None:
                    self._grants[id(group)] = grant
                yield group

    def _result(self, task: asyncio.Task) -> list[Sample] | None:
        """A finished group task's group, or None when it is left out (and counted)."""
        if task.cancelled():
            if not self.training_over:  # else counted in stopped_at_end
                self.stats.aborted_groups += 1
            return None
        if task.exception() is not None:
            exc = task.exception()
            if isinstance(exc, ExecutorError) and exc.status_code in AUTH_REFUSED:
                raise exc  # a refused token refuses every program: stop now, and say why
            # One broken group must not take the worker down; a persistent failure must.
            self.stats.failed_groups += 1
            self._failures += 1
            log.error("a rollout group failed: %r", task.exception(), exc_info=task.exception())
            if self._failures >= 5:
                raise RuntimeError("5 rollout groups in a row failed") from task.exception()
            return None
        self._failures = 0
        group = task.result()
        # dynamic sampling judges the policy's samples: teacher traces (reward 1 by construction) would
        # give every group variance; a group without policy signal goes with its traces
        if group is not None and self.cfg.grpo.drop_zero_std_groups and zero_variance(
                [s.reward for s in group if s.source == "policy"]):
            self.stats.dropped_groups += 1
            return None
        return group

    def end_training(self, over: bool = True) -> int:
        """The learner has finished (`over`), or trains again. Finished: the groups in flight stop now
        (their requests aborted in the engine, their grants given back) and no new one starts (the
        reference server grants none either), so nothing competes with the final evaluation on the
        engine. -> groups stopped."""
        if over == self.training_over:
            return 0
        self.training_over = over
        if not over:
            return 0
        stopping = [t for t in self._pending if not t.done()]
        for t in stopping:
            t.cancel()
        self.stats.stopped_at_end += len(stopping)
        return len(stopping)

    @property
    def inflight(self) -> int:
        """Groups being rolled out now (a finished one waiting for the uploader to ask for it is not)."""
        return sum(not t.done() for t in self._pending)

    def take_grant(self, group: list[Sample]) -> str | None:
        """The flow-control grant of a yielded group: its upload ends it."""
        return self._grants.pop(id(group), None)

    async def give_back(self, grant: str | None) -> None:
        if grant is None or self.flow is None:
            return
        try:
            await self.flow.give_back(grant)
        except Exception as exc:  # noqa: BLE001 - the server takes it back when its lease runs out
            log.warning("could not give back a flow-control grant: %s", exc)
