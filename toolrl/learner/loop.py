"""The learner's loop, top to bottom: the story of a training run.

Each step: wait for a full batch from the reference server (catching late workers up meanwhile),
one GRPO step (toolrl.learner.trainer), every `sync_every` steps push the weights to all live
workers and announce the new policy version (toolrl.weightsync), every `checkpoint_every` steps save
an exact-resume checkpoint. Held-out evaluations run on a live worker that holds the policy.
"""
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from toolrl.config import Config
from toolrl.learner.batching import downsample, gather_batch
from toolrl.learner.cpu_threads import ThreadGovernor
from toolrl.learner.dist_env import check_shared_dir
from toolrl.learner.monitor import Monitor, step_line
from toolrl.learner.preemption import Preempted, StopRequest
from toolrl.learner.schedules import TeacherWeight, out_of_time
from toolrl.learner.trainer import Trainer
from toolrl.metrics import batch_stats
from toolrl.models import resolve_dtype, resolve_model
from toolrl.protocol import sample_record
from toolrl.refserver.client import RefServerClient, RefServerUnavailable
from toolrl.refserver.registry import MAX_WORKERS
from toolrl.weightsync.pusher import WeightSync
from toolrl.worker.client import evaluate_on_worker

log = logging.getLogger("learner")


def whole_batch(batch: list, world: int) -> list:
    """On rank 0, the step's whole batch (every rank's share, gathered); elsewhere the rank's own.
    Collective: every rank calls it at the same point of the step."""
    if world == 1:
        return batch
    dist = torch.distributed
    shares = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(batch, shares, dst=0)
    return [s for share in shares for s in share] if shares else batch


def push_or_skip(sync: WeightSync, named, version: int) -> dict:
    """`sync.push`, except that a reference server that cannot be reached (down, restarting) costs this
    push, not the run: the learner died with its trained step. The version still reaches the server
    with the learner's next batch request (RefServerClient keeps it), and the next catch-up round
    finds the workers behind it. -> the push's report, {} when skipped. Rank 0."""
    try:
        return sync.push(named, version)
    except RefServerUnavailable as exc:
        log.warning("version %d not pushed: the reference server is unreachable (%s); the workers get it at the "
                    "next catch-up", version, exc)
        return {}


def from_rank0(value, world: int):
    """Rank 0's `value` on every rank. Collective."""
    if world == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def resumed_version(checkpoint: int, ahead: int, max_staleness: int) -> int:
    """The policy version a resumed learner takes, given the newest version a live worker holds.
    Above every worker's, so that its push is taken as newer. A worker at the checkpoint's version
    holds its very weights. Workers past it hold weights trained after it and then lost: the resumed
    policy's version is far enough above theirs that their samples still queued are stale (dropped,
    to be generated again on the resumed policy), not trained as if they were its own."""
    if ahead < checkpoint:
        return checkpoint
    return checkpoint + 1 if ahead == checkpoint else ahead + 1 + max_staleness


def check_checkpoint_dir(ckpt_dir: Path, resume: bool) -> None:
    """--resume needs a checkpoint, and a fresh run must not start over one: at its first save the
    keep policy deleted the earlier run's checkpoints (and `latest` pointed at the new run)."""
    latest = ckpt_dir / "latest"
    if resume and not latest.is_file():
        raise SystemExit(f"learner: --resume, but {ckpt_dir} holds no checkpoint (no 'latest' file): give the "
                         "run directory of the run to continue, or start without --resume")
    if not resume and latest.is_file():
        raise SystemExit(f"learner: {ckpt_dir} holds a checkpoint ({latest.read_text().strip() or '?'}) of an "
                         "earlier run: give --resume to continue it, or another run directory "
                         "(--run-dir, learner.checkpoint_dir); a fresh run there would delete it")


def run(cfg: Config, run_dir: Path | None, resume: bool, started: float | None = None) -> None:
    started = time.time() if started is None else started  # learner.run_budget_s counts from here
    ckpt_dir = run_dir / "checkpoints" if run_dir else Path(cfg.learner.checkpoint_dir)
    log_dir = run_dir / "logs" if run_dir else Path(cfg.logging.log_dir)
    check_checkpoint_dir(ckpt_dir, resume)
    if cfg.learner.cpu_cores and not torch.cuda.is_available():
        os.sched_setaffinity(0, cfg.learner.cpu_cores)
        torch.set_num_threads(len(cfg.learner.cpu_cores))
        log.info("pinned to cores %s, %d torch threads", cfg.learner.cpu_cores, torch.get_num_threads())

    trainer = Trainer(cfg, resolve_model(cfg.model.name))
    governor = None
    if cfg.learner.adaptive_threads and not torch.cuda.is_available():
        governor = ThreadGovernor().start()
        log.info("adaptive threads before %d layers", governor.attach(trainer.module))
    rank0 = trainer.rank == 0  # the global rank 0: on node 0, with the reference server and the workers
    world = trainer.world_size
    if world > 1:
        # Ranks on several nodes: every one writes and reads the checkpoints, so all must see one
        # directory, and all must resume (or none).
        check_shared_dir(ckpt_dir)
        # all_agree is true on every rank if it holds on any: here, some ranks resume and some do not
        if trainer.all_agree(resume) and trainer.all_agree(not resume):
            raise RuntimeError("--resume was given to some learner ranks but not to others: "
                               "give it on every node or on none")
    teacher_weight = TeacherWeight(cfg)
    run_state = trainer.load_checkpoint(ckpt_dir) if resume else None
    if run_state is not None:
        log.info("resumed at step %d, policy version %d", trainer.step, trainer.version)
        teacher_weight.load_state_dict(run_state.get("teacher_weight", {}))
    ref = RefServerClient(cfg.ref_server.url, token=cfg.ref_server.token)
    sync = WeightSync(cfg, ref)
    sync_dtype = getattr(torch, resolve_dtype(cfg.model.dtype))  # what the workers' engines run
    state = lambda: trainer.export_state(sync_dtype)  # noqa: E731
    monitor = Monitor(cfg, log_dir, trainer.rank)
    if resume and trainer.step > 0:  # every rank (it was agreed above): the export below is collective
        if rank0:
            # Workers may hold weights newer than the checkpoint (trained after it, then lost): the
            # resumed policy gets a version above all of them, so nothing mistakes it for older.
            ahead = max([int(w.get("policy_version", 0)) for w in ref.workers()] + [-1])
            trainer.version = resumed_version(trainer.version, ahead, cfg.ref_server.max_staleness)
        trainer.version = from_rank0(trainer.version, world)
        named = state()  # every rank: a ZeRO-3 gather is collective
        if rank0:
            ref.set_version(trainer.version, restart=True)
            push_or_skip(sync, named, trainer.version)
            # Each worker continues its problem stream and curriculum where it was at the checkpoint
            # (the reference server hands a state back to the worker of that id at its next heartbeat).
            workers = (run_state or {}).get("workers") or {}
            if workers:
                ref.set_resume_states(workers)
                log.info("handed back the problem-stream state of %d workers", len(workers))
    elif rank0:
        ref.set_version(trainer.version, restart=True)

    # each worker's producer state as last seen, by id: a worker that died before a checkpoint (a
    # preemption's SIGTERM reaches the learner after it) keeps its last state, as an earlier one had it
    worker_states: dict = dict((run_state or {}).get("workers") or {})

    def checkpoint() -> None:
        """On every rank (each writes its ZeRO shard); with what the loop needs to continue exactly.
        A full disk costs this checkpoint, not the run: the partial one is removed (`latest` still
        names the last whole one) and training goes on."""
        tag = f"step{trainer.step:06d}"
        latest = ckpt_dir / "latest"
        if latest.is_file() and latest.read_text().strip() == tag:
            return  # a resumed run that had already finished: rewriting its only checkpoint in place risks it
        if rank0:
            try:
                for w in ref.workers():
                    if w.get("state"):
                        worker_states.pop(w["id"], None)  # the newest last: the oldest go past the bound
                        worker_states[w["id"]] = w["state"]
                while len(worker_states) > MAX_WORKERS:  # what the reference server takes back
                    del worker_states[next(iter(worker_states))]
            except Exception as exc:  # a checkpoint without worker states still resumes the learner exactly
                log.warning("could not read the workers' states for the checkpoint: %s", exc)
        try:
            trainer.save_checkpoint(ckpt_dir, {"teacher_weight": teacher_weight.state_dict(),
                                               "train_elapsed_s": elapsed(),
                                               "workers": dict(worker_states) if rank0 else {}})
        except OSError as exc:
            log.error("checkpoint %s failed (%s); training goes on from the last whole one (%s)", tag, exc,
                      latest.read_text().strip() if latest.is_file() else "none")
            if rank0 and not (latest.is_file() and latest.read_text().strip() == tag):
                shutil.rmtree(ckpt_dir / tag, ignore_errors=True)

    def catch_up(drawing: bool) -> bool:
        """One round of bringing late workers up to the current policy while the ranks wait for their
        batch, on every rank together: rank 0 finds who is behind and, if anyone is, every rank takes
        part in the export (under ZeRO-3 a collective gather) and rank 0 sends it. Ranks draw their
        shares a different number of times, so a rank whose share is complete goes on joining rounds
        (drawing False) until none draws. -> whether some rank still draws. A stop asked for by a
        signal on any rank leaves the wait on every rank (Preempted)."""
        if trainer.all_agree(bool(stop)):
            raise Preempted
        behind = []
        if rank0:
            try:
                behind = sync.behind(trainer.version)
            except RefServerUnavailable as exc:  # away for now: the next round asks again
                log.warning("cannot see which workers are behind: %s", exc)
        if trainer.all_agree(bool(behind)):
            named = state()
            if rank0:
                try:
                    sync.catch_up(lambda: named, trainer.version, behind)
                except RefServerUnavailable as exc:
                    log.warning("catch-up to version %d not sent: %s", trainer.version, exc)
        return trainer.all_agree(drawing)

    eval_s: list[float] = []  # each held-out evaluation's seconds (rank 0): the final one is reserved

    def held_out(tag: str) -> None:
        """A held-out evaluation (the `eval` section) on a live worker holding the current policy.
        Rank 0 only; a failure is logged, never fatal to training."""
        if not rank0:
            return
        t, deadline = time.time(), time.time() + min(300.0, cfg.eval.timeout_s)
        while True:
            try:
                res = evaluate_on_worker(cfg, sync.trusted(ref.workers()), trainer.version, sync.pushed)
                break
            except Exception as exc:
                if "no live worker" not in str(exc) or time.time() > deadline:
                    log.warning("held-out evaluation (%s) skipped: %s", tag, exc)
                    return
                time.sleep(2)  # workers still starting, or a heartbeat behind
        monitor.log_eval(trainer.step, tag, res)
        eval_s.append(time.time() - t)
        print(f"eval {tag} step {trainer.step} v{trainer.version}: accuracy {res['accuracy']:.3f} "
              f"format {res['format_rate']:.2f} tools/answer {res['tool_calls_per_answer']:.2f} "
              f"on {res['n_problems']} problems x {cfg.eval.samples} ({eval_s[-1]:.0f}s)", flush=True)

    if cfg.eval.before_after and trainer.step == 0:
        held_out("before")
    stop, preempted = StopRequest(), False  # from here a SIGTERM saves what was trained, then exits
    # training time counts across resumes, so a time budget is one budget for the whole run
    train_t0, last_step_s = time.time() - float((run_state or {}).get("train_elapsed_s", 0.0)), 0.0
    elapsed = lambda: time.time() - train_t0  # noqa: E731
    while trainer.step < cfg.learner.steps:
        t0 = time.time()
        used_s, run_s, why = elapsed(), t0 - started, None
        final_eval_s = max(eval_s, default=0.0) if cfg.eval.before_after else 0.0
        if out_of_time(cfg.learner.time_budget_s, used_s, last_step_s):
            why = (f"time budget: {used_s:.0f}s of {cfg.learner.time_budget_s:.0f}s used, and a step takes "
                   f"{last_step_s:.0f}s")
        elif out_of_time(cfg.learner.run_budget_s, run_s, last_step_s, final_eval_s):
            why = (f"run budget: {run_s:.0f}s of {cfg.learner.run_budget_s:.0f}s used, a step takes "
                   f"{last_step_s:.0f}s and the final evaluation about {final_eval_s:.0f}s")
        if stop:
            why = f"{stop.name} received"
        if trainer.all_agree(why is not None):  # one all-reduce for both budgets and a signal
            preempted = trainer.all_agree(bool(stop))
            if rank0:
                print(f"{why or 'another rank is out of its budget'}; stopping after step {trainer.step}", flush=True)
            break
        # A step trains on a full batch (batch_samples, within batch_tokens), each rank its share.
        want, budget = max(1, cfg.learner.batch_samples // world), cfg.learner.batch_tokens // world

        def draw(n: int, tokens: int) -> list:
            catch_up(drawing=True)  # late workers get the policy while we wait
            try:
                return ref.get_batch(n, tokens, wait_s=min(10.0, cfg.ref_server.batch_wait_s), min_samples=n) or []
            except RefServerUnavailable as exc:  # busy or briefly away: the batch deadline bounds the wait
                log.warning("no batch this round: %s", exc)
                return []

        try:
            got = gather_batch(draw, want, budget, t0 + cfg.learner.batch_timeout_s, cfg.grpo.dynamic_sampling,
                               cfg.grpo.max_draws, what=cfg.ref_server.url)
            while world > 1 and catch_up(drawing=False):  # this rank's share is complete; others still draw
                pass
        except Preempted:  # the batch drawn so far stays unused: its samples are lost, not trained twice
            preempted = True
            if rank0:
                print(f"{stop.name} received while waiting for a batch; stopping after step {trainer.step}",
                      flush=True)
            break
        batch = got.samples
        t1 = time.time()
        if cfg.learner.lr_decay_over == "time":  # the config requires a time budget then
            trainer.set_time_used(elapsed() / cfg.learner.time_budget_s)
        held = trainer.version  # the policy this step trains: samples of it are on-policy (staleness 0)
        # PODS: the step trains on each group's most varied rollouts; its statistics (accuracy, the
        # teacher's decay) count every rollout generated
        trained, downsampled = downsample(batch, cfg.grpo)
        if governor:
            governor.apply()
            governor.mean_threads()  # the step's mean counts from here
        metrics = trainer.train_step(trained, w_teacher=teacher_weight.value)
        if governor:
            metrics.update(learner_threads=governor.mean_threads(), learner_thread_switches=governor.switches)
        t2 = time.time()
        synced = {}
        if trainer.step % cfg.learner.sync_every == 0:
            trainer.version += 1
            named = state()
            if rank0:
                synced = push_or_skip(sync, named, trainer.version)
        t3 = time.time()
        own = batch_stats(batch, held)
        # every rank decays the teacher weight by the same accuracy: that of the whole batch
        teacher_weight.update(trainer.all_mean(own["accuracy"], sum(s.source == "policy" for s in batch)))
        whole = whole_batch(batch, world)  # rank 0 logs every rank's samples, not only its own share
        metrics.update(batch_stats(whole, held) if rank0 else own, dynamic_sampling_dropped=got.dropped,
                       samples_drawn=got.drawn, downsampled=downsampled)
        if cfg.learner.checkpoint_every and trainer.step % cfg.learner.checkpoint_every == 0:
            checkpoint()
        if rank0 and cfg.logging.dump_samples:
            with open(log_dir / "samples.jsonl", "a") as f:
                for s in whole:
                    f.write(json.dumps(sample_record(s, step=trainer.step)) + "\n")
        last_step_s = time.time() - t0
        metrics.update(time_wait_s=t1 - t0, time_compute_s=t2 - t1, time_sync_s=t3 - t2, step_time_s=last_step_s,
                       policy_version=trainer.version, workers_ok=synced.get("workers_ok", 0),
                       workers_failed=synced.get("workers_failed", 0), sync_drain_s=synced.get("drain_s_max", 0.0),
                       sync_reload_s=synced.get("reload_s_max", 0.0),
                       requests_interrupted=synced.get("interrupted", 0),
                       # what left the learner for this sync (http), of which deltas, and one full copy
                       sync_bytes=synced.get("egress_bytes", 0), sync_delta_bytes=synced.get("delta_bytes", 0),
                       sync_copy_bytes=synced.get("copy_bytes", 0))
        if rank0:
            try:
                st = ref.stats()
                metrics.update({f"queue/{k}": v for k, v in st.items() if isinstance(v, (int, float))})
            except Exception as exc:  # stats are nice to have; never stop training for them
                log.warning("could not read reference server stats: %s", exc)
        monitor.log(trainer.step, metrics)
        if rank0:
            print(step_line(trainer.step, cfg.learner.steps, metrics, teacher=cfg.grpo.w_teacher > 0,
                            kl=cfg.grpo.beta > 0), flush=True)
        if cfg.eval.every and trainer.step % cfg.eval.every == 0 and trainer.step < cfg.learner.steps:
            held_out("every")

    def close() -> None:
        stop.restore()
        if governor:
            governor.stop()
        monitor.close()
        ref.close()
        trainer.close()
        logging.shutdown()

    if preempted:  # within the launcher's grace: the checkpoint only (no export, no evaluation)
        if trainer.step:
            checkpoint()
        if rank0:
            print(f"stopped by {stop.name} after step {trainer.step}; continue with --resume "
                  f"(checkpoints: {ckpt_dir})", flush=True)
        close()
        raise SystemExit(stop.exit_code)
    if trainer.step % cfg.learner.sync_every:  # the workers (and the evaluation) get the final policy
        trainer.version += 1
        named = state()  # every rank: a ZeRO-3 gather is collective
        if rank0:
            push_or_skip(sync, named, trainer.version)
    if rank0:  # workers stop their rollouts now: nothing will train them, and the final evaluation gets the engine
        try:
            ref.finish(trainer.version)
        except Exception as exc:  # a worker that goes on generating costs time, not correctness
            log.warning("could not tell the reference server that training is over: %s", exc)

    # the export first: it is what the run is for, and a checkpoint (many times its size) may not fit
    export = trainer.export_hf((run_dir or Path(cfg.learner.checkpoint_dir).parent) / "export")
    if cfg.learner.checkpoint_every == 0 or trainer.step % cfg.learner.checkpoint_every:
        checkpoint()
    if cfg.eval.before_after or (cfg.eval.every and trainer.step % cfg.eval.every == 0):
        held_out("after")
    if rank0:
        summary = {"steps": trainer.step, "policy_version": trainer.version, "samples": trainer.samples_seen,
                   "skipped_steps": trainer.skipped_steps, "export": str(export)}
        print(json.dumps(summary), flush=True)
    close()

