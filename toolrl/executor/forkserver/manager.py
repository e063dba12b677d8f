"""The manager: the fork server's single-threaded event loop, PID 1 of the sandbox (boot.py starts it).

It serves the front end's socket, asks the zygotes (zygote.py says why they are separate processes)
for runners, hands each runner its job, captures its output, enforces deadlines and cleans its lane
up afterwards. When it dies, the kernel kills everything in its PID namespace: no runner outlives it.

Each slot keeps one pre-forked spare runner (still root, already in its cgroup and working dir,
blocked on its job pipe), so a job costs one pipe write, not a fork, on the critical path. Deadlines
are enforced here with SIGKILL. When a runner has exited, the slot's uid must own no process (cgroup
pids.current; else the sweeper) before its result is sent and the slot is reused.
"""
from __future__ import annotations

import collections
import gc
import heapq
import itertools
import logging
import os
import re
import resource
import select
import signal
import sys
import time

from toolrl.executor import ipc
from toolrl.executor.ipc import executor_caused
from toolrl.executor.forkserver import zygote
from toolrl.executor.forkserver.lanes import Lane, LaneFactory
from toolrl.executor.forkserver.memory_admission import TICK_S, admission_for
from toolrl.executor.forkserver.records import (MAX_REPORTS, TOTAL_OOM, Proc, Run, Session, Slot, classify,
                                                synthetic)
from toolrl.executor.forkserver.session_runners import SESSION_UID_OFFSET, SessionRunners
from toolrl.executor.forkserver.sweeper import Sweeper, pidfds_work, sweep_descendants
from toolrl.executor.forkserver.zygote import ZygoteLink
from toolrl.executor.runner.child import SETUP_FAILED
from toolrl.executor.syscalls import clear_wakeup, kill, proc_cpu_s, prlimit, sigchld_wakeup

log = logging.getLogger("toolrl.forkserver")

IN, OUT = select.EPOLLIN, select.EPOLLOUT
EXTRA_SLOTS = 2
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
IDLE_OUTPUT_LIMIT = 1 << 20  # a session whose leftover threads print this much between blocks is dropped
MEMORY_CGROUP_SLACK = 64 << 20  # pages the runner copies from the warm parent on write


class ForkServer(SessionRunners):
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
        self.spawns: dict[int, tuple] = {}  # tag -> (lane, owner, session, then): forks asked of a zygote
        self.oom_seen: dict[str, tuple[int, int]] = {}  # lane -> (OOM kills, failed charges) last seen
        self.unverified_blocks = 0  # session blocks ended on their report alone (/proc could not tell)
        self.outgoing: list[dict] = []
        self.stopping = False
        self._reaping = False
        ns, fs = report["namespaces"], report["filesystem"]
        self.proc_consistent = bool(fs.get("proc_private")) or not ns.get("pidns")  # /proc pids == our pids
        self.wake_r = sigchld_wakeup()
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        base_path = [p for p in sys.path if p and p != os.getcwd()]
        heavy = ZygoteLink("heavy", cfg["preimport"], base_path)
        self.zygotes = {"heavy": heavy}
        self.heavy_words: frozenset = frozenset()
        heavy_roots = set(cfg.get("heavy_modules", ()))
        light_pre = [m for m in cfg["preimport"] if m.partition(".")[0] not in heavy_roots]
        if light_pre != cfg["preimport"]:
            light = self.zygotes["light"] = ZygoteLink("light", light_pre, base_path)
            # any top-level module the heavy zygote has loaded and the light one has not
            self.heavy_words = frozenset(heavy.modules - light.modules)
        report.update({k: v for k, v in heavy.hello.items() if k != "vm_bytes"})
        report["zygotes"] = {k: {"preimported": z.hello["preimported"],
                                 "hugepages_mb": z.hello["hugepages_mb"]} for k, z in self.zygotes.items()}
        self.watch(sock_fd, IN, self.on_sock)
        self.watch(self.wake_r, IN, self.on_wakeup)
        self.watch(sweeper.fd, IN, self.on_sweeper)
        for z in self.zygotes.values():
            self.watch(z.fileno(), IN, lambda ev, z=z: self.on_zygote(z, ev))
        # More slots than `workers` (which bounds concurrent runs): a slot is out of service for a few
        # ms after each run (reap, sweep check, fork of its next spare); the extra ones keep a ready
        # spare waiting meanwhile, so a job never waits for a fork. Each slot's spares come from one
        # zygote.
        kinds = ["heavy"] * min(self.workers + EXTRA_SLOTS, SESSION_UID_OFFSET)
        if "light" in self.zygotes:  # each kind gets at most half of the slot uids
            half = SESSION_UID_OFFSET // 2
            kinds = (["light"] * min(self.workers + EXTRA_SLOTS, half)
                     + ["heavy"] * min(self.workers + 1, half))
        base = cfg["uid_base"]
        self.slots = [Slot(i, lanes.make(f"slot{i}", base + i), kind) for i, kind in enumerate(kinds)]
        # Without a cgroup, a session's other processes are found by its uid (kill_lane_others): safe
        # only where /proc's pids are ours and a pidfd can pin each one.
        self.helper_pids = {os.getpid(), sweeper.pid, *(z.pid for z in self.zygotes.values())}
        self.uid_kill = bool(report["uid_drop"] and self.proc_consistent and pidfds_work())
        if not cgroups and report["uid_drop"] and not self.uid_kill:
            report.setdefault("warnings", []).append(
                "a session block's leftover processes are killed only by the runner's own helper, which the "
                "session's code can replace (no cgroup, and no pidfds or no /proc of the sandbox's own)")
        self.memory = admission_for(self)  # None where a memory cgroup bounds the total (or nothing can)

    def memory_tick(self) -> None:
        """Admission by memory's periodic pass; the front end hears of changes (for /health)."""
        status = self.memory.tick()
        if status is not None:
            self.send({"op": "memory", "memory": status})
        self.at(TICK_S, self.memory_tick)

    # -- plumbing --------------------------------------------------------------------------------
    def _on_term(self, *_):
        self.stopping = True

    def on_wakeup(self, ev: int) -> None:
        clear_wakeup(self.wake_r)
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
        gc.collect()
        gc.freeze()  # what start-up made is never rescanned: no long GC pauses in the loop
        base, n = self.cfg["uid_base"], self.cfg["max_sessions"]
        self.send({"op": "hello", "isolation": self.report, "workers": self.workers,
                   "uids": {"slots": [base, base + len(self.slots) - 1],
                            "sessions": [base + SESSION_UID_OFFSET, base + SESSION_UID_OFFSET + n - 1]}})
        for slot in self.slots:
            self.spawn_spare(slot)
        if self.memory is not None:
            self.at(TICK_S, self.memory_tick)
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
            kill(p.pid)
        for z in self.zygotes.values():
            kill(z.pid)
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
                    self.answer(job["id"], synthetic("killed", "[executor: fork server queue full]"), fault=True)
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

    def answer(self, job_id: int, result: dict, reset: str | None = None, lost: str | None = None,
               fault: bool = False) -> None:
        """fault: the job did not run for the service's reasons, not its code's (api.ExecResult.executor_fault)."""
        self.outgoing.append({"id": job_id, "result": result, "reset": reset, "lost": lost, "fault": fault})
        if self.memory is not None:
            self.memory.answered(job_id)

    def refuse(self, job_id: int, why: str, reset: str | None) -> None:
        """Not run, and the front end answers it as it answers a full house of sessions (503)."""
        self.outgoing.append({"id": job_id, "result": synthetic("killed", f"[executor: {why}]"), "reset": reset,
                              "lost": None, "refused": why})

    def cancel(self, ids: set) -> None:
        kept = collections.deque()
        for job in self.queue:
            if job["id"] in ids:
                self.answer(job["id"], synthetic("killed", "[executor: cancelled before it ran]"))
            else:
                kept.append(job)
        self.queue = kept
        for p in list(self.procs.values()):
            if p.run and p.run.job["id"] in ids:
                self.kill_run(p, "killed", "[executor: cancelled]")
                if p.session is not None:  # its answer goes to nobody: the session's next block says why
                    self.lost[p.session.index] = executor_caused(
                        "a block was cancelled while it ran (its client went away or waited past "
                        "executor.max_wait_s)")

    # -- scheduling ------------------------------------------------------------------------------
    def dispatch(self) -> None:
        blocked = []
        while self.queue and self.active < self.workers:
            job = self.queue.popleft()
            if job.get("session") is not None:
                if not self.start_session_block(job):
                    blocked.append(job)
                continue
            kind = self.route(job["code"])
            # the spare that has waited longest has most likely finished its root phase
            slot = min((s for s in self.slots if s.state == "spare" and s.kind == kind),
                       key=lambda s: s.since, default=None)
            if slot is None:
                mine = [s for s in self.slots if s.kind == kind]
                if mine and all(s.failures >= 3 for s in mine):  # no spare will come: fail fast
                    self.answer(job["id"], synthetic("killed", f"[executor: cannot start runners: "
                                                               f"{mine[0].last_error}]"), fault=True)
                else:
                    blocked.append(job)  # jobs of the other kind may still go ahead
                continue
            slot.state = "busy"
            self.start_run(slot.proc, job, None)
        self.queue.extendleft(reversed(blocked))

    def route(self, code: str) -> str:
        """"heavy" when the code names a module only the heavy zygote has loaded (numpy, sympy, ...)."""
        if not self.heavy_words or not self.heavy_words.isdisjoint(_WORD.findall(code)):
            return "heavy"
        return "light"

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
        if p.session is not None:
            self.kill_lane_others(p)  # anything a block started between blocks does not run into this one
        if p.session is not None and p.blocks > 0:  # the session dropped privileges already
            run.cpu0 = proc_cpu_s(p.pid)
            prlimit(p.pid, resource.RLIMIT_CPU, int(run.cpu0) + cpu_s)
            prlimit(p.pid, resource.RLIMIT_AS, p.vm_base + mem)
        p.blocks += 1
        if self.memory is not None:
            self.memory.run_started(job["id"], mem)
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
            self.kill_run(p, "timeout",
                          f"[executor: killed after the time limit of {run.job['timeout']:g} s]")

    def kill_run(self, p: Proc, reason: str, note: str) -> None:
        if p.run is not None and p.run.kill_reason is None:
            p.run.kill_reason, p.run.kill_note = reason, note
        kill(p.pid)

    # -- runner processes (forked by the zygote) ---------------------------------------------------
    def spawn(self, lane: Lane, owner, session: Session | None, then, kind: str = "heavy") -> None:
        """Ask a zygote for a runner in `lane`; then(proc) when it exists, then(None) if it failed."""
        tag = next(self._seq)
        self.spawns[tag] = (lane, owner, session, then)
        z = self.zygotes[kind]
        try:
            z.ask(tag, lane.for_child(), session is not None)
        except OSError as exc:
            log.critical("cannot reach the %s zygote (%s); stopping so the front end restarts us", kind, exc)
            self.stopping = True
            return
        if z.backlog:
            self.ep.modify(z.fileno(), IN | OUT)

    def on_zygote(self, z: ZygoteLink, ev: int) -> None:
        if ev & OUT:
            try:
                if not z.flush():
                    self.ep.modify(z.fileno(), IN)
            except OSError:
                pass  # a dead zygote: the receive below says so
        while True:
            try:
                msg, fds = zygote.receive(z.sock)
            except BlockingIOError:
                return
            except OSError:
                msg, fds = None, []
            if msg is None:
                if not self.stopping:
                    log.critical("the %s zygote is gone; stopping so the front end restarts us", z.kind)
                self.stopping = True
                return
            if "exit" in msg:
                p = self.procs.pop(msg["exit"], None)
                if p is not None:
                    self.on_exit(p, msg["st"], msg["cpu"])
                continue
            lane, owner, session, then = self.spawns.pop(msg["t"])
            if "pid" not in msg:
                log.error("lane %s: fork failed: %s", lane.name, msg.get("err"))
                then(None)
                continue
            out_r, err_r, res_r, job_w = fds
            for fd in fds:
                os.set_blocking(fd, False)
            p = Proc(msg["pid"], lane, owner, session, {"out": out_r, "err": err_r, "res": res_r}, job_w,
                     self.cfg["max_output_bytes"], msg["vm"])
            self.procs[p.pid] = p
            self.watch(out_r, IN, lambda ev, p=p: self.on_output(p, "out"))
            self.watch(err_r, IN, lambda ev, p=p: self.on_output(p, "err"))
            self.watch(res_r, IN, lambda ev, p=p: self.on_result(p))
            then(p)

    def _read(self, fd: int) -> bytes:
        """What a runner's pipe holds now; b"" when it has nothing yet, or at EOF (then unwatched)."""
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return b""
        if not data:
            self.unwatch(fd)
        return data

    def on_output(self, p: Proc, stream: str) -> None:
        data = self._read(p.fds[stream])
        if data:
            self._take_output(p, stream, data)

    def _take_output(self, p: Proc, stream: str, data: bytes) -> None:
        run = p.run
        if run is None or run.done:
            p.idle_bytes += len(data)  # a session's leftover thread, or a spare's setup error
            if p.session is None and p.idle_bytes < 65536:
                p.err.feed(data)
            elif p.session is not None and p.idle_bytes > IDLE_OUTPUT_LIMIT:
                p.session.kill_note = "its leftover threads kept printing between blocks"
                kill(p.pid)
            return
        (p.out if stream == "out" else p.err).feed(data)
        if p.out.total + p.err.total > self.cfg["output_kill_bytes"] and run.kill_reason is None:
            limit = self.cfg["output_kill_bytes"]
            self.kill_run(p, "output_limit", f"[executor: killed after printing more than {limit} bytes]")

    def on_result(self, p: Proc) -> None:
        data = self._read(p.fds["res"])
        if data:
            self._take_reports(p, data, block_done=p.session is not None)

    def _take_reports(self, p: Proc, data: bytes, block_done: bool = False) -> None:
        """Feed the result pipe. The runner writes it, and so can the code it runs: nothing in a frame is
        believed that the kernel can tell instead (exit status, CPU time, what still runs). A one-shot
        runner's frame becomes `p.report`. A session reports once per block, and that frame only asks
        the fork server to check, itself, that the block has ended (confirm_block); a second frame in a
        block, or one between blocks, is the session's own code writing there, and ends the session."""
        try:
            p.res.feed(data)
            for frame in p.res.frames():
                if not isinstance(frame, dict):
                    continue
                p.reports += 1
                if p.session is None:
                    if p.reports > MAX_REPORTS:  # a flood: stop reading it, the exit status will do
                        self.unwatch(p.fds["res"])
                        return
                    p.report = frame
                elif p.run is None or p.run.done or p.report is not None:
                    self.kill_session(p.session.index, "its code wrote to the executor's result channel")
                    self.unwatch(p.fds["res"])
                    return
                else:
                    p.report = frame
                    if block_done:
                        self.confirm_block(p, p.run)
        except ipc.FrameError:
            self.unwatch(p.fds["res"])  # garbage from user code: ignore this channel, use the exit status

    def drain(self, p: Proc) -> None:
        budget = self.cfg["output_kill_bytes"] + (1 << 16)
        for stream in ("out", "err", "res"):
            fd = p.fds[stream]
            while fd in self.handlers and budget > 0:
                try:
                    data = os.read(fd, 1 << 16)
                except OSError:
                    break
                if not data:
                    self.unwatch(fd)
                    break
                budget -= len(data)
                if stream != "res":
                    self._take_output(p, stream, data)
                else:
                    self._take_reports(p, data)

    def close(self, p: Proc) -> None:
        for fd in (*p.fds.values(), p.job_out.fd):
            self.unwatch(fd)
            try:
                os.close(fd)
            except OSError:
                pass

    def reap(self) -> None:
        """Our own children: the sweeper, the zygote, and orphans (we are PID 1 or a subreaper)."""
        if self._reaping:
            return
        self._reaping = True
        try:
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return
                if pid == 0:
                    return
                helpers = {z.pid: f"{k} zygote" for k, z in self.zygotes.items()}
                helpers[self.sweeper.pid] = "sweeper"
                if pid in helpers and not self.stopping:
                    log.critical("the %s died (status %s); stopping so the front end restarts us",
                                 helpers[pid], status)
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
        slot.state, slot.proc = "cleaning", None
        if run is None:
            if not self.stopping:
                slot.failures += 1
                code = os.waitstatus_to_exitcode(status)
                slot.last_error = p.err.text().strip()[-500:] or f"exit status {code}"
                log.error("slot %d: spare runner exited before its job: %s", slot.index, slot.last_error)
            self.at(0, lambda: self.cleanup_slot(slot, delay=0.5))
            return
        slot.failures = 0
        self.active -= 1
        run.done = True
        res, fault = self.result(p, run, status, cpu_ms)
        slot.pending = (run.job["id"], res, None, None, fault is not None)
        self.at(0, lambda: self.cleanup_slot(slot))  # after this batch of events: orphans reaped first

    def result(self, p: Proc, run: Run, status: int | None, cpu_ms: float) -> tuple[dict, str | None]:
        """The run's ExecResult fields, and why the executor, not the code, ended it (a fault: the
        sample is left out, never scored), or None."""
        oom: dict[str, str | None] = {}

        def own_oom() -> bool:
            oom["at"] = self._lane_oom(p.lane)
            return oom["at"] == "own"

        res, fault = classify(p, run, status, cpu_ms, own_oom), None
        if oom.get("at") == "total":  # under its own limit: killed for what all lanes held together
            res["stderr"] += f"[executor: {TOTAL_OOM}]\n"
            fault = TOTAL_OOM
        if res["exit_code"] == SETUP_FAILED and status is not None and not p.report:
            log.error("lane %s: sandbox setup failed: %s", p.lane.name, p.err.text().strip()[-500:])
            fault = "the sandbox could not be set up: the code never ran"
        return res, fault

    def _lane_oom(self, lane: Lane) -> str | None:
        """Whether the kernel OOM-killed in the lane since the last look, and at which limit: "own"
        (the job's memory_mb: a charge failed at the lane's group) or "total" (the group above
        every lane, executor.total_memory_mb, full of what other executions and sessions hold: found
        in an audit, such kills were scored as the code's own "oom"). None: no OOM kill."""
        if not self.cgroups:
            return None
        try:
            kills, fails = self.cgroups.oom_kills(lane.name), self.cgroups.failures(lane.name)
        except OSError:
            return None
        seen_kills, seen_fails = self.oom_seen.get(lane.name, (0, 0))
        self.oom_seen[lane.name] = (kills, fails)
        if kills <= seen_kills:
            return None
        return "own" if fails > seen_fails else "total"

    # -- cleaning up after a lane ---------------------------------------------------------------------
    def ensure_empty(self, lane: Lane, then, attempt: int = 0, swept: bool = True) -> None:
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
                    kill(pid)
                self.at(0.002, lambda: self.ensure_empty(lane, then, attempt + 1))
                return
        elif lane.uid is None:
            protect = {p.pid for p in self.procs.values()} | {self.sweeper.pid}
            protect |= {z.pid for z in self.zygotes.values()}
            sweep_descendants(protect, self.proc_consistent)
            then(True)
            return
        elif attempt >= 1:  # no cgroup to count the lane's tasks: the sweeper's own check says
            then(swept)
            return
        self.sweeps.setdefault(lane.uid, []).append(
            lambda ok: self.at(0.002 * attempt, lambda: self.ensure_empty(lane, then, attempt + 1, ok)))
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
        except Exception as exc:  # whatever a run left behind, the fork server must not die of it
            log.error("slot %d: could not clean its working dir: %r", slot.index, exc)
            ok = False
        if not ok:
            slot.state = "down"
            self.at(1.0, lambda: self.cleanup_slot(slot))
        elif delay:
            self.at(delay, lambda: self.spawn_spare(slot))
        else:
            self.spawn_spare(slot)

    def spawn_spare(self, slot: Slot) -> None:
        slot.state = "spawning"
        self.spawn(slot.lane, slot, None, lambda p: self.spare_ready(slot, p), slot.kind)

    def spare_ready(self, slot: Slot, p: Proc | None) -> None:
        if p is None:
            self.at(0.1, lambda: self.spawn_spare(slot))
            return
        slot.proc, slot.state, slot.since = p, "spare", time.monotonic()
