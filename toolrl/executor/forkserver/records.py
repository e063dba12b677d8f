"""The fork server's records (runs, runner processes, slots, sessions) and how an exit becomes a result."""
from __future__ import annotations

import os
import signal
import time

from toolrl.executor import ipc
from toolrl.executor.forkserver.capture import Capture
from toolrl.executor.forkserver.lanes import Lane
from toolrl.executor.runner.child import MAX_JOB

CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
MAX_REPORT_BYTES = 4096  # a runner's report is under 100 bytes; anything bigger is not one
MAX_REPORTS = 4  # report frames a one-shot run may write before its channel is ignored


class Run:
    """One execution in progress."""

    __slots__ = ("job", "t0", "kill_reason", "kill_note", "reset", "cpu0", "done")

    def __init__(self, job: dict, reset: str | None):
        self.job, self.reset, self.t0 = job, reset, time.monotonic()
        self.kill_reason = self.kill_note = None
        self.cpu0 = 0.0
        self.done = False


class Proc:
    """One runner process and the fork server's ends of its pipes."""

    __slots__ = ("pid", "lane", "owner", "session", "fds", "job_out", "out", "err", "res", "report",
                 "reports", "run", "blocks", "idle_bytes", "vm_base")

    def __init__(self, pid: int, lane: Lane, owner, session, fds: dict, job_w: int, cap: int, vm_base: int):
        self.pid, self.lane, self.owner, self.session, self.fds = pid, lane, owner, session, fds
        self.job_out = ipc.OutBuffer(job_w, limit=MAX_JOB)
        self.out, self.err = Capture(cap), Capture(cap)
        self.res = ipc.FrameReader(limit=MAX_REPORT_BYTES)
        self.report: dict | None = None
        self.reports = 0  # frames on the result channel so far
        self.run: Run | None = None
        self.blocks = 0
        self.idle_bytes = 0
        self.vm_base = vm_base  # the address space it started with (RLIMIT_AS is on top of this)


class Slot:
    """A one-shot lane: its spare runner, reused run after run."""

    __slots__ = ("index", "lane", "kind", "proc", "state", "pending", "since", "failures", "last_error")

    def __init__(self, index: int, lane: Lane, kind: str):
        self.index, self.lane, self.proc, self.state, self.pending = index, lane, None, "cleaning", None
        self.kind = kind  # which zygote its spares come from: "light" or "heavy"
        self.since = 0.0  # when its spare was forked
        self.failures = 0  # spares in a row that died before their job (a broken sandbox set-up)
        self.last_error = ""


class Session:
    __slots__ = ("index", "lane", "proc", "state", "kill_note", "waiting")

    def __init__(self, index: int, lane: Lane):
        self.index, self.lane, self.proc, self.state = index, lane, None, "starting"
        self.kill_note: str | None = None
        self.waiting: tuple | None = None  # (job, reset) held until its process exists


# A process killed under its own limit because every lane together reached the group above them all
TOTAL_OOM = ("killed when the executor's executions and sessions together reached executor.total_memory_mb, "
             "under this code's own memory limit")


def classify(p: Proc, run: Run, status: int | None, cpu_ms: float, lane_oom) -> dict:
    """The ExecResult fields for a finished run. status None: a session block that finished with its
    process alive (its report frame holds the exit code). lane_oom(): did the kernel OOM-kill in the
    lane's cgroup (asked only for an unexplained SIGKILL)."""
    rep = p.report if isinstance(p.report, dict) else {}
    note = run.kill_note
    if status is None:
        exit_code = rep.get("x") if isinstance(rep.get("x"), int) else 1
        signaled = None
    elif os.WIFSIGNALED(status):
        signaled = os.WTERMSIG(status)
        exit_code = -signaled
    else:
        signaled = None
        exit_code = os.waitstatus_to_exitcode(status)
    if run.kill_reason:
        word = run.kill_reason
    elif signaled is not None:
        limit_ms = (int(run.job["timeout"]) + 1) * 1000
        if signaled == signal.SIGXCPU or (signaled == signal.SIGKILL and cpu_ms >= limit_ms - 20):
            word, note = "timeout", "[executor: killed at the CPU time limit]"
        elif signaled == signal.SIGKILL and lane_oom():
            word, note = "oom", f"[executor: killed at the memory limit of {run.job['memory_mb']} MB]"
        elif signaled in CRASH_SIGNALS:
            word, note = "error", f"[executor: the process crashed: {signame(signaled)}]"
        else:
            word, note = "killed", f"[executor: killed by {signame(signaled)}]"
    elif rep.get("oom") is True:
        word = "oom"
    elif exit_code == 0:
        word = "ok"
    else:
        word = "error"
    stderr = p.err.text()
    if note:
        stderr = stderr + ("\n" if stderr and not stderr.endswith("\n") else "") + note + "\n"
    return {"status": word, "exit_code": exit_code, "stdout": p.out.text(), "stderr": stderr,
            "truncated": p.out.truncated or p.err.truncated or word == "output_limit",
            "wall_ms": round((time.monotonic() - run.t0) * 1000, 3), "cpu_ms": round(cpu_ms, 3)}


def signame(n: int) -> str:
    """A signal's name; realtime signals (SIGRTMIN..SIGRTMAX, which a program can send itself) have
    none in signal.Signals, and an exception here would take the fork server down."""
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def synthetic(status: str, note: str) -> dict:
    """A result for a job that never ran."""
    return {"status": status, "exit_code": None, "stdout": "", "stderr": note + "\n", "truncated": False,
            "wall_ms": 0.0, "cpu_ms": 0.0}


def describe_exit(status: int, run: Run | None) -> str:
    if run is not None and run.kill_reason == "timeout":
        return "the previous block hit its time limit and the process was killed"
    if run is not None and run.kill_reason == "output_limit":
        return "the previous block printed too much and the process was killed"
    if os.WIFSIGNALED(status):
        return f"the process was killed by {signame(os.WTERMSIG(status))}"
    return f"the process exited with code {os.waitstatus_to_exitcode(status)}"
