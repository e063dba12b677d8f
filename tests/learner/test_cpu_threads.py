"""The learner's adaptive torch threads (learner.adaptive_threads): the count for a measured load,
the measurement against real busy processes, and the hooks that apply it on the training thread in
both forward and backward."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from toolrl.learner.cpu_threads import ThreadGovernor, cpu_busy_jiffies, threads_for


@pytest.mark.parametrize("others, ncpu, want", [
    (0.0, 2, 2), (0.2, 2, 2), (0.5, 2, 1), (1.0, 2, 1), (2.0, 2, 1),  # never below one thread
    (0.0, 1, 1), (1.0, 16, 15), (3.2, 16, 13), (1.3, 16, 15)])
def test_one_thread_fewer_for_each_core_of_load(others, ncpu, want):
    assert threads_for(others, ncpu) == want


def test_proc_readings_grow_with_work():
    """The allowed cores' busy time counts at least this process's own work (less 2 ticks of rounding)."""
    cpus = os.sched_getaffinity(0)
    busy0, total0 = cpu_busy_jiffies(cpus)
    own0 = time.process_time()
    while time.process_time() - own0 < 0.3:
        pass
    busy1, total1 = cpu_busy_jiffies(cpus)
    own_ticks = (time.process_time() - own0) * os.sysconf("SC_CLK_TCK")
    assert busy1 - busy0 >= own_ticks - 2 and total1 > total0


def _spin(stop):
    while not stop.is_set():
        pass


def test_busy_neighbours_leave_the_learner_one_thread():
    """A spinning process on every core the learner may use: within a few samples the target is
    one thread (however busy the machine was before)."""
    gov = ThreadGovernor(interval_s=0.25)
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(gov.ncpu)]
    for p in spinners:
        p.start()
    try:
        gov.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (gov.target == 1 and gov.others_cores > gov.ncpu - 0.7):
            time.sleep(0.1)
        assert gov.target == 1
        assert gov.others_cores > gov.ncpu - 0.7  # the spinners' load, not ours
    finally:
        stop.set()
        gov.stop()
        for p in spinners:
            p.join(5)


@pytest.mark.serial
def test_own_work_is_not_counted_as_load():
    """Alone on the machine (the serial part of make test), the learner's own busy threads leave it
    every core: only the rest of the machine's load takes threads away."""
    gov = ThreadGovernor(interval_s=0.25).start()
    stop = threading.Event()
    a = torch.ones(256, 256)

    def work():
        while not stop.is_set():
            a @ a

    busy = [threading.Thread(target=work) for _ in range(gov.ncpu)]
    for t in busy:
        t.start()
    try:
        time.sleep(1.5)
        seen, others = [], []
        for _ in range(8):
            time.sleep(0.25)
            seen.append(gov.target)
            others.append(gov.others_cores)
        # at least once in 2 s (a shared CI machine's noise may cross the threshold now and then)
        assert max(seen) == gov.ncpu and min(others) < 0.5, (seen, others)
    finally:
        stop.set()
        gov.stop()
        for t in busy:
            t.join(5)


class _Probe(torch.autograd.Function):
    """Identity that records torch's thread count on the thread that runs its forward and backward."""
    seen: dict[str, list[int]] = {"forward": [], "backward": []}

    @staticmethod
    def forward(ctx, x):
        _Probe.seen["forward"].append(torch.get_num_threads())
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Probe.seen["backward"].append(torch.get_num_threads())
        return g


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return (_Probe.apply(self.lin(x)),)  # a tuple, as decoder layers return


def test_hooks_apply_the_target_in_forward_and_backward():
    """The target is applied on the training thread before each layer's forward and backward; stop()
    restores the count the thread had."""
    before = torch.get_num_threads()
    layers = torch.nn.ModuleList([_Layer() for _ in range(3)])
    torch.set_num_threads(3)
    gov = ThreadGovernor()  # not started: the target is set by hand
    assert gov.attach(torch.nn.Sequential()) == 0
    holder = torch.nn.Module()
    holder.layers = layers
    assert gov.attach(holder) == 3
    _Probe.seen = {"forward": [], "backward": []}
    try:
        torch.set_num_threads(2)
        gov.current, gov.target = 2, 1
        x = torch.ones(2, 8, requires_grad=True)
        for layer in layers:
            x = layer(x)[0]
        assert _Probe.seen["forward"] == [1, 1, 1]
        gov.target = 2  # the machine freed up between forward and backward
        x.sum().backward()
        assert _Probe.seen["backward"] == [2, 2, 2]
        assert gov.switches == 2
        assert 1.0 <= gov.mean_threads() <= 2.0
        gov.stop()  # the run is over: the training thread gets its own count back
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
