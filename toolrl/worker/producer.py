"""The gen worker: rollouts with the tool loop, rewards, group advantages, upload, weight updates.

One asyncio loop runs everything: the HTTP server (weight updates, health, stats), the producer
(`prompts_per_step` groups in flight, each of `group_size` rollouts sharing the vLLM engine), the
uploader (waits when the reference server is full, never drops a group) and the heartbeat.

Weight updates and versions: a sample is tagged with the policy version its rollout *started*
under, and in-flight rollouts finish on those weights: when the first bucket of an update
arrives, new rollouts are held back and the in-flight ones drain (aborted and discarded only
after `rollout.drain_timeout_s`) while the rest arrives; the weights are then loaded in place as
the buckets land, the prefix cache is reset, and rollouts resume under the new version. So no
sample mixes two policies.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import random
import json
import logging
import os
import socket
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from toolrl.grpo import group_advantages, zero_variance
from toolrl.tasks.code.judge import TestSpec, arun_tests, program_in
from toolrl.config import Config
from toolrl.tasks import Problem, get_task, problem_stream
from toolrl.net import wait_for
from toolrl.worker.engine import VllmEngine
from toolrl.models import load_tokenizer, resolve_model
from toolrl.prompts import load_chat_prompt
from toolrl.protocol import Sample, sample_record
from toolrl.worker.rewards import Completion, check_names, score, weights_at
from toolrl.worker.rollout import ExecutorTool, Rollout, pending_program, run_rollout
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
    failed_groups: int = 0
    teacher_traces: int = 0
    unscored_groups: int = 0  # code tasks whose tests the executor could not run
    upload_waits: int = 0
    upload_wait_s: float = 0.0
    updates: int = 0
    last_reload_s: float = 0.0
    reward_sum: float = 0.0
    correct_sum: float = 0.0

    def as_dict(self, version: int, inflight: int) -> dict:
        up = max(1e-9, time.time() - self.started)
        d = {k: v for k, v in self.__dict__.items() if k != "started"}
        d.update(uptime_s=up, samples_per_s=self.samples / up, tokens_per_s=self.tokens / up,
                 policy_version=version, inflight_groups=inflight,
                 reward_mean=self.reward_sum / max(1, self.samples), accuracy=self.correct_sum / max(1, self.samples))
        return d


def prompt_ids(tokenizer, chat_prompt, question: str, prefill: str = "") -> list[int]:
    """Chat template with the generation prompt, then the prefill, as token ids."""
    ids = tokenizer.apply_chat_template(chat_prompt.messages(question), add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return ids + (tokenizer.encode(prefill, add_special_tokens=False) if prefill else [])


class GenWorker:
    def __init__(self, cfg: Config, worker_id: str | None = None, public_url: str | None = None,
                 engine: VllmEngine | None = None):
        self.cfg = cfg
        self.worker_id = worker_id or cfg.rollout.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.public_url = public_url or cfg.rollout.public_url or f"http://{cfg.rollout.host}:{cfg.rollout.port}"
        check_names(weights_at(cfg.rewards, 0))
        self.task = get_task(cfg.data.source)  # an unknown data.source fails here, before the engine starts
        model_path = resolve_model(cfg.model.name)
        self.tokenizer = load_tokenizer(cfg.model.name)
        # data.seed moves every random choice of a run (problems, sampling, teacher wording), so runs
        # with different seeds are independent repeats
        own_seed = zlib.crc32(self.worker_id.encode()) + 7919 * cfg.data.seed
        self.engine = engine or VllmEngine(cfg, model_path, seed=own_seed % 2**31)
        from toolrl.executor.client import AsyncExecutorClient

        ex = cfg.executor
        self.executor = AsyncExecutorClient(ex.url, token=ex.token, timeout_s=ex.client_timeout_s,
                                            retries=ex.client_retries)
        self.tool = ExecutorTool(self.executor, timeout_s=ex.timeout_s)
        self.chat_prompt = load_chat_prompt(cfg.prompt.system)
        self.pending_code = pending_program(cfg.prompt.prefill, cfg.rollout.stop_marker)
        self.level = cfg.data.level
        self.problems = problem_stream(cfg.data, self.worker_id)
        self._recent_acc: collections.deque = collections.deque(maxlen=cfg.data.promote_window)
        self._teacher_rng = random.Random(own_seed)
        self._teacher = self.task.teacher(cfg.teacher)
        self.version = 0
        self.weights_ok = True  # False after a load failed part-way: the weights are a mix
        self.update_phase: str | None = None  # "draining" | "loading" while an update is under way
        self.weight_group: str | None = None  # the learner's process group joined (toolrl.weightsync.process_group)
        self.stats = Stats()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()  # cleared while a weight update loads
        self._open.set()
        self._update_lock = asyncio.Lock()
        self._counter = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
        from toolrl.weightsync.receiver import WeightAssembler, remove_stale_weight_dirs

        for d in remove_stale_weight_dirs(shm):
            log.info("removed %s, left by a worker that is gone", d)
        self.assembler = WeightAssembler(shm / f"toolrl-weights-{self.worker_id}-{os.getpid()}",
                                         wait_s=cfg.rollout.drain_timeout_s + cfg.learner.sync_timeout_s)

    # -- prompts -------------------------------------------------------------------------------
    def prompt_ids(self, question: str) -> list[int]:
        return prompt_ids(self.tokenizer, self.chat_prompt, question, self.cfg.prompt.prefill)

    # -- one group ------------------------------------------------------------------------------
    async def rollout_group(self, problem: Problem) -> list[Sample] | None:
        """group_size rollouts of one problem, scored, with group advantages. None if aborted."""
        async with self._in_flight():
            version = self.version
            gid = f"{self.worker_id}:{problem.id}:{next(self._counter)}"
            prompt = self.prompt_ids(problem.question)
            rolls = await self._rollouts(prompt, gid, self.cfg.rollout.group_size)
        if any(r.stop_reason == "abort" for r in rolls):
            self.stats.aborted_groups += 1
            return None
        tests = await self._run_tests(problem, rolls)
        if tests is False:
            return None
        group = await asyncio.to_thread(self._score_group, problem, rolls, gid, version, tests)
        self._curriculum(group)
        for k in range(self.cfg.teacher.traces_per_group if self._teacher else 0):
            t = await teacher_sample(self._teacher(problem, self._teacher_rng), prompt, self.tokenizer, self.tool,
                                     self.cfg.rollout.max_tool_output_tokens, f"{gid}:teacher{k}", version,
                                     self.cfg.prompt.prefill)
            if t is not None:
                group.append(t)
                self.stats.teacher_traces += 1
        return group

    @contextlib.asynccontextmanager
    async def _in_flight(self):
        """Rollouts run inside this: held back while a weight update loads, drained before it loads."""
        await self._open.wait()
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def _rollouts(self, prompt: list[int], gid: str, n: int) -> list[Rollout]:
        """n rollouts of one prompt; `{gid}.{i}` are the request ids and the executor session ids."""
        return await asyncio.gather(*[run_rollout(self.engine, self.tool, self.tokenizer, prompt, self.cfg.rollout,
                                                  f"{gid}.{i}", self.pending_code) for i in range(n)])

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
            self.problems = problem_stream(d, self.worker_id, self.level)
            log.info("curriculum: accuracy passed %.2f, moving to level %d", d.promote_at_accuracy, self.level)

    async def _run_tests(self, problem: Problem, rolls: list[Rollout]):
        """Code tasks: every rollout's program against the task's tests, one executor batch per
        group. None for other tasks; False when the executor could not score them (the group is
        dropped: a reward of 0 for an unscored program would be a wrong training signal)."""
        if problem.grading != "tests":
            return None
        from toolrl.executor.client import ExecutorError

        spec = TestSpec.from_json(problem.answer)
        programs = [program_in(r.texts(self.tokenizer, self.cfg.prompt.prefill)[1], spec) for r in rolls]
        try:
            return await arun_tests(self.executor, programs, [spec] * len(programs),
                                    self.cfg.rewards.code_test_timeout_s, self.cfg.executor.max_timeout_s)
        except ExecutorError as exc:
            self.stats.unscored_groups += 1
            log.warning("could not run the tests of %s, group dropped: %s", problem.id, exc)
            return False

    def _score_group(self, problem: Problem, rolls: list[Rollout], gid: str, version: int,
                     tests: list | None = None) -> list[Sample]:
        samples = self._score(problem, rolls, gid, version, tests)
        st = self.stats
        st.groups += 1
        st.samples += len(samples)
        st.tokens += sum(r.generated for r in rolls)
        st.tool_calls += sum(len(r.tool_calls) for r in rolls)
        st.tool_errors += sum(1 for r in rolls for t in r.tool_calls if t.status != "ok")
        st.reward_sum += sum(s.reward for s in samples)
        st.correct_sum += sum(s.rewards.get("correct", 0.0) for s in samples)
        if zero_variance([s.reward for s in samples]):
            st.zero_std_groups += 1
        return samples

    def _score(self, problem: Problem, rolls: list[Rollout], gid: str, version: int,
               tests: list | None = None) -> list[Sample]:
        samples = []
        for i, r in enumerate(rolls):
            text, final = r.texts(self.tokenizer, self.cfg.prompt.prefill)
            c = Completion(text, final, r.tool_calls, tests[i] if tests else None, problem.grading)
            rewards, total = score(c, problem.answer, self.cfg.rewards, version)
            samples.append(Sample(prompt_ids=r.prompt_ids, completion_ids=r.completion_ids, loss_mask=r.loss_mask,
                                  logprobs=r.logprobs, rewards=rewards, reward=total, group_id=gid,
                                  policy_version=version, stop_reason=r.stop_reason, tool_calls=r.tool_calls,
                                  text=text))
        advs = group_advantages([s.reward for s in samples], scale=self.cfg.grpo.scale_rewards)
        for s, a in zip(samples, advs):
            s.advantage = a
        return samples

    # -- held-out evaluation ------------------------------------------------------------------------
    async def evaluate(self, problems: list[Problem], samples: int, ks: list[int], concurrency: int = 16,
                       on_problem=None) -> dict:
        """`samples` rollouts of each problem with the weights this worker holds: the policy alone
        (no teacher traces), scored as in training, but counted in no training statistic and with no
        effect on the curriculum. A weight update drains these rollouts like any others."""
        from toolrl.worker.evaluate import summarize

        sem = asyncio.Semaphore(concurrency)
        version = self.version
        groups: dict[str, list[Sample]] = {}
        aborted = unscored = 0
        t0 = time.time()

        async def one(problem: Problem) -> None:
            nonlocal aborted, unscored
            async with sem:
                async with self._in_flight():
                    gid = f"{self.worker_id}:eval:{problem.id}:{next(self._counter)}"
                    rolls = await self._rollouts(self.prompt_ids(problem.question), gid, samples)
                kept = [r for r in rolls if r.stop_reason != "abort"]
                aborted += len(rolls) - len(kept)
                tests = await self._run_tests(problem, kept) if kept else None
                if tests is False:
                    unscored += 1
                    return
                groups[problem.id] = await asyncio.to_thread(self._score, problem, kept, gid, self.version, tests)
                if on_problem is not None:
                    on_problem(problem.id, groups[problem.id])

        await asyncio.gather(*[one(p) for p in problems])
        out = summarize(problems, groups, ks)
        out.update(policy_version=version, policy_version_end=self.version, aborted_samples=aborted,
                   unscored_problems=unscored, wall_s=time.time() - t0)
        return out

    async def produce(self, n_groups: int | None = None):
        """Yield scored groups, keeping `prompts_per_step` groups in flight."""
        width = self.cfg.rollout.prompts_per_step
        pending: set[asyncio.Task] = set()
        started = failures = 0
        while True:
            while len(pending) < width and (n_groups is None or started < n_groups):
                task = asyncio.create_task(self.rollout_group(next(self.problems)))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                pending.add(task)
                started += 1
            if not pending:
                return
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    self.stats.aborted_groups += 1
                    continue
                if task.exception() is not None:
                    # One broken group must not take the worker down; a persistent failure must.
                    self.stats.failed_groups += 1
                    failures += 1
                    log.error("a rollout group failed: %r", task.exception(), exc_info=task.exception())
                    if failures >= 5:
                        raise RuntimeError("5 rollout groups in a row failed") from task.exception()
                    continue
                failures = 0
                group = task.result()
                if group is None:
                    continue
                if self.cfg.grpo.drop_zero_std_groups and zero_variance([s.reward for s in group]):
                    self.stats.dropped_groups += 1
                    continue
                yield group

    # -- weight updates --------------------------------------------------------------------------
    async def receive_bucket(self, chunks) -> dict:
        """One bucket of a weight update (POST /update_weights), streamed to a file as it arrives.
        The first bucket starts the load (`_load`); the answer to the last one waits for it."""
        from toolrl.weightsync.transport import UpdateAborted

        bucket, update = await self.assembler.receive(chunks, self.version, self._start_load)
        if not bucket.last:
            return {"version": bucket.version, "loaded": False, "received": bucket.index + 1, "of": bucket.count}
        if update.task is None:
            raise UpdateAborted(f"version {bucket.version} has no load under way")
        return await asyncio.shield(update.task)  # a dropped connection must not cancel the load

    def _start_load(self, update) -> None:
        async def load() -> float:
            return await self.engine.load_buckets(str(update.dir), update.id, update.count,
                                                  self.cfg.learner.sync_timeout_s)

        async def run() -> dict:
            try:
                return await self._swap_weights(update.version, load, lambda: update.aborted)
            except BaseException:
                update.abort()
                raise
            finally:
                self.assembler.discard(update)

        update.task = asyncio.create_task(run())
        update.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # errors reach the last bucket

    async def join_group(self, spec: dict) -> None:
        """Join the learner's process group (sync_transport: process_group); it replaces any other."""
        self.weight_group = None
        await self.engine.join_group(spec)
        self.weight_group = spec["group_id"]

    async def receive_broadcast(self, group_id: str, version: int, push_id: str, specs: list) -> dict:
        """A whole update by broadcast over the learner's process group (toolrl.weightsync.process_group)."""
        from toolrl.weightsync.transport import BucketOrderError

        if version < self.version:
            raise BucketOrderError(f"version {version} is older than the loaded {self.version}")
        if group_id != self.weight_group:  # refused before the drain: the weights stay whole
            raise BucketOrderError(f"not a member of process group {group_id!r}: join it first")

        async def load() -> float:
            return await self.engine.load_broadcast(group_id, push_id, specs, self.cfg.learner.sync_timeout_s)

        return await self._swap_weights(version, load)

    async def _swap_weights(self, version: int, load, aborted=lambda: False) -> dict:
        """Hold new rollouts back, drain the in-flight ones (aborted and discarded only after
        `rollout.drain_timeout_s`), then `load()` the new weights in place and bump the version.
        If the load fails part-way, the weights are a mix: rollouts stay held back and /health
        says so until a whole update loads."""
        from toolrl.weightsync.transport import UpdateAborted

        async with self._update_lock:  # an earlier update, superseded, finishes failing first
            self._open.clear()
            t0, loading = time.time(), False
            self.update_phase = "draining"
            try:
                if aborted():
                    raise UpdateAborted(f"version {version} was superseded")
                try:
                    await asyncio.wait_for(self._idle.wait(), self.cfg.rollout.drain_timeout_s)
                except asyncio.TimeoutError:
                    for task in list(self._tasks):  # rollouts between segments would resubmit
                        task.cancel()
                    n = await self.engine.abort_all()
                    log.warning("drain timed out after %.0fs; aborted %d groups (%d requests)",
                                time.time() - t0, len(self._tasks), n)
                    await wait_for(self._idle.wait(), 60, "aborting in-flight rollouts")
                drain_s = time.time() - t0
                if aborted():
                    raise UpdateAborted(f"version {version} was superseded")
                loading, self.weights_ok, self.update_phase = True, False, "loading"
                reload_s = await load()
                self.version, self.weights_ok = version, True
                self.stats.updates += 1
                self.stats.last_reload_s = reload_s
                log.info("loaded policy version %d (drain %.2fs, load %.2fs)", version, drain_s, reload_s)
                return {"version": version, "loaded": True, "drain_s": drain_s, "reload_s": reload_s,
                        "worker_id": self.worker_id}
            except BaseException as exc:
                if loading:
                    log.error("loading version %d failed part-way (%s); no rollouts until a whole update loads",
                              version, exc)
                raise
            finally:
                self.update_phase = None
                if self.weights_ok:
                    self._open.set()

    def stats_dict(self) -> dict:
        d = self.stats.as_dict(self.version, self._inflight)
        d.update(worker_id=self.worker_id, tool_executor_errors=self.tool.errors, level=self.level)
        return d

    def close(self) -> None:
        self.engine.shutdown()
        self.assembler.close()


async def rollout_only(worker: GenWorker, num_prompts: int, out_path: str) -> dict:
    """Write scored samples to JSONL without a reference server."""
    from tqdm import tqdm

    n = 0
    t0 = time.time()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as f, tqdm(total=num_prompts, desc="groups", unit="group") as bar:
        async for group in worker.produce(n_groups=num_prompts):
            for s in group:
                f.write(json.dumps(sample_record(s)) + "\n")
                n += 1
            f.flush()
            bar.update(1)
            bar.set_postfix(reward=f"{worker.stats.reward_sum / max(1, worker.stats.samples):.3f}",
                            tools=worker.stats.tool_calls)
    summary = worker.stats_dict()
    summary.update(written=n, out=out_path, wall_s=time.time() - t0)
    return summary
