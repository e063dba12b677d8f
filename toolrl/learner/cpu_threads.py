"""The learner's torch threads on a CPU machine it shares with the rollout engine: as many as the
rest of the machine leaves cores idle, re-measured twice a second (`learner.adaptive_threads`).

Why: torch's OpenMP threads meet at the end of every parallel region, so a learner with one thread
per core beside a busy engine runs at the pace of the thread that shares the engine's core. On the
2-core AVX2 host one SmolLM2 step took 15-18 s on two threads beside a busy core against 8-9 s on
one; yet when the engine idles (its queue is full), one thread leaves a core unused (the demo's
first step: 103 s on two threads against 150 s on one; docs/BENCHMARKS.md, 2026-11-28). Neither
fixed count suits both phases, and a run goes through both every step.

How: a background thread reads every allowed core's busy time (/proc/stat) less this process's own
CPU time (`time.process_time`, every thread): what the rest of the machine used, in cores. The
thread count is that many cores fewer than the learner may use (a core counts as taken from
`busy_cores` of load on).
OpenMP's thread count belongs to the thread that sets it, so the count is applied on the training
thread: before each decoder layer's forward and backward (module and tensor hooks; CPU backward
runs on the thread that called it), and by the loop before each step.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time

import torch

log = logging.getLogger(__name__)


def cpu_busy_jiffies(cpus: set[int]) -> tuple[int, int]:
    """(busy, total) clock ticks summed over `cpus` since boot, from /proc/stat."""
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu") or line[3] == " ":
                continue
            name, *vals = line.split()
            if int(name[3:]) not in cpus:
                continue
            ticks = [int(v) for v in vals[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def threads_for(others_cores: float, ncpu: int, busy_cores: float = 0.35) -> int:
    """Torch threads for a learner that may use `ncpu` cores while the rest of the machine keeps
    `others_cores` busy: one fewer for each core's worth of load, a core counted as taken from
    `busy_cores` of it (a thread beside a busy core costs every thread more than a missing one)."""
    taken = max(0, math.ceil(others_cores - busy_cores))
    return max(1, ncpu - taken)


class ThreadGovernor:
    """Samples the machine in a daemon thread; `apply()` (on the training thread) sets torch's
    thread count to the latest target. `attach(module)` makes the model apply it at every layer."""

    def __init__(self, interval_s: float = 0.5, busy_cores: float = 0.35):
        self.cpus = os.sched_getaffinity(0)
        self.ncpu = len(self.cpus)
        self.interval_s, self.busy_cores = interval_s, busy_cores
        self.target = self.current = self.initial = torch.get_num_threads()
        self.others_cores = 0.0
        self.switches = 0
        self._thread_s = 0.0  # sum over applied intervals of threads x seconds (for the mean)
        self._span_s = 0.0
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._run, name="thread-governor", daemon=True)

    def start(self) -> "ThreadGovernor":
        self._sampler.start()
        log.info("adaptive torch threads on %d cores: re-measured every %.1f s", self.ncpu, self.interval_s)
        return self

    def stop(self) -> None:
        """Stop sampling and give the calling (training) thread back the thread count it had."""
        self._stop.set()
        torch.set_num_threads(self.initial)
        self.current = self.initial

    def _run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        busy0, _ = cpu_busy_jiffies(self.cpus)
        own0, t0 = time.process_time(), time.monotonic()
        while not self._stop.wait(self.interval_s):
            busy1, own1, t1 = cpu_busy_jiffies(self.cpus)[0], time.process_time(), time.monotonic()
            others = max(0.0, (busy1 - busy0) / tick - (own1 - own0)) / max(t1 - t0, 1e-3)
            self.others_cores = others
            self.target = threads_for(others, self.ncpu, self.busy_cores)
            busy0, own0, t0 = busy1, own1, t1

    def apply(self, *_args) -> None:
        """Set torch's thread count on the calling thread to the target. Any hook signature."""
        target = self.target
        if target != self.current:
            now = time.monotonic()
            self._account(now)
            torch.set_num_threads(target)
            self.current = target
            self.switches += 1

    def _account(self, now: float) -> None:
        self._thread_s += self.current * (now - self._since)
        self._span_s += now - self._since
        self._since = now

    def mean_threads(self) -> float:
        """The time-weighted mean thread count since the last call (and resets it)."""
        self._account(time.monotonic())
        mean = self._thread_s / self._span_s if self._span_s > 0 else float(self.current)
        self._thread_s = self._span_s = 0.0
        return mean

    def attach(self, module: torch.nn.Module) -> int:
        """Apply the target before every layer of `module`'s layer stacks (the children of each
        ModuleList) runs forward, and before its backward: -> how many layers."""
        def after_forward(_mod, _inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda _grad: self.apply())  # returns None: the gradient is unchanged
        n = 0
        for stack in module.modules():
            if isinstance(stack, torch.nn.ModuleList):
                for layer in stack:
                    layer.register_forward_pre_hook(self.apply)
                    layer.register_forward_hook(after_forward)
                    n += 1
        return n
