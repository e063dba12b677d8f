"""A stop asked for by a signal: the learner finishes what it is doing, saves a checkpoint and exits.

SIGTERM is what SLURM, Kubernetes, torchrun, the deepspeed launcher and launch.sh send before
SIGKILL; SIGUSR1 is what `sbatch --signal=USR1@120` sends ahead of a job's time limit. Without this,
a preempted run lost every step since its last `checkpoint_every` save. The launchers' grace is
30 s (deepspeed's, torchrun's) before SIGKILL, so the loop stops at the first safe point: at once
while it waits for a batch, else after the step it is in. SIGINT (Ctrl-C) still stops at once.
"""
from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised on every rank together (after an all-reduce) to leave a wait for a batch."""


class StopRequest:
    """True once one of SIGNALS has arrived. Later ones change nothing: a launcher that forwards
    the signal it got (deepspeed's does, on top of launch.sh's own) must not turn a graceful stop
    into an abrupt one; its SIGKILL after the grace is the hard stop."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # only there can Python take signals
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        if self.signum is None:
            self.signum = signum

    def __bool__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "another rank's signal"

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGTERM)  # what a shell reports for a death by that signal

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
