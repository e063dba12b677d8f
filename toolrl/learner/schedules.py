"""What changes with training progress: the learning rate, the teacher-SFT weight and the time
budget. Each keeps what a resumed run needs in its checkpoint (the LR lives in DeepSpeed's)."""
from __future__ import annotations

import math
from typing import Callable

from toolrl.config import Config


def lr_lambda(cfg: Config, time_used: Callable[[], float] = lambda: 0.0,
              learner_step: Callable[[], int] | None = None):
    """The LR factor at an optimizer step. Warmup and decay count learner steps (batches), every
    optimizer step of a batch at its learner step's LR. `learner_step()`: the batch's step, read
    from the trainer (a batch may take fewer than updates_per_batch * mini_batches optimizer steps:
    one group, dynamic sampling, a skipped step; counting optimizer steps would put warmup and decay
    behind); without it, optimizer steps / (updates_per_batch * mini_batches). With
    learner.lr_decay_over "time", the decay's progress is at least `time_used()`, the fraction of
    the time budget used when the batch's step began."""
    warm, total, kind = cfg.learner.warmup_steps, max(1, cfg.learner.steps), cfg.learner.lr_schedule
    per_batch = cfg.grpo.updates_per_batch * cfg.grpo.mini_batches
    by_time = cfg.learner.lr_decay_over == "time"

    def f(opt_step: int) -> float:
        step = learner_step() if learner_step is not None else opt_step // per_batch
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant":
            return 1.0
        progress = min(1.0, max((step - warm) / max(1, total - warm), time_used() if by_time else 0.0))
        return 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
    return f


class TeacherWeight:
    """The teacher-SFT weight, decayed as the policy gets better:
    grpo.w_teacher * max(0, 1 - accuracy_ema / teacher.decay_at_accuracy), where accuracy_ema is an
    exponential moving average (teacher.ema) of the policy samples' accuracy in each batch."""

    def __init__(self, cfg: Config):
        self.base, self.decay_at, self.ema = cfg.grpo.w_teacher, cfg.teacher.decay_at_accuracy, cfg.teacher.ema
        self.acc_ema: float | None = None

    @property
    def value(self) -> float:
        if self.decay_at is None or self.acc_ema is None:
            return self.base
        return self.base * max(0.0, 1.0 - self.acc_ema / self.decay_at)

    def update(self, accuracy: float) -> None:
        self.acc_ema = accuracy if self.acc_ema is None else self.ema * self.acc_ema + (1 - self.ema) * accuracy

    def state_dict(self) -> dict:
        return {"acc_ema": self.acc_ema}

    def load_state_dict(self, state: dict) -> None:
        self.acc_ema = state.get("acc_ema")


def out_of_time(budget_s: float | None, elapsed_s: float, last_step_s: float, after_s: float = 0.0) -> bool:
    """Whether another step, as long as the last one, and then `after_s` more would end past the
    budget. learner.time_budget_s: `elapsed_s` counts training time across resumes (kept in the
    checkpoint), nothing after. learner.run_budget_s: `elapsed_s` is the whole run so far and
    `after_s` the final held-out evaluation's expected time."""
    return budget_s is not None and elapsed_s + last_step_s + after_s > budget_s
