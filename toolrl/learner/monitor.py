"""Run monitoring: WandB (offline unless configured) and TensorBoard, written by rank 0 only,
plus one console line per step. Also the per-batch statistics the learner logs."""
from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter
from pathlib import Path

from toolrl.protocol import TRUNCATED, Sample


def batch_stats(samples: list[Sample], version: int) -> dict[str, float]:
    """Reward per component, accuracy, lengths, tool use and staleness of one training batch."""
    policy = [s for s in samples if s.source == "policy"] or samples
    out: dict[str, float] = {"samples": len(samples)}
    comps = sorted({k for s in policy for k in s.rewards})
    for k in comps:
        vals = [s.rewards.get(k, 0.0) for s in policy]
        out[f"reward/{k}_mean"] = statistics.fmean(vals)
        out[f"reward/{k}_std"] = statistics.pstdev(vals)
    totals = [s.reward for s in policy]
    out["reward/total_mean"] = statistics.fmean(totals)
    out["reward/total_std"] = statistics.pstdev(totals)
    out["accuracy"] = statistics.fmean([s.rewards.get("correct", 0.0) for s in policy])
    out["response_len"] = statistics.fmean([sum(s.loss_mask) for s in policy])
    out["completion_len"] = statistics.fmean([len(s.completion_ids) for s in policy])
    calls = [t for s in policy for t in s.tool_calls]
    out["tool_calls_per_sample"] = len(calls) / len(policy)
    out["tool_error_rate"] = sum(1 for t in calls if t.status != "ok") / len(calls) if calls else 0.0
    stale = Counter(version - s.policy_version for s in policy)
    out["staleness_mean"] = sum(k * v for k, v in stale.items()) / len(policy)
    for k, v in sorted(stale.items()):
        out[f"staleness/{k}"] = v
    out["stop/length_frac"] = sum(1 for s in policy if s.stop_reason in TRUNCATED) / len(policy)
    return out


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
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        if cfg.logging.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(project=cfg.logging.wandb_project, name=run_name or cfg.logging.run_name,
                                    mode=cfg.logging.wandb_mode, dir=str(self.dir),
                                    config=cfg.model_dump(mode="json"))

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
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
