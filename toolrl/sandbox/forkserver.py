"""The fork server: one single-threaded process that forks a fresh runner for every execution.

    python -m toolrl.sandbox.forkserver FD      (started by the front end; FD is its socket)

Start-up, in the first process: read the config frame, check the uid range is unused, create the
cgroups, unshare the mount/net/IPC/UTS/PID namespaces, fork. The child is PID 1 of the new PID
namespace: it mounts a private /proc and /tmp, makes / read-only, probes the uid drop, starts the
sweeper, pre-imports the allowed modules (so every runner starts warm), answers `hello` and serves.
When it dies, the kernel kills everything in its PID namespace: no runner outlives the server.

Each slot keeps one pre-forked spare runner (still root, already in its cgroup and working dir,
blocked on its job pipe), so a job costs one pipe write, not a fork, on the critical path. The
deadline is enforced here with SIGKILL. When a runner has been reaped, the slot's uid must own no
process (cgroup pids.current; else the sweeper) before its result is sent and the slot reused.
"""
from __future__ import annotations

import collections
import ctypes
import gc
import heapq
import importlib
import itertools
import logging
import os
import resource
import select
import signal
import sys
import time

from toolrl.sandbox import ipc, isolation, runner
from toolrl.sandbox.lanes import Lane, LaneFactory, Sweeper
from toolrl.sandbox.output import Capture

log = logging.getLogger("toolrl.forkserver")

SESSION_UID_OFFSET = 64  # slot uids are uid_base + [0, 64); session uids follow
IN, OUT = select.EPOLLIN, select.EPOLLOUT
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
IDLE_OUTPUT_LIMIT = 1 << 20  # a session whose leftover threads print this much between blocks is dropped
MEMORY_CGROUP_SLACK = 64 << 20  # pages the runner copies from the warm parent on write


class Run:
    __slots__ = ("job", "t0", "kill_reason", "kill_note", "reset", "cpu0", "done")

    def __init__(self, job: dict, reset: str | None):
        self.job, self.reset, self.t0 = job, reset, time.monotonic()
        self.kill_reason = self.kill_note = None
        self.cpu0 = 0.0
        self.done = False


class Proc:
    """One runner process and the parent's ends of its pipes."""

    __slots__ = ("pid", "lane", "owner", "session", "fds", "job_out", "out", "err", "res", "report",
                 "run", "blocks", "idle_bytes")

    def __init__(self, pid, lane, owner, session, fds, job_w, cap):
        self.pid, self.lane, self.owner, self.session, self.fds = pid, lane, owner, session, fds
        self.job_out = ipc.OutBuffer(job_w, limit=runner.MAX_JOB)
        self.out, self.err = Capture(cap), Capture(cap)
        self.res = ipc.FrameReader(limit=64 << 10)
        self.report: dict | None = None
        self.run: Run | None = None
        self.blocks = 0
        self.idle_bytes = 0


class Slot:
    __slots__ = ("index", "lane", "proc", "state", "pending", "since")

    def __init__(self, index: int, lane: Lane):
        self.index, self.lane, self.proc, self.state, self.pending = index, lane, None, "cleaning", None
        self.since = 0.0  # when its spare was forked


class Session:
    __slots__ = ("index", "lane", "proc", "state", "kill_note", "vm_base")

    def __init__(self, index: int, lane: Lane):
        self.index, self.lane, self.proc, self.state = index, lane, None, "idle"
        self.kill_note: str | None = None
        self.vm_base = 0


class ForkServer:
    def __init__(self, sock_fd: int, cfg: dict, report: dict, cgroups, lanes: LaneFactory, sweeper: Sweeper):
        self.cfg, self.report, self.cgroups, self.lanes, self.sweeper = cfg, report, cgroups, lanes, sweeper
        self.sock_fd = sock_fd
        os.set_blocking(sock_fd, False)
        self.reader = ipc.FrameReader()
        self.out = ipc.OutBuffer(sock_fd)
        self.ep = select.epoll()
        self.handlers: dict[int, object] = {}
        self.timers: list = []
        self._seq = itertools.count()
        self.queue: collections.deque = collections.deque()
        self.queue_bound = 2 * cfg["max_queue"] + 64
        self.workers = cfg["workers"] if report["uid_drop"] else 1
        self.active = 0
        self.procs: dict[int, Proc] = {}
        self.sessions: dict[int, Session] = {}
        self.lost: dict[int, str] = {}  # session index -> why its process ended while idle
        self.sweeps: dict[int, list] = {}
        self.oom_seen: dict[str, int] = {}
        self.outgoing: list[dict] = []
        self.stopping = False
        self._reaping = False
        self.devnull = os.open(os.devnull, os.O_RDONLY)
        ns, fs = report["namespaces"], report["filesystem"]
        self.proc_consistent = bool(fs.get("proc_private")) or not ns.get("pidns")  # /proc pids == our pids
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        self.watch(sock_fd, IN, self.on_sock)
        self.watch(self.wake_r, IN, self.on_wakeup)
        self.watch(sweeper.fd, IN, self.on_sweeper)
        base = cfg["uid_base"]
        self.slots = [Slot(i, lanes.make(f"slot{i}", base + i)) for i in range(self.workers)]

    # -- plumbing --------------------------------------------------------------------------------
    def _on_term(self, *_):
        self.stopping = True

    def on_wakeup(self, ev: int) -> None:
        try:
            os.read(self.wake_r, 4096)
        except BlockingIOError:
            pass
        self.reap()

    def watch(self, fd: int, events: int, handler) -> None:
        self.handlers[fd] = handler
        self.ep.register(fd, events)

    def unwatch(self, fd: int) -> None:
        if self.handlers.pop(fd, None) is not None:
            self.ep.unregister(fd)

    def at(self, delay: float, fn) -> None:
        heapq.heappush(self.timers, (time.monotonic() + delay, next(self._seq), fn))

    def send(self, msg: dict) -> None:
        self.out.write(ipc.pack(msg))
        if self.out.pending:
            self.ep.modify(self.sock_fd, IN | OUT)

    def serve(self) -> None:
        self.send({"op": "hello", "isolation": self.report, "workers": self.workers,
                   "uids": {"slots": [self.cfg["uid_base"], self.cfg["uid_base"] + self.workers - 1],
                            "sessions": [self.cfg["uid_base"] + SESSION_UID_OFFSET,
                                         self.cfg["uid_base"] + SESSION_UID_OFFSET + self.cfg["max_sessions"] - 1]}})
        for slot in self.slots:
            self.spawn_spare(slot)
        while not self.stopping:
            timeout = 1.0
            if self.timers:
                timeout = min(timeout, max(0.0, self.timers[0][0] - time.monotonic()))
            for fd, ev in self.ep.poll(timeout):
                handler = self.handlers.get(fd)
                if handler is not None:
                    handler(ev)
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                heapq.heappop(self.timers)[2]()
            self.dispatch()
            if self.outgoing:
                items, self.outgoing = self.outgoing, []
                self.send({"op": "results", "items": items})
        self.shutdown()

    def shutdown(self) -> None:
        for p in list(self.procs.values()):
            _kill(p.pid)
        deadline = time.monotonic() + 5
        while self.procs and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.01)
        self.out.flush()

    # -- front end ---------------------------------------------------------------------------------
    def on_sock(self, ev: int) -> None:
        if ev & OUT:
            self.out.flush()
            if not self.out.pending:
                self.ep.modify(self.sock_fd, IN)
        if ev & (IN | select.EPOLLHUP | select.EPOLLERR):
            try:
                data = os.read(self.sock_fd, 1 << 20)
            except BlockingIOError:
                return
            if not data:
                log.info("front end closed the connection; exiting")
                self.stopping = True
                return
            self.reader.feed(data)
            for msg in self.reader.frames():
                self.handle(msg)

    def handle(self, msg: dict) -> None:
        op = msg.get("op")
        if op == "run":
            for job in msg["jobs"]:
                if len(self.queue) >= self.queue_bound:
                    self.answer(job["id"], _synthetic("killed", "[executor: fork server queue full]"))
                else:
                    self.queue.append(job)
        elif op == "kill_session":
            self.kill_session(msg["session"], msg.get("note") or "session deleted")
        elif op == "cancel":
            self.cancel(set(msg["ids"]))
        elif op == "stop":
            self.stopping = True
        else:
            log.error("unknown message from the front end: %r", op)

    def answer(self, job_id: int, result: dict, reset: str | None = None, lost: str | None = None) -> None:
        self.outgoing.append({"id": job_id, "result": result, "reset": reset, "lost": lost})

    def cancel(self, ids: set) -> None:
        kept = collections.deque()
        for job in self.queue:
            if job["id"] in ids:
                self.answer(job["id"], _synthetic("killed", "[executor: cancelled before it ran]"))
            else:
                kept.append(job)
        self.queue = kept
        for p in list(self.procs.values()):
            if p.run and p.run.job["id"] in ids:
                self.kill_run(p, "killed", "[executor: cancelled]")

    # -- scheduling ------------------------------------------------------------------------------
    def dispatch(self) -> None:
        blocked = []
        while self.queue and self.active < self.workers:
            job = self.queue.popleft()
            if job.get("session") is None:
                # the spare that has waited longest has most likely finished its root phase
                slot = min((s for s in self.slots if s.state == "spare"), key=lambda s: s.since, default=None)
                if slot is None:
                    self.queue.appendleft(job)
                    break
                slot.state = "busy"
                self.start_run(slot.proc, job, None)
            elif not self.start_session_block(job):
                blocked.append(job)
        self.queue.extendleft(reversed(blocked))

    def start_run(self, p: Proc, job: dict, reset: str | None) -> None:
        run = p.run = Run(job, reset)
        timeout = job["timeout"]
        mem = job["memory_mb"] << 20
        if self.cgroups:
            try:
                self.cgroups.set_memory(p.lane.name, mem + MEMORY_CGROUP_SLACK)
            except OSError as exc:
                log.warning("lane %s: could not set the memory limit: %s", p.lane.name, exc)
        cpu_s = int(timeout) + 1
        if p.session is not None and p.blocks > 0:  # the session dropped privileges already
            run.cpu0 = _proc_cpu_s(p.pid)
            _prlimit(p.pid, resource.RLIMIT_CPU, int(run.cpu0) + cpu_s)
            _prlimit(p.pid, resource.RLIMIT_AS, p.session.vm_base + mem)
        p.blocks += 1
        lim = self.cfg["limits"]
        frame = {"code": job["code"], "stdin": job.get("stdin"),
                 "limits": {"cpu_s": cpu_s, "memory_bytes": mem, "fsize": lim["fsize"],
                            "nofile": lim["nofile"], "nproc": lim["nproc"]}}
        try:
            p.job_out.write(ipc.pack(frame))
        except ipc.FrameError as exc:
            self.kill_run(p, "killed", f"[executor: could not hand the job over: {exc}]")
        if p.job_out.pending:
            self.watch(p.job_out.fd, OUT, lambda ev, p=p: self.on_job_writable(p))
        self.active += 1
        self.at(timeout, lambda: self.on_deadline(p, run))

    def on_job_writable(self, p: Proc) -> None:
        p.job_out.flush()
        if not p.job_out.pending:
            self.unwatch(p.job_out.fd)

    def on_deadline(self, p: Proc, run: Run) -> None:
        if p.run is run and not run.done:
            self.kill_run(p, "timeout", f"[executor: killed after the time limit of {run.job['timeout']:g} s]")

    def kill_run(self, p: Proc, reason: str, note: str) -> None:
        if p.run is not None and p.run.kill_reason is None:
            p.run.kill_reason, p.run.kill_note = reason, note
        _kill(p.pid)

    # -- runner processes --------------------------------------------------------------------------
    def spawn(self, lane: Lane, owner, session: Session | None) -> Proc:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        job_r, job_w = os.pipe()
        sys.stderr.flush()
        child_lane = lane.for_child(_vm_bytes())
        try:
            pid = os.fork()
        except OSError:
            for fd in (out_r, out_w, err_r, err_w, res_r, res_w, job_r, job_w):
                os.close(fd)
            raise
        if pid == 0:
            try:
                runner.child_main(child_lane, (self.devnull, out_w, err_w, res_w, job_r), session is not None)
            finally:
                os._exit(runner.SETUP_FAILED)
        for fd in (out_w, err_w, res_w, job_r):
            os.close(fd)
        for fd in (out_r, err_r, res_r, job_w):
            os.set_blocking(fd, False)
        p = Proc(pid, lane, owner, session, {"out": out_r, "err": err_r, "res": res_r}, job_w,
                 self.cfg["max_output_bytes"])
        self.procs[pid] = p
        self.watch(out_r, IN, lambda ev, p=p: self.on_output(p, "out"))
        self.watch(err_r, IN, lambda ev, p=p: self.on_output(p, "err"))
        self.watch(res_r, IN, lambda ev, p=p: self.on_result(p))
        return p

    def on_output(self, p: Proc, stream: str) -> None:
        fd = p.fds[stream]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.unwatch(fd)
            return
        self._take_output(p, stream, data)

    def _take_output(self, p: Proc, stream: str, data: bytes) -> None:
        run = p.run
        if run is None or run.done:
            p.idle_bytes += len(data)  # a session's leftover thread, or a spare's setup error
            if p.session is None and p.idle_bytes < 65536:
                p.err.feed(data)
            elif p.session is not None and p.idle_bytes > IDLE_OUTPUT_LIMIT:
                p.session.kill_note = "its leftover threads kept printing between blocks"
                _kill(p.pid)
            return
        (p.out if stream == "out" else p.err).feed(data)
        if p.out.total + p.err.total > self.cfg["output_kill_bytes"] and run.kill_reason is None:
            self.kill_run(p, "output_limit",
                          f"[executor: killed after printing more than {self.cfg['output_kill_bytes']} bytes]")

    def on_result(self, p: Proc) -> None:
        fd = p.fds["res"]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.unwatch(fd)
            return
        try:
            p.res.feed(data)
            for frame in p.res.frames():
                if isinstance(frame, dict):
                    p.report = frame
                    if p.session is not None:
                        self.session_block_done(p)
        except ipc.FrameError:
            self.unwatch(fd)  # garbage from user code: ignore this channel, use the exit status

    def drain(self, p: Proc) -> None:
        budget = self.cfg["output_kill_bytes"] + (1 << 16)
        for stream in ("out", "err", "res"):
            fd = p.fds[stream]
            while fd in self.handlers and budget > 0:
                try:
                    data = os.read(fd, 1 << 16)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    self.unwatch(fd)
                    break
                budget -= len(data)
                if stream == "res":
                    try:
                        p.res.feed(data)
                        for frame in p.res.frames():
                            if isinstance(frame, dict):
                                p.report = frame
                    except ipc.FrameError:
                        break
                else:
                    self._take_output(p, stream, data)

    def close(self, p: Proc) -> None:
        for fd in (*p.fds.values(), p.job_out.fd):
            self.unwatch(fd)
            try:
                os.close(fd)
            except OSError:
                pass

    def reap(self) -> None:
        if self._reaping:
            return
        self._reaping = True
        try:
            while True:
                try:
                    pid, status, ru = os.wait4(-1, os.WNOHANG)
                except ChildProcessError:
                    return
                if pid == 0:
                    return
                p = self.procs.pop(pid, None)
                if p is not None:
                    self.on_exit(p, status, (ru.ru_utime + ru.ru_stime) * 1000)
                elif pid == self.sweeper.pid:
                    log.critical("the sweeper died (status %s); stopping so the front end restarts us", status)
                    self.stopping = True
        finally:
            self._reaping = False

    def on_exit(self, p: Proc, status: int, cpu_ms: float) -> None:
        self.drain(p)
        self.close(p)
        run = p.run
        if p.session is not None:
            self.session_exited(p, status, cpu_ms)
            return
        slot = p.owner
        if run is None:
            if self.stopping:
                return
            log.error("slot %d: spare runner exited before its job (status %s): %s", slot.index,
                      os.waitstatus_to_exitcode(status), p.err.text().strip()[-500:])
            slot.state, slot.proc = "cleaning", None
            self.at(0, lambda: self.cleanup_slot(slot, delay=0.5))
            return
        self.active -= 1
        run.done = True
        slot.pending = (run.job["id"], self.result(p, run, status, cpu_ms))
        slot.state, slot.proc = "cleaning", None
        self.at(0, lambda: self.cleanup_slot(slot))  # after the reap loop: orphans reaped first

    def result(self, p: Proc, run: Run, status: int | None, cpu_ms: float) -> dict:
        """status None: a session block that finished with the process still alive."""
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
            elif signaled == signal.SIGKILL and self._lane_oom(p.lane):
                word, note = "oom", f"[executor: killed at the memory limit of {run.job['memory_mb']} MB]"
            elif signaled in CRASH_SIGNALS:
                word, note = "error", f"[executor: the process crashed: {signal.Signals(signaled).name}]"
            else:
                word, note = "killed", f"[executor: killed by {signal.Signals(signaled).name}]"
        elif rep.get("oom") is True:
            word = "oom"
        elif exit_code == 0:
            word = "ok"
        else:
            word = "error"
            if exit_code == runner.SETUP_FAILED and not rep:
                log.error("lane %s: sandbox setup failed: %s", p.lane.name, p.err.text().strip()[-500:])
        stderr = p.err.text()
        if note:
            stderr = (stderr + ("\n" if stderr and not stderr.endswith("\n") else "") + note + "\n")
        return {"status": word, "exit_code": exit_code, "stdout": p.out.text(), "stderr": stderr,
                "truncated": p.out.truncated or p.err.truncated or word == "output_limit",
                "wall_ms": round((time.monotonic() - run.t0) * 1000, 3), "cpu_ms": round(cpu_ms, 3)}

    def _lane_oom(self, lane: Lane) -> bool:
        if not self.cgroups:
            return False
        try:
            n = self.cgroups.oom_kills(lane.name)
        except OSError:
            return False
        seen, self.oom_seen[lane.name] = self.oom_seen.get(lane.name, 0), n
        return n > seen

    # -- cleaning up after a lane ---------------------------------------------------------------------
    def ensure_empty(self, lane: Lane, then, attempt: int = 0) -> None:
        """Call then(ok) once nothing of the lane is alive; kills from outside when needed.

        With per-lane uids the sweeper kills (kill(-1) as the uid: atomic with respect to fork).
        Without them, the lane's cgroup says which pids are the lane's; without either, only the
        descendants of this process (orphans come to us: PID 1 or subreaper) are known."""
        if self.cgroups:
            self.reap()
            try:
                n = self.cgroups.pids(lane.name)
            except OSError:
                n = 1
            if n == 0:
                then(True)
                return
            if attempt >= 50:
                log.error("lane %s: %d tasks survive 50 sweeps", lane.name, n)
                then(False)
                return
            if lane.uid is None:
                for pid in self.cgroups.procs(lane.name):
                    _kill(pid)
                self.at(0.002, lambda: self.ensure_empty(lane, then, attempt + 1))
                return
        elif lane.uid is None:
            _sweep_descendants({p.pid for p in self.procs.values()} | {self.sweeper.pid}, self.proc_consistent)
            then(True)
            return
        elif attempt >= 1:
            then(True)
            return
        self.sweeps.setdefault(lane.uid, []).append(
            lambda ok: self.at(0.002 * attempt, lambda: self.ensure_empty(lane, then, attempt + 1)))
        if len(self.sweeps[lane.uid]) == 1:
            self.sweeper.request(lane.uid)

    def on_sweeper(self, ev: int) -> None:
        for uid, ok in self.sweeper.replies():
            if not ok:
                log.warning("sweep of uid %d did not converge", uid)
            for cb in self.sweeps.pop(uid, []):
                cb(ok)

    def cleanup_slot(self, slot: Slot, delay: float = 0.0) -> None:
        slot.state, slot.proc = "cleaning", None
        self.ensure_empty(slot.lane, lambda ok: self.slot_clean(slot, ok, delay))

    def slot_clean(self, slot: Slot, ok: bool, delay: float) -> None:
        if slot.pending is not None:
            self.answer(*slot.pending)
            slot.pending = None
        try:
            self.lanes.clean(slot.lane)
        except OSError as exc:
            log.error("slot %d: could not clean its working dir: %s", slot.index, exc)
            ok = False
        if not ok:
            slot.state = "down"
            self.at(1.0, lambda: self.cleanup_slot(slot))
            return
        if delay:
            self.at(delay, lambda: self.spawn_spare(slot))
        else:
            self.spawn_spare(slot)

    def spawn_spare(self, slot: Slot) -> None:
        try:
            slot.proc = self.spawn(slot.lane, slot, None)
            slot.state, slot.since = "spare", time.monotonic()
        except OSError as exc:
            log.error("slot %d: fork failed: %s; retrying", slot.index, exc)
            self.at(0.1, lambda: self.spawn_spare(slot))

    # -- sessions --------------------------------------------------------------------------------------
    def start_session_block(self, job: dict) -> bool:
        """False when the job has to wait (its session is busy, or being cleaned up)."""
        idx, fresh = job["session"], bool(job.get("fresh"))
        s = self.sessions.get(idx)
        if s is not None:
            if s.state != "idle":
                return False
            if fresh:  # the front end starts a new session at this index: drop the old process first
                self.kill_session(idx, "replaced by a new session")
                return False
        reset = None
        if s is None:
            lost = self.lost.pop(idx, None)
            if not fresh:
                reset = lost or "the session's process was no longer running"
            uid = self.cfg["uid_base"] + SESSION_UID_OFFSET + idx
            lane = None
            try:
                lane = self.lanes.make(f"sess{idx}", uid)
                s = Session(idx, lane)
                s.vm_base = _vm_bytes()
                s.proc = self.spawn(lane, None, s)
            except OSError as exc:
                log.error("session %d: could not start: %s", idx, exc)
                if lane is not None:
                    self.lanes.destroy(lane)
                self.answer(job["id"], _synthetic("killed", f"[executor: could not start the session: {exc}]"),
                            lost=f"could not start the session: {exc}")
                return True
            self.sessions[idx] = s
        s.state = "busy"
        self.start_run(s.proc, job, reset)
        return True

    def session_block_done(self, p: Proc) -> None:
        run, s = p.run, p.session
        if run is None or run.done:
            return
        self.drain(p)
        run.done = True
        cpu = p.report.get("cpu_ms") if isinstance(p.report.get("cpu_ms"), (int, float)) else 0.0
        result = self.result(p, run, None, float(cpu))
        p.run, p.report, p.idle_bytes = None, None, 0
        p.out, p.err = Capture(self.cfg["max_output_bytes"]), Capture(self.cfg["max_output_bytes"])
        self.active -= 1
        s.state = "idle"
        self.answer(run.job["id"], result, reset=run.reset)

    def session_exited(self, p: Proc, status: int, cpu_ms: float) -> None:
        s = p.session
        run = p.run
        why = s.kill_note or _describe_exit(status, run)
        if run is not None and not run.done:
            run.done = True
            self.active -= 1
            cpu = max(0.0, cpu_ms - run.cpu0 * 1000)
            self.answer(run.job["id"], self.result(p, run, status, cpu), reset=run.reset,
                        lost=why)
        elif s.kill_note is None:
            self.lost[s.index] = f"the session's process ended between blocks ({why})"
        s.proc, s.state = None, "cleaning"
        self.at(0, lambda: self.ensure_empty(s.lane, lambda ok: self.session_cleaned(s)))

    def session_cleaned(self, s: Session) -> None:
        try:
            self.lanes.destroy(s.lane)
        except OSError as exc:
            log.error("session %d: could not remove its working dir: %s", s.index, exc)
        if self.sessions.get(s.index) is s:
            del self.sessions[s.index]

    def kill_session(self, idx: int, note: str) -> None:
        self.lost.pop(idx, None)
        s = self.sessions.get(idx)
        for job in [j for j in self.queue if j.get("session") == idx]:
            self.queue.remove(job)
            self.answer(job["id"], _synthetic("killed", f"[executor: {note}]"), lost=note)
        if s is None or s.proc is None:
            return
        s.kill_note = note
        self.kill_run(s.proc, "killed", f"[executor: {note}]")


def _synthetic(status: str, note: str) -> dict:
    return {"status": status, "exit_code": None, "stdout": "", "stderr": note + "\n", "truncated": False,
            "wall_ms": 0.0, "cpu_ms": 0.0}


def _describe_exit(status: int, run: Run | None) -> str:
    if run is not None and run.kill_reason == "timeout":
        return "the previous block hit its time limit and the process was killed"
    if run is not None and run.kill_reason == "output_limit":
        return "the previous block printed too much and the process was killed"
    if os.WIFSIGNALED(status):
        return f"the process was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"the process exited with code {os.waitstatus_to_exitcode(status)}"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _prlimit(pid: int, res: int, value: int) -> None:
    try:
        resource.prlimit(pid, res, (value, value + 1 if res == resource.RLIMIT_CPU else value))
    except (ProcessLookupError, PermissionError, ValueError):
        pass


_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _collapse_heap() -> int:
    """Back the warm heap with transparent huge pages (MADV_COLLAPSE, Linux 6.1+).

    fork() copies page tables and exit() tears them down: with 2 MB pages that is one entry instead
    of 512. Measured here: fork 2.3-2.8 ms -> 0.8-1.2 ms, child exit about 1.5 ms faster. Best effort:
    on older kernels, or with THP disabled, nothing changes. Returns the MB now in huge pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    huge = 2 << 20
    try:
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return 0
    for line in maps:
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        path = parts[5] if len(parts) > 5 else ""
        if parts[1].startswith("rw") and parts[1][3] == "p" and path in ("", "[heap]"):
            a, b = (lo + huge - 1) & ~(huge - 1), hi & ~(huge - 1)
            if b > a:
                libc.madvise(a, b - a, 14)  # MADV_HUGEPAGE
                libc.madvise(a, b - a, 25)  # MADV_COLLAPSE
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def _sweep_descendants(protect: set[int], proc_consistent: bool) -> None:
    """No per-lane uid and no cgroups: kill every descendant of this process except `protect`.

    Only meaningful when /proc shows pids as we see them. In a PID namespace whose /proc is the
    host's (no mount namespace), every process of the namespace is ours: kill(-1) from PID 1
    reaches exactly those, live sessions included (the worst case; it is in the isolation report)."""
    if not proc_consistent:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    me = os.getpid()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        parents = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    pass
        victims = []
        for pid in parents:
            if pid in protect or pid == me:
                continue
            cur, seen = parents.get(pid), 0
            while cur and cur != me and cur not in protect and seen < 64:
                cur, seen = parents.get(cur), seen + 1
            if cur == me:
                victims.append(pid)
        if not victims:
            return
        for pid in victims:
            _kill(pid)
        time.sleep(0.002)


# ---------------------------------------------------------------------------------------------
# Start-up

def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s toolrl.forkserver %(levelname)s %(message)s", datefmt="%H:%M:%S")
    sock_fd = int(sys.argv[1])
    cfg = ipc.read_frame_blocking(sock_fd)
    disabled = set(cfg["disabled"])
    report = isolation.new_report(sorted(disabled))
    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)  # the front end dies -> we die -> PID 1 too
    if os.getppid() == 1:
        sys.exit(0)  # it died before we could ask
    os.setsid()  # signals aimed at the front end's process group (Ctrl-C, killpg) are for it alone
    if "uid" not in disabled and os.geteuid() == 0:
        try:
            cfg["uid_base"], _lock_fd = isolation.claim_uid_range(cfg["uid_base"],
                                                                   SESSION_UID_OFFSET + cfg["max_sessions"])
        except OSError as exc:
            log.critical("cannot claim a block of sandbox uids: %s", exc)
            sys.exit(3)
    cgroups = None
    if "cgroup" in disabled:
        report["missing"].append(f"cgroup: {isolation.IMPACT['cgroup']} (disabled by executor.disable_isolation)")
    else:
        try:
            cgroups = isolation.Cgroups(f"toolrl-exec-{os.getpid()}")
            report["cgroups"] = {"pids": True, "memory": True}
        except OSError as exc:
            report["missing"].append(f"cgroup: {isolation.IMPACT['cgroup']} ({exc})")
    isolation.enter_namespaces(report, disabled)
    pid = os.fork()
    if pid:
        _wait_child(pid, sock_fd, cgroups)
        return
    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
    if not report["namespaces"].get("pidns"):
        isolation.prctl(isolation.PR_SET_CHILD_SUBREAPER, 1)  # orphans come to us, not to init
    if report["namespaces"].get("utsns"):
        ctypes.CDLL(None).sethostname(b"sandbox", 7)
    scratch = isolation.setup_filesystem(report, 16)
    if "uid" in disabled:
        report["missing"].append(f"uid: {isolation.IMPACT['uid']} (disabled by executor.disable_isolation)")
    else:
        why = isolation.probe_uid_drop(cfg["uid_base"])
        report["uid_drop"] = why is None
        if why:
            report["missing"].append(f"uid: {isolation.IMPACT['uid']} ({why})")
    sweeper = Sweeper()  # before the heavy imports: its forks stay cheap
    report["preimported"], report["preimport_missing"] = [], []
    extra = ["numpy.random"] if "numpy" in cfg["preimport"] else []  # numpy 2 loads it lazily: ~40 ms
    for name in cfg["preimport"] + extra + ["tempfile", "traceback", "linecache"]:
        try:
            importlib.import_module(name)
            report["preimported"].append(name)
        except Exception as exc:  # an optional module (numpy, sympy) that is not installed
            report["preimport_missing"].append(f"{name}: {type(exc).__name__}")
    runner.prepare_parent([p for p in sys.path if p and p != os.getcwd()],
                          (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT))
    lanes = LaneFactory(scratch, report, cgroups, report["uid_drop"], cfg["limits"]["disk_mb"],
                        cfg["limits"]["nproc"])
    server = ForkServer(sock_fd, cfg, report, cgroups, lanes, sweeper)
    gc.collect()
    gc.freeze()  # objects made so far are never scanned again: runners do not touch their pages
    report["hugepages_mb"] = _collapse_heap()
    server.serve()
    os._exit(0)


def _wait_child(pid: int, sock_fd: int, cgroups) -> None:
    """The first process only waits: when it is told to stop, the PID-1 child and with it the whole
    namespace go (PDEATHSIG); afterwards it removes the cgroups."""
    os.close(sock_fd)
    signal.signal(signal.SIGTERM, lambda *_: _kill(pid))
    signal.signal(signal.SIGINT, lambda *_: _kill(pid))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            status = 0
            break
    if cgroups is not None:
        for _ in range(50):  # the namespace's processes die with PID 1; give the kernel a moment
            cgroups.remove_all()
            if not any(os.path.isdir(b) for b in cgroups.base.values()):
                break
            time.sleep(0.02)
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
