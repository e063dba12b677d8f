"""Run monitoring (toolrl/learner/monitor.py): every step metric reaches metrics.jsonl, TensorBoard and
WandB alike, and the console line says at a glance whether GRPO has signal."""
import json
import sys
from pathlib import Path

import pytest

from toolrl.config import load_config
from toolrl.learner.monitor import Monitor, step_line
from toolrl.metrics import batch_stats

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_metrics import signal_batch  # noqa: E402

SIGNAL_KEYS = ("groups", "groups_with_signal", "nonzero_advantage_frac", "reward_teacher/correct_mean",
               "reward_teacher/total_mean", "reward/total_mean")


def step_metrics() -> dict:
    """A step's metrics as the loop assembles them: the batch's, then the trainer's and the loop's own."""
    return {**batch_stats(signal_batch(), version=0), "w_teacher": 0.5, "loss": -0.0123, "clip_frac": 0.125,
            "kl": 0.0, "entropy": 0.7, "policy_version": 3, "step_time_s": 9.5, "time_wait_s": 1.3,
            "time_compute_s": 8.0, "time_sync_s": 0.3}


class FakeWandb:
    def __init__(self):
        self.rows = []

    def log(self, values, step):
        self.rows.append((step, dict(values)))

    def finish(self):
        pass


def test_every_signal_metric_reaches_metrics_jsonl_tensorboard_and_wandb(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, ["logging.wandb_mode=disabled", "logging.tensorboard=true"])
    mon = Monitor(cfg, tmp_path)
    mon.wandb = wandb = FakeWandb()  # what the monitor hands WandB (its own files are WandB's business)
    m = step_metrics()
    mon.log(3, m)
    mon.close()

    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    (step, logged), = wandb.rows
    for k in SIGNAL_KEYS:
        assert row[k] == pytest.approx(m[k]), k
        (event,) = acc.Scalars(k)
        assert (event.step, event.value) == (3, pytest.approx(m[k], rel=1e-6)), k
        assert (step, logged[k]) == (3, pytest.approx(m[k])), k


def test_the_step_line_says_whether_grpo_has_signal():
    m = step_metrics()
    line = step_line(3, 10, m)
    assert line.startswith("step 3/10 v3 ")  # launch.sh shows the lines that start so
    assert "signal 2/3 groups (57% of samples)" in line and "clip 0.125" in line
    assert "(wait 1.3 compute 8.0 sync 0.3)" in line and "\n" not in line
    # the teacher weight only with a teacher term; the KL only when it is in the loss
    assert "w_teacher" not in line and "kl" not in line
    both = step_line(3, 10, m, teacher=True, kl=True)
    assert "w_teacher 0.50" in both and "kl 0.0000" in both


def test_a_dead_wandb_service_does_not_stop_training(tmp_path):
    """A SIGTERM to the learner's process group (launch.sh's Ctrl-C, a preemption) also reaches
    WandB's service process: the learner's next wandb.log raised ConnectionResetError and the run
    died before it could save its checkpoint (found by the Ctrl-C test). Real offline WandB here."""
    import subprocess

    script = """
import logging, sys
import psutil
from toolrl.config import load_config
from toolrl.learner.monitor import Monitor
logging.basicConfig(level=logging.INFO)
mon = Monitor(load_config(None, ["logging.wandb_mode=offline", "logging.tensorboard=false"]), sys.argv[1])
mon.log(1, {"loss": 1.0})
service = psutil.Process().children(recursive=True)
assert service, "no WandB service process"
for p in service:
    p.terminate()
psutil.wait_procs(service, timeout=30)
mon.log(2, {"loss": 2.0})
mon.log(3, {"loss": 3.0})
mon.close()
print("trained on")
"""
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=180,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and "trained on" in out.stdout, out.stderr[-3000:]
    assert out.stderr.count("WandB stopped logging") == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0)]
