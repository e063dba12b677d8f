"""Run monitoring: WandB (offline unless configured), TensorBoard and logs/metrics.jsonl, written by
rank 0 only, each with every numeric metric of a step, plus one console line per step (step_line)."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from toolrl.config import redacted

log = logging.getLogger("learner")


class Monitor:
    def __init__(self, cfg, log_dir: str | Path, rank: int = 0, run_name: str | None = None):
        self.rank = rank
        self.dir = Path(log_dir)
        self.tb = self.wandb = None
        self.history = self.dir / "metrics.jsonl"
        if rank != 0:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: only when TensorBoard is on

            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        if cfg.logging.wandb_mode != "disabled":
            import wandb  # lazy: only when WandB is on (its import takes seconds)

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(project=cfg.logging.wandb_project, name=run_name or cfg.logging.run_name,
                                    mode=cfg.logging.wandb_mode, dir=str(self.dir),
                                    config=redacted(cfg))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.rank != 0:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        with open(self.history, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        self._scalars(step, clean)

    def log_eval(self, step: int, tag: str, res: dict) -> None:
        """A held-out evaluation: one line of logs/eval.jsonl, and eval/* scalars."""
        if self.rank != 0:
            return
        with open(self.dir / "eval.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "tag": tag, **res}) + "\n")
        keys = ("accuracy", "format_rate", "tool_calls_per_answer", "tool_error_rate", "code_executed_rate",
                "mean_completion_tokens", "wall_s")
        clean = {f"eval/{k}": float(res[k]) for k in keys if isinstance(res.get(k), (int, float))}
        clean.update({f"eval/pass@{k}": float(v) for k, v in res.get("pass_at_k", {}).items()})
        self._scalars(step, clean)

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        """To TensorBoard and WandB, whichever are on."""
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            try:
                self.wandb.log(values, step=step)
            except Exception as exc:
                self._lose_wandb(exc)

    def _lose_wandb(self, exc: Exception) -> None:
        """WandB's service process is gone (a SIGTERM to the whole process group, as a preemption
        sends, or the OOM killer): a logger must not stop training, and metrics.jsonl has every step."""
        import wandb

        log.warning("WandB stopped logging (%s: %s); metrics.jsonl and TensorBoard go on",
                    type(exc).__name__, exc)
        self.wandb = None
        try:
            wandb.teardown()  # unhooks its exit handler, which would print the same failure again at exit
        except (Exception, SystemExit):
            pass

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as exc:
                self._lose_wandb(exc)


def step_line(step: int, steps: int, m: dict, teacher: bool = False, kl: bool = False) -> str:
    """A step's console line: progress, whether GRPO had anything to learn from (groups with reward
    variance, samples with a nonzero advantage), the clip fraction and where the time went. The
    teacher weight only with a teacher term (`teacher`: grpo.w_teacher > 0), the KL only when it is in
    the loss (`kl`: beta > 0; else it is 0 by construction). launch.sh shows lines that start `step N/`."""
    groups = int(m["groups"])
    parts = [f"step {step}/{steps} v{int(m['policy_version'])}",
             f"reward {m['reward/total_mean']:.3f} acc {m['accuracy']:.2f}",
             f"signal {round(m['groups_with_signal'] * groups)}/{groups} groups "
             f"({m['nonzero_advantage_frac']:.0%} of samples)"]
    if teacher:
        parts.append(f"w_teacher {m['w_teacher']:.2f}")
    parts += [f"tools/sample {m['tool_calls_per_sample']:.2f}", f"loss {m['loss']:+.4f}", f"clip {m['clip_frac']:.3f}"]
    if kl:
        parts.append(f"kl {m['kl']:.4f}")
    parts.append(f"step {m['step_time_s']:.1f}s (wait {m['time_wait_s']:.1f} compute {m['time_compute_s']:.1f} "
                 f"sync {m['time_sync_s']:.1f})")
    return " ".join(parts)
