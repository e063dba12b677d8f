"""The gen worker's HTTP API: health, stats, probes, held-out evaluation and the weight-update endpoints."""
from __future__ import annotations

import logging
import time
from typing import Literal

import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect

from toolrl.tasks import DataError, load_task, task_seed
from toolrl.protocol import PayloadTooLarge, WireFormatError
from toolrl.weightsync.buckets import MAX_WEIGHTS_BYTES
from toolrl.weightsync.fanout import PLAN_HEADER, PlanError, parse_plan
from toolrl.weightsync.relay import heartbeats
from toolrl.weightsync.transport import BucketOrderError, UpdateAborted
from toolrl.worker.agent import EvaluationUnscored
from toolrl.net import BodyStalled, bearer_auth, cap_request_bodies, idle_bounded, install_error_handlers

MAX_JSON_BYTES = 4 << 20  # the JSON routes' bodies (a probe's prompt ids are the largest)

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
    temperature: float | None = Field(None, ge=0, le=10)  # None: the rollout temperature; 0: greedy


def build_app(worker) -> FastAPI:
    """The API of `worker`, a toolrl.worker.service.GenWorker (which imports this module)."""
    app = FastAPI(title="toolrl gen worker", docs_url=None, redoc_url=None, openapi_url=None)  # none without the token
    auth = Depends(bearer_auth(worker.cfg.rollout.token))
    install_error_handlers(app, log)
    # buckets stream under their own cap (exact paths: /update_weights_broadcast is a JSON route)
    cap_request_bodies(app, MAX_JSON_BYTES, exempt=("/update_weights",), token=worker.cfg.rollout.token)

    @app.get("/health")
    async def health():
        return {"ok": True, "worker_id": worker.worker_id, "policy_version": worker.version,
                "weights_ok": worker.gate.weights_ok, "update_phase": worker.gate.phase}

    @app.get("/stats", dependencies=[auth])
    async def stats():
        return worker.stats_dict()

    @app.post("/probe", dependencies=[auth])
    async def probe(req: ProbeRequest):
        """Sampling at the rollout temperature: tokens and their logprobs under the loaded weights,
        so a learner (or a test) can check a sync by scoring the same tokens itself. The seed is
        honoured on GPU, and on CPU with rollout.seeded (VllmEngine.generate)."""
        if not worker.gate.weights_ok:
            raise HTTPException(status_code=503, detail="a weight update failed part-way; waiting for a whole one")
        tok = worker.agent.tokenizer
        vocab = tok.vocab_size + len(tok.get_added_vocab())
        if max(req.prompt_ids) >= vocab or min(req.prompt_ids) < 0:
            raise HTTPException(status_code=400, detail=f"prompt_ids must lie in [0, {vocab})")
        try:
            # drained by an update like any whole rollout: never across one
            async with worker.gate.rollout(wait_s=worker.cfg.learner.sync_timeout_s) as version:
                out = await worker.agent.engine.generate(req.prompt_ids, req.max_tokens, f"probe-{time.time_ns()}",
                                                         stop_at_marker=False, seed=req.seed)
        except TimeoutError:
            raise HTTPException(status_code=503, detail="a weight update is still loading; try again") from None
        return {"token_ids": out.token_ids, "logprobs": out.logprobs, "policy_version": version,
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
        async with worker.evaluating():  # every core the engine is bound to: the caller waits for this
            try:
                res = await worker.agent.evaluate(problems, req.samples, req.ks, req.concurrency,
                                                  temperature=req.temperature)
            except EvaluationUnscored as exc:  # never an accuracy of 0 for the infrastructure's failure
                raise HTTPException(status_code=503, detail=str(exc)) from None
        log.info("evaluation of version %d: accuracy %.3f (%.0fs)", res["policy_version"], res["accuracy"],
                 res["wall_s"])
        return res

    @app.post("/update_weights", dependencies=[auth])
    async def update_weights(request: Request):
        """One bucket of a weight update, streamed to disk as it arrives (toolrl.weightsync.http). With
        the fan-out plan header, also relayed to the children it names (toolrl.weightsync.relay)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_WEIGHTS_BYTES:
            raise HTTPException(status_code=413, detail=f"body of {declared} bytes is over the limit of "
                                                        f"{MAX_WEIGHTS_BYTES}")
        raw_plan = request.headers.get(PLAN_HEADER)
        try:
            plan = parse_plan(raw_plan) if raw_plan is not None else None
        except PlanError as exc:  # refused before a byte of the body is read
            raise HTTPException(status_code=400, detail=f"bad fan-out plan: {exc}") from None
        try:
            # the sender's own per-request timeout bounds each gap: a vanished sender frees the update
            chunks = idle_bounded(request.stream(), worker.cfg.learner.sync_timeout_s)
            answer = await worker.gate.receive_bucket(chunks, plan)
        except Exception as exc:
            status, detail = _bucket_failure(exc)
            if getattr(exc, "need_full", False):  # a delta refused or not applied: the sender sends it all
                return JSONResponse(status_code=status, content={"detail": detail, "need_full": True,
                                                                 "holds": getattr(exc, "holds", None)})
            raise HTTPException(status_code=status, detail=detail) from None
        if isinstance(answer, dict):
            return answer
        # the last bucket of a relayed update: its answer waits for the subtree below
        return StreamingResponse(heartbeats(answer, plan.timeout_s), media_type="application/json")

    def _bucket_failure(exc: Exception) -> tuple[int, str]:
        if isinstance(exc, PayloadTooLarge):
            return 413, str(exc)
        if isinstance(exc, WireFormatError):
            return 400, f"bad weight bucket: {exc}"
        if isinstance(exc, (BucketOrderError, UpdateAborted)):
            return 409, str(exc)
        if isinstance(exc, BodyStalled):
            log.warning("weight update: %s mid-bucket; the update is dropped", exc)
            return 408, f"{exc}: the update is dropped"
        if isinstance(exc, ClientDisconnect):
            log.warning("weight update: the sender went away mid-bucket")
            return 400, "body ended early"
        log.error("weight load failed", exc_info=exc)
        return 500, f"loading the weight update failed: {exc}"

    @app.post("/weight_group", dependencies=[auth])
    async def weight_group(req: GroupRequest):
        try:
            await worker.gate.join_group(req.model_dump())
        except Exception as exc:
            log.warning("could not join process group %s: %s", req.group_id, exc)
            raise HTTPException(status_code=502, detail=f"joining process group {req.group_id} failed: {exc}") from None
        return {"joined": req.group_id}

    @app.post("/update_weights_broadcast", dependencies=[auth])
    async def update_weights_broadcast(req: BroadcastUpdate):
        """A whole weight update received by broadcast on a joined group; answers after the load."""
        # checked here, before the drain: a bad spec found while loading would leave the weights a mix
        bad = [d for _, d, _ in req.specs if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            raise HTTPException(status_code=400, detail=f"unknown dtypes {sorted(set(bad))}")
        bad = [n for n, _, shape in req.specs if any(x < 0 for x in shape)]
        if bad:
            raise HTTPException(status_code=400, detail=f"negative dimensions in the shapes of {bad[:5]}")
        try:
            return await worker.gate.receive_broadcast(req.group_id, req.version, req.push_id,
                                                  [list(s) for s in req.specs])
        except BucketOrderError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except Exception as exc:
            log.exception("weight load by broadcast failed")
            raise HTTPException(status_code=500, detail=f"loading the weight update failed: {exc}") from None

    return app
