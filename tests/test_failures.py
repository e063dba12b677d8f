"""Failures during a real run (tiny model, all five processes, weights over a process group): a
worker joins, a worker dies, the executor dies and comes back, the learner dies and resumes from its
checkpoint. With http weights (the default) the same faults go through launch.sh in
tests/test_launch_faults.py (whose resume catches a worker up as a late joiner is caught up), and
the fan-out's dead and silent workers are tests/weightsync/test_fanout_tree.py's."""
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from procs import Proc, free_port  # tests/ is on sys.path (conftest)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2700)]
# Far more steps than the test waits for: it ends once the resumed learner has stepped. At 40, a CI
# run trained them all while a late worker's engine took 113 s to start, and the next phase waited in vain.
STEPS = 400


def wait_until(what, pred, timeout_s=300, every=1.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out waiting for: {what}")


def kill(proc: Proc) -> None:
    os.killpg(proc.p.pid, signal.SIGKILL)
    proc.p.wait(timeout=30)


def test_the_run_survives_failures(tmp_path):
    """Over a process group the late joiner gets its own group, the dead worker's group is dropped,
    and the resumed learner builds new ones."""
    ports = {"ex": free_port(), "ref": free_port()}
    run = tmp_path / "run"
    sets = [f"executor.url=http://127.0.0.1:{ports['ex']}", f"ref_server.url=http://127.0.0.1:{ports['ref']}",
            f"learner.steps={STEPS}", "learner.checkpoint_every=2", "rollout.heartbeat_s=1",
            "ref_server.worker_ttl_s=8", "ref_server.max_staleness=2",
            "ref_server.order=newest", "logging.wandb_mode=disabled",
            "executor.client_retries=1", "executor.client_timeout_s=5", "learner.sync_transport=process_group"]
    args = ["--config", "configs/cpu_tiny.yaml"] + [x for s in sets for x in ("--set", s)]
    procs: dict[str, Proc] = {}
    metrics = run / "logs" / "metrics.jsonl"
    samples = run / "logs" / "samples.jsonl"

    def step():
        if not metrics.is_file():
            return 0
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0

    def rows():
        return [json.loads(x) for x in samples.read_text().splitlines()] if samples.is_file() else []

    def start_worker(name, core):
        port = free_port()  # each vLLM worker pinned to its own core, as launch.sh does
        procs[name] = Proc(name, ["gen_worker.py", *args, "--set", f"rollout.cpu_threads_bind={core}",
                                  "--port", str(port), "--worker-id", name], tmp_path)
        return f"http://127.0.0.1:{port}"

    def start_learner(*extra):
        procs["learner"] = Proc("learner", [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "1",
                                            "--master_port", str(free_port()), "learner.py", *args,
                                            "--run-dir", str(run), *extra], tmp_path)

    try:
        # everything starts at once, as launch.sh does; the learner waits for its first batch
        procs["executor"] = Proc("executor", ["executor_service.py", "--port", str(ports["ex"])], tmp_path)
        procs["ref"] = Proc("ref", ["ref_server.py", *args, "--port", str(ports["ref"])], tmp_path)
        procs["executor"].wait_http(f"http://127.0.0.1:{ports['ex']}/health", 120)
        procs["ref"].wait_http(f"http://127.0.0.1:{ports['ref']}/health", 300)
        url_a = start_worker("worker-a", 0)
        start_learner()
        procs["worker-a"].wait_http(f"{url_a}/health", 600)
        wait_until("step 2", lambda: step() >= 2, 600)

        # 1. a new worker joins: it registers, gets the current weights, and contributes
        url_b = start_worker("worker-b", 1)
        procs["worker-b"].wait_http(f"{url_b}/health", 600)
        wait_until("worker-b catches up", lambda: httpx.get(f"{url_b}/health").json()["policy_version"] >= 1, 300)
        wait_until("worker-b contributes", lambda: any(r["group_id"].startswith("worker-b") for r in rows()), 900)
        joined = [r for r in rows() if r["group_id"].startswith("worker-b")]
        assert min(r["policy_version"] for r in joined) >= 1  # never trained on the stale base weights

        # 2. one of the two workers dies: training continues on the other
        kill(procs["worker-a"])
        s0 = step()
        wait_until("two more steps without worker-a", lambda: step() >= s0 + 2, 300)
        live = lambda: {w["id"] for w in httpx.get(f"http://127.0.0.1:{ports['ref']}/workers").json()["workers"]}  # noqa: E731
        wait_until("worker-a leaves the registry", lambda: live() == {"worker-b"}, 60)
        assert any(r["step"] > s0 and r["group_id"].startswith("worker-b") for r in rows())

        # 3. the executor dies: tool calls fail fast instead of hanging, and what it could not run is
        # left out of training and counted, never scored as the model's error; the run goes on once
        # it is back
        kill(procs["executor"])
        unavailable = lambda: httpx.get(f"{url_b}/stats").json()["tool_unavailable_groups"]  # noqa: E731
        wait_until("groups left out for the executor", lambda: unavailable() >= 2, 300)
        procs["executor"] = Proc("executor2", ["executor_service.py", "--port", str(ports["ex"])], tmp_path)
        procs["executor"].wait_http(f"http://127.0.0.1:{ports['ex']}/health", 120)
        s2 = step()
        wait_until("tools work again", lambda: any(
            r["step"] > s2 and r["tool_calls"][0]["status"] == "ok" for r in rows()), 300)
        assert not any(c["status"] == "unavailable" for r in rows() for c in r["tool_calls"])

        # 4. the learner dies and resumes from its last checkpoint
        wait_until("a checkpoint", lambda: (run / "checkpoints" / "latest").is_file(), 120)
        kill(procs["learner"])
        ckpt = (run / "checkpoints" / "latest").read_text().strip()
        resumed_from = int(ckpt.removeprefix("step"))
        assert resumed_from < STEPS
        procs["learner"].log.rename(tmp_path / "learner.before-kill.log")
        start_learner("--resume")
        log = lambda: procs["learner"].log.read_text()  # noqa: E731
        wait_until("the resumed learner steps twice", lambda: f"step {resumed_from + 2}/{STEPS}" in log(), 900)
        assert f"resumed at step {resumed_from}" in log()
        assert f"step {resumed_from}/{STEPS}" not in log()  # it continued, it did not redo the step
        # the checkpoint kept worker-b's problem stream (reported in its heartbeats) and handed it back
        # (worker-a's too, when the checkpoint was taken before it left the registry)
        assert re.search(r"handed back the problem-stream state of [12] workers", log())
        wait_until("worker-b continues its stream from the checkpoint",
                   lambda: "resumed problem stream at level" in procs["worker-b"].log.read_text(), 60)
        assert procs["learner"].p.poll() is None
    finally:
        for p in procs.values():
            p.stop()
