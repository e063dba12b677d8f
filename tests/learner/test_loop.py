"""The learner's loop (toolrl/learner/loop.py) in-process, against a real reference server fed by hand:
what the loop itself decides about a batch, apart from the trainer's step."""
import asyncio
import json
import logging
import os
import random

import pytest
import torch

from toolrl.config import load_config
from toolrl.protocol import Sample
from toolrl.refserver.app import create_app
from toolrl.refserver.client import AsyncRefServerClient

from procs import serve  # tests/ is on sys.path (conftest)
from test_trainer import dist_env  # noqa: F401  (the in-process DeepSpeed rank)


def group(tag: str, rewards: list[float]) -> list[Sample]:
    """One prompt's group; its advantages are what the worker would compute (zero when flat)."""
    rng = random.Random(tag)
    prompt = [rng.randrange(1, 2000) for _ in range(6)]
    mean = sum(rewards) / len(rewards)
    out = []
    for r in rewards:
        ids = [rng.randrange(1, 2000) for _ in range(8)]
        out.append(Sample(prompt_ids=prompt, completion_ids=ids, loss_mask=[1] * 8, logprobs=[-7.0] * 8,
                          rewards={"correct": r}, reward=r, advantage=r - mean, group_id=tag))
    return out


async def upload(url: str, groups: list[list[Sample]]) -> None:
    async with AsyncRefServerClient(url) as c:
        for g in groups:
            await c.upload(g)


def test_dynamic_sampling_in_the_loop_draws_past_flat_groups(tmp_path):
    """grpo.dynamic_sampling through the loop: the first draw is two groups without reward variance,
    left out; the loop draws again (within max_draws) and trains on the two groups with signal only,
    and the step's metrics say so."""
    from toolrl.learner.loop import run

    cfg = load_config("configs/cpu_tiny.yaml", [
        "logging.wandb_mode=disabled", "learner.dtype=float32", "grpo.beta=0", "learner.steps=1",
        "learner.batch_samples=8", "learner.batch_tokens=100000", "learner.checkpoint_every=0",
        "learner.batch_timeout_s=60", "eval.before_after=false", "ref_server.flow_control=false",
        "ref_server.batch_wait_s=1", "grpo.dynamic_sampling=true", "grpo.max_draws=3"])
    flat = [group("flat-0", [1.0] * 4), group("flat-1", [0.0] * 4)]
    signal = [group("sig-0", [1.0, 0.0, 0.0, 1.0]), group("sig-1", [0.0, 1.0, 1.0, 1.0])]
    threads = torch.get_num_threads()
    with serve(create_app(cfg)) as url:
        asyncio.run(upload(url, flat + signal))  # first in, first out: the flat groups come first
        run(cfg.model_copy(update={"ref_server": cfg.ref_server.model_copy(update={"url": url})}),
            tmp_path, resume=False)
    rows = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    m = rows[0]
    assert (m["samples_drawn"], m["dynamic_sampling_dropped"], m["samples"]) == (16, 8, 8)
    assert m["samples_no_signal"] == 0
    # the CPU recipes' adaptive threads (learner.adaptive_threads): the step's mean thread count is
    # recorded, and the process gets its own count back when the run ends
    assert cfg.learner.adaptive_threads and 1.0 <= m["learner_threads"] <= len(os.sched_getaffinity(0))
    assert torch.get_num_threads() == threads


def test_downsampling_in_the_loop_trains_the_most_varied_half_and_counts_every_rollout(tmp_path):
    """grpo.downsample_to (PODS) through the loop: two groups of 8 rollouts with 1 and 2 right
    answers; the step trains on the 4 most varied of each (8 samples, 112 tokens: every right answer
    and wrong ones beside them), while its accuracy counts all 16 rollouts, as the teacher's decay
    does (3/16; the 8 trained hold 3/8)."""
    from toolrl.learner.loop import run

    cfg = load_config("configs/cpu_tiny.yaml", [
        "logging.wandb_mode=disabled", "learner.dtype=float32", "grpo.beta=0", "learner.steps=1",
        "learner.batch_samples=16", "learner.batch_tokens=100000", "learner.checkpoint_every=0",
        "learner.batch_timeout_s=60", "eval.before_after=false", "ref_server.flow_control=false",
        "ref_server.batch_wait_s=1", "rollout.group_size=8", "grpo.downsample_to=4", "grpo.w_self=0"])
    groups = [group("one-right", [1.0] + [0.0] * 7), group("two-right", [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])]
    with serve(create_app(cfg)) as url:
        asyncio.run(upload(url, groups))
        run(cfg.model_copy(update={"ref_server": cfg.ref_server.model_copy(update={"url": url})}),
            tmp_path, resume=False)
    m = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    assert m["downsampled"] == 8 and m["samples"] == 16
    assert m["train_tokens"] == 8 * 14  # 8 samples of 6 prompt + 8 completion tokens
    assert m["accuracy"] == 3 / 16
    assert m["nonzero_advantage_frac"] == 0.5  # half the rollouts trained, each with an advantage


def test_the_run_budget_counts_the_whole_run_and_keeps_time_for_the_final_evaluation(tmp_path, monkeypatch, capsys):
    """learner.run_budget_s counts from the learner's start, evaluations included, and keeps the
    final evaluation's time (as long as the longest so far) free. Each evaluation here takes 100 s
    of a clock the stand-in evaluation moves on: with 150 s the run stops before step 1 (start-up and
    one evaluation fit, but step 1 and the final evaluation would end past it), still evaluating
    the policy it holds; with 250 s both steps run. learner.time_budget_s, checked at the same point,
    counts training alone: a budget of 0.01 s lets the first step run and stops before the second."""
    import types
    import time

    import toolrl.learner.loop as loop

    clock = types.SimpleNamespace(offset=0.0)
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(time=lambda: time.time() + clock.offset,
                                                            sleep=time.sleep))
    evaluated = []

    def evaluate(cfg, workers, version, pushed=None):
        clock.offset += 100.0
        evaluated.append(version)
        return {"accuracy": 0.5, "format_rate": 1.0, "tool_calls_per_answer": 1.0, "n_problems": 4,
                "policy_version": version}

    monkeypatch.setattr(loop, "evaluate_on_worker", evaluate)
    cases = [("learner.run_budget_s=150", 0, "the final evaluation about 100s; stopping after step 0"),
             ("learner.run_budget_s=250", 2, None),
             ("learner.time_budget_s=0.01", 1, "time budget: ")]
    for i, (budget, steps, said) in enumerate(cases):
        cfg = load_config("configs/cpu_tiny.yaml", [
            "logging.wandb_mode=disabled", "learner.dtype=float32", "grpo.beta=0", "learner.steps=2",
            "learner.batch_samples=8", "learner.batch_tokens=100000", "learner.checkpoint_every=0",
            "learner.batch_timeout_s=60", "eval.before_after=true", "ref_server.flow_control=false",
            "ref_server.batch_wait_s=1", "ref_server.max_staleness=2", budget])
        evaluated.clear()
        with serve(create_app(cfg)) as url:
            asyncio.run(upload(url, [group(f"g{i}", [1.0, 0.0, 0.0, 1.0]) for i in range(4)]))
            loop.run(cfg.model_copy(update={"ref_server": cfg.ref_server.model_copy(update={"url": url})}),
                     tmp_path / str(i), resume=False)
        metrics = tmp_path / str(i) / "logs" / "metrics.jsonl"
        assert (len(metrics.read_text().splitlines()) if metrics.exists() else 0) == steps, budget
        assert evaluated == [0, steps]  # before step 1, and after the last step taken
        out = capsys.readouterr().out
        if said is None:
            assert "budget:" not in out
        else:
            assert said in out and f"; stopping after step {steps}" in out, out[-1000:]
        assert ("run budget:" in out) == budget.startswith("learner.run_budget_s=150")


CATCH_UP_MAIN = """
import json, os, sys
from pathlib import Path
sys.path[:0] = [os.getcwd(), "tests", "tests/learner"]  # the script lies elsewhere: this checkout first
from test_trainer import batch, make_cfg
import toolrl.learner.loop as loop
from toolrl.weightsync.pusher import WeightSync

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])


class Ref:  # the reference server's client: one registered worker, and batches made here
    draws = 0

    def workers(self):
        return [{"id": "w0", "url": "http://127.0.0.1:9", "policy_version": 0}]

    def get_batch(self, n, tokens, wait_s, min_samples):
        # rank 0 gets its share in one draw, rank 1 in two: the ranks draw unequal numbers of times
        self.draws += 1
        return batch(100 * rank + self.draws, n_groups=1, group=4 if rank == 0 else 2)

    def set_version(self, version, restart=False):
        pass

    def finish(self, version):
        pass

    def stats(self):
        return {}

    def close(self):
        pass


class Transport:  # the worker's side: the first push fails, so the worker is behind at the next draw
    def __init__(self):
        self.pushes = []

    def push(self, worker, named, version, delta=False):
        self.pushes.append([version, sum(t.numel() for _, t in named)])
        return {"error": "offline"} if len(self.pushes) == 1 else {"version": version, "loaded": True}

    def forget(self, keys):
        pass


ref, transport = Ref(), Transport()
loop.RefServerClient = lambda url, token=None: ref
loop.WeightSync = lambda cfg, client: WeightSync(cfg, client, transport=transport)
cfg = make_cfg("learner.zero_stage=3", "learner.steps=2", "learner.batch_samples=8", "learner.checkpoint_every=2",
               "learner.batch_timeout_s=60", "eval.before_after=false", "logging.tensorboard=false",
               "logging.dump_samples=false")
loop.run(cfg, out / "run", resume=False)
(out / f"rank{rank}.json").write_text(json.dumps({"pushes": transport.pushes, "draws": ref.draws}))
"""


@pytest.mark.serial  # two ranks, a core each: 44 s alone, 88 s beside two busy cores
def test_zero3_ranks_catch_a_late_worker_up_together(tmp_path):
    """Under ZeRO-3 export_state is a collective gather, so a catch-up push while the ranks draw
    their batch needs every rank: rank 0 decides, all take part in the export, rank 0 sends. Here
    the one worker misses version 1's push and is behind at step 2's first draw; the ranks draw
    unequal numbers of times (1 and 2 per step). Rank 0 exporting alone hangs the run (the timeout)."""
    from test_trainer import launch_ranks

    from toolrl.models import resolve_model
    from transformers import AutoConfig, AutoModelForCausalLM

    reports = launch_ranks(tmp_path, nnodes=1, script=CATCH_UP_MAIN, timeout_s=150)
    whole = sum(p.numel() for p in AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(resolve_model("tiny-random"))).state_dict().values())
    # version 1 fails, the catch-up sends it again with whole (gathered) tensors, then version 2
    assert reports[0]["pushes"] == [[1, whole], [1, whole], [2, whole]]
    assert reports[1]["pushes"] == [] and (reports[0]["draws"], reports[1]["draws"]) == (2, 4)
    rows = [json.loads(x) for x in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy_version"], r["workers_ok"]) for r in rows] == [(1, 1, 0), (2, 2, 1)]


def test_a_full_disk_costs_the_checkpoint_not_the_run_or_its_export(tmp_path, monkeypatch, caplog):
    """ENOSPC in the final checkpoint (written before the export) killed the learner with no export
    and no final evaluation; a periodic one killed the whole run (found in review). The partial
    checkpoint is removed, `latest` keeps naming the last whole one, and the export is written first."""
    from toolrl.learner.loop import run
    from toolrl.learner.trainer import Trainer

    real = Trainer.save_checkpoint
    calls = []

    def save(self, ckpt_dir, run_state=None):
        calls.append(self.step)
        if self.step == 2:  # the disk fills half-way through the second
            (ckpt_dir / "step000002").mkdir(parents=True)
            (ckpt_dir / "step000002" / "half.pt").write_bytes(b"x" * 100)
            raise OSError(28, "No space left on device")
        return real(self, ckpt_dir, run_state)
    monkeypatch.setattr(Trainer, "save_checkpoint", save)
    cfg = load_config("configs/cpu_tiny.yaml", [
        "logging.wandb_mode=disabled", "learner.dtype=float32", "grpo.beta=0", "learner.steps=2",
        "learner.batch_samples=4", "learner.batch_tokens=100000", "learner.checkpoint_every=1",
        "learner.batch_timeout_s=60", "eval.before_after=false", "ref_server.flow_control=false",
        "ref_server.batch_wait_s=1", "ref_server.max_staleness=4"])
    with serve(create_app(cfg)) as url:
        asyncio.run(upload(url, [group("a", [1.0, 0.0, 0.0, 1.0]), group("b", [0.0, 1.0, 1.0, 1.0])]))
        with caplog.at_level("ERROR"):
            run(cfg.model_copy(update={"ref_server": cfg.ref_server.model_copy(update={"url": url})}),
                tmp_path, resume=False)
    assert calls == [1, 2]
    assert (tmp_path / "export" / "config.json").is_file()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step000001"
    assert not (tmp_path / "checkpoints" / "step000002").exists()
    assert "checkpoint step000002 failed" in caplog.text and "step000001" in caplog.text
    assert len((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_resumed_learner_outnumbers_the_lost_policies_so_their_samples_are_stale():
    """learner.py --resume beside live workers: they hold weights trained after the checkpoint and
    then lost (v7 here, checkpoint v5). The resumed policy took v8, so with max_staleness 1 the v7
    samples still queued were trained as its own (found in review): now they are stale."""
    from toolrl.learner.loop import resumed_version
    from toolrl.refserver.queue import SampleQueue

    assert resumed_version(5, -1, 1) == 5 and resumed_version(5, 3, 1) == 5  # no worker, or behind: as saved
    assert resumed_version(5, 5, 1) == 6  # the checkpoint's own weights: above, and its samples kept
    version = resumed_version(5, 7, 1)
    q = SampleQueue(max_samples=100, max_bytes=1 << 20, max_staleness=1)
    q.learner_version = version
    lost, resumed = group("lost", [1.0, 0.0]), group("resumed", [1.0, 0.0])
    for s in lost:
        s.policy_version = 7
    for s in resumed:
        s.policy_version = version
    assert all(q.is_stale(s) for s in lost) and not any(q.is_stale(s) for s in resumed)


def test_sigterm_while_waiting_for_a_batch_saves_the_step_reached_and_exits(tmp_path, capsys):
    """A preemption's SIGTERM (toolrl/learner/preemption.py) while the loop waits for a batch: it
    leaves the wait at the next draw round, saves a checkpoint of the step it reached (none was due:
    checkpoint_every 0) and exits 143, well within a launcher's 30 s grace."""
    import signal
    import threading
    import time

    from toolrl.learner.loop import run

    cfg = load_config("configs/cpu_tiny.yaml", [
        "logging.wandb_mode=disabled", "learner.dtype=float32", "grpo.beta=0", "learner.steps=5",
        "learner.batch_samples=4", "learner.batch_tokens=100000", "learner.checkpoint_every=0",
        "learner.batch_timeout_s=120", "eval.before_after=false", "ref_server.flow_control=false",
        "ref_server.batch_wait_s=1", "ref_server.max_staleness=4"])
    metrics = tmp_path / "logs" / "metrics.jsonl"
    sent = []

    def preempt_after_step_1():
        while not (metrics.is_file() and metrics.read_text().strip()):
            time.sleep(0.2)
        time.sleep(2)  # the loop is waiting for its second batch, which never comes
        sent.append(time.time())
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    try:
        with serve(create_app(cfg)) as url:
            asyncio.run(upload(url, [group("a", [1.0, 0.0, 0.0, 1.0])]))
            threading.Thread(target=preempt_after_step_1, daemon=True).start()
            with pytest.raises(SystemExit) as stopped:
                run(cfg.model_copy(update={"ref_server": cfg.ref_server.model_copy(update={"url": url})}),
                    tmp_path, resume=False)
        took = time.time() - sent[0]
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before  # the loop put the handler back
    out = capsys.readouterr().out
    assert "SIGTERM received while waiting for a batch; stopping after step 1" in out, out
    assert "stopped by SIGTERM after step 1; continue with --resume" in out, out
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step000001"
    assert not (tmp_path / "export").exists()  # a stop is not the run's end: no export, no final evaluation
    assert took < 15, took


def test_a_reference_server_that_restarts_between_steps_costs_a_wait_not_the_run(tmp_path, caplog):
    """The server goes away after step 1 and a new one comes up at the same address 8 s later: the
    learner's draws are empty meanwhile (each a warning, within the batch deadline: the catch-up round
    and the draw each raised RefServerUnavailable, and the learner died), then step 2 trains on what the
    new server holds and is pushed through it."""
    import threading
    import time

    from toolrl.learner.loop import run
    from procs import free_port
    from toolrl.refserver.client import RefServerClient

    cfg = load_config("configs/cpu_tiny.yaml", [
        "logging.wandb_mode=disabled", "learner.dtype=float32", "grpo.beta=0", "learner.steps=2",
        "learner.batch_samples=4", "learner.batch_tokens=100000", "learner.checkpoint_every=0",
        "learner.batch_timeout_s=90", "eval.before_after=false", "ref_server.flow_control=false",
        "ref_server.batch_wait_s=1", "ref_server.max_staleness=4"])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    metrics = tmp_path / "logs" / "metrics.jsonl"
    first = serve(create_app(cfg), port=port)
    first.__enter__()
    seen = {}

    def restart_after_step_1():
        while not (metrics.is_file() and metrics.read_text().strip()):
            time.sleep(0.1)
        first.__exit__(None, None, None)
        time.sleep(8)
        with serve(create_app(cfg), port=port):
            asyncio.run(upload(url, [group("b", [0.0, 1.0, 1.0, 0.0])]))
            while len(metrics.read_text().splitlines()) < 2:
                time.sleep(0.1)
            with RefServerClient(url) as c:
                seen["version"] = c.stats()["queue"]["learner_version"]
            seen["done"] = True
            while not seen.get("finished"):
                time.sleep(0.1)

    asyncio.run(upload(url, [group("a", [1.0, 0.0, 0.0, 1.0])]))
    helper = threading.Thread(target=restart_after_step_1, daemon=True)
    helper.start()
    try:
        with caplog.at_level(logging.WARNING, logger="learner"):
            run(cfg.model_copy(update={"ref_server": cfg.ref_server.model_copy(update={"url": url})}),
                tmp_path, resume=False)
    finally:
        seen["finished"] = True
        helper.join(30)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["samples"] == 4 for r in rows)
    assert rows[1]["time_wait_s"] > 5  # step 2 waited for the new server
    assert seen == {"version": 2, "done": True, "finished": True}  # the new server got step 2's push
    assert any("no batch this round" in r.message for r in caplog.records)


def test_a_push_while_the_reference_server_is_down_is_announced_by_the_next_batch_request(caplog):
    """A reference server restarting between a step and its push: the version announce and the worker
    list failed, and the learner died with its trained step. Now the push is skipped with a warning,
    and the learner's next batch request tells the server that comes back the version."""
    import logging

    from procs import free_port
    from toolrl.learner.loop import push_or_skip
    from toolrl.refserver.client import RefServerClient
    from toolrl.weightsync.pusher import WeightSync

    cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled", "grpo.beta=0"])
    port = free_port()
    with RefServerClient(f"http://127.0.0.1:{port}", retries=1) as ref:
        with caplog.at_level(logging.WARNING, logger="learner"):
            assert push_or_skip(WeightSync(cfg, ref), [], 3) == {}
        assert any("version 3 not pushed: the reference server is unreachable" in r.message for r in caplog.records)
        with serve(create_app(cfg), port=port):
            assert ref.stats()["queue"]["learner_version"] == 0
            assert ref.get_batch(1, 1000, wait_s=0) is None
            assert ref.stats()["queue"]["learner_version"] == 3
