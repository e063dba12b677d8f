"""The fork server's side of sessions: one long-lived runner per session index (its own lane and uid).

A block waits while its session is busy, starting or being cleaned up. A session whose process dies
(time limit, os._exit, OOM) is reported with the block that killed it (`lost`), or, when it died
between blocks, with the next block (`reset`). Mixed into ForkServer, whose state it uses.
"""
from __future__ import annotations

import logging
import os
import signal

from toolrl.executor.forkserver.capture import Capture
from toolrl.executor.forkserver.records import TOTAL_OOM, Proc, Session, describe_exit, synthetic
from toolrl.executor.forkserver.sweeper import kill_uid_others
from toolrl.executor.ipc import executor_caused
from toolrl.executor.runner.child import JOB_FD
from toolrl.executor.syscalls import kill, proc_cpu_s, waiting_on_read

log = logging.getLogger("toolrl.forkserver")
SESSION_UID_OFFSET = 64  # slot uids are uid_base + [0, 64); session uids follow


class SessionRunners:
    def start_session_block(self, job: dict) -> bool:
        """False when the job has to wait (its session is busy, starting, or being cleaned up)."""
        idx, fresh = job["session"], bool(job.get("fresh"))
        s = self.sessions.get(idx)
        if s is not None:
            if s.state != "idle" or s.kill_note is not None:  # (being killed: wait until it is gone)
                return False
            if fresh:  # the front end starts a new session at this index: drop the old process first
                self.kill_session(idx, "replaced by a new session")
                return False
            s.state = "busy"
            self.start_run(s.proc, job, None)
            return True
        reset = None if fresh else (self.lost.get(idx) or "the session's process was no longer running")
        if self.memory is not None:
            why = self.memory.admit(idx)
            if why is not None:
                self.refuse(job["id"], why, reset)
                return True
        self.lost.pop(idx, None)
        try:
            lane = self.lanes.make(f"sess{idx}", self.cfg["uid_base"] + SESSION_UID_OFFSET + idx)
        except OSError as exc:
            log.error("session %d: could not make its lane: %s", idx, exc)
            if self.memory is not None:
                self.memory.forget(idx)
            self.answer(job["id"], synthetic("killed", f"[executor: could not start the session: {exc}]"),
                        lost=executor_caused(f"could not start the session: {exc}"))
            return True
        s = self.sessions[idx] = Session(idx, lane)
        s.waiting = (job, reset)
        self.active += 1  # the block counts from now: its process is on its way
        self.spawn(lane, None, s, lambda p: self.session_ready(s, p))
        return True

    def session_ready(self, s: Session, p: Proc | None) -> None:
        job, reset = s.waiting
        s.waiting = None
        self.active -= 1  # start_run counts it again
        if p is None:
            self.answer(job["id"], synthetic("killed", "[executor: could not start the session]"),
                        lost=executor_caused("could not start the session"))
            s.state = "cleaning"
            self.session_cleaned(s)
            return
        s.proc, s.state = p, "busy"
        if self.memory is not None:
            self.memory.started(s.index, p.pid)
        self.start_run(p, job, reset)
        if s.kill_note:  # deleted while it was starting
            self.kill_run(p, "killed", f"[executor: {s.kill_note}]")

    def confirm_block(self, p: Proc, run, attempt: int = 0) -> None:
        """A session's block has reported. It has ended when the fork server sees so itself: nothing
        else runs in the session's lane (killed here, kill_lane_others: the runner's own kill helper is
        the session's code to replace) and the runner waits for its next job with none of its threads
        running. Until then the block goes on, under its time limit (a forged report gains nothing)."""
        if p.run is not run or run.done:
            return
        idle = False if self.kill_lane_others(p) else waiting_on_read(p.pid, JOB_FD)
        if idle is None and not self.unverified_blocks:
            log.warning("cannot watch a session runner from /proc here: its block reports are taken as given")
        self.unverified_blocks += idle is None
        if idle is False:
            self.at(min(0.02, 0.0002 * 2 ** attempt), lambda: self.confirm_block(p, run, attempt + 1))
        else:
            self.session_block_done(p)

    def kill_lane_others(self, p: Proc) -> bool:
        """Kill every process of p's lane but p itself; whether there were any. The lane's cgroup lists
        them; without one (every cgroup-v2-only host), /proc does, by the lane's uid."""
        if self.cgroups:
            try:
                others = [pid for pid in self.cgroups.procs(p.lane.name) if pid != p.pid]
            except OSError:
                others = None
            if others is not None:
                for pid in others:
                    kill(pid)
                return bool(others)
        if not self.uid_kill or p.lane.uid is None:
            return False
        return kill_uid_others(p.lane.uid, self.procs.keys() | self.helper_pids)

    def session_block_done(self, p: Proc) -> None:
        run, s = p.run, p.session
        if run is None or run.done:
            return
        self.drain(p)
        run.done = True
        cpu = max(0.0, proc_cpu_s(p.pid) - run.cpu0) * 1000  # the kernel's count, not the report's
        result, fault = self.result(p, run, None, cpu)
        p.run, p.report, p.idle_bytes = None, None, 0
        p.out, p.err = Capture(self.cfg["max_output_bytes"]), Capture(self.cfg["max_output_bytes"])
        self.active -= 1
        s.state = "idle"
        self.answer(run.job["id"], result, reset=run.reset, fault=fault is not None)
        if self.memory is not None:
            self.memory.block_done(s.index)

    def session_exited(self, p: Proc, status: int, cpu_ms: float) -> None:
        s = p.session
        run = p.run
        why = s.kill_note or describe_exit(status, run)
        if run is not None and not run.done:
            run.done = True
            self.active -= 1
            cpu = max(0.0, cpu_ms - run.cpu0 * 1000)
            result, fault = self.result(p, run, status, cpu)
            self.answer(run.job["id"], result, reset=run.reset, lost=executor_caused(fault) if fault else why,
                        fault=fault is not None)
        elif s.kill_note is None:
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and self._lane_oom(p.lane) == "total":
                # idle, it held what it had: what the others allocated did it
                self.lost[s.index] = executor_caused(f"the session's process ended between blocks ({TOTAL_OOM})")
            else:
                self.lost[s.index] = f"the session's process ended between blocks ({why})"
        s.proc, s.state = None, "cleaning"
        self.at(0, lambda: self.clean_session(s))

    def clean_session(self, s: Session, tries: int = 0) -> None:
        """Free the session's index once nothing of its lane is alive. A lane the sweeps could not
        empty keeps its index (state "cleaning": a block at it waits) and is swept again, 1 s later,
        then backing off to a minute (a failed sweep holds the sweeper for seconds), as a slot goes
        down: its uid and lane must not pass to a new session while a process of the old one lives."""
        def then(ok: bool) -> None:
            if ok:
                self.session_cleaned(s)
            else:
                log.error("session %d: its lane still has live processes; the index stays out of use", s.index)
                self.at(min(60.0, 2.0 ** tries), lambda: self.clean_session(s, tries + 1))
        self.ensure_empty(s.lane, then)

    def session_cleaned(self, s: Session) -> None:
        try:
            self.lanes.destroy(s.lane)
        except Exception as exc:  # whatever a session left behind, the fork server must not die of it
            log.error("session %d: could not remove its working dir: %r", s.index, exc)
        if self.sessions.get(s.index) is s:
            del self.sessions[s.index]
            if self.memory is not None:
                self.memory.forget(s.index)

    def evict_for_memory(self, idx: int, note: str) -> None:
        """End an idle session to bound the executor's memory (memory_admission.py); like a process
        that died between blocks, the session's next block gets `session_reset` and this note."""
        note = executor_caused(note)
        self.kill_session(idx, note)
        self.lost[idx] = note

    def kill_session(self, idx: int, note: str) -> None:
        self.lost.pop(idx, None)
        s = self.sessions.get(idx)
        for job in [j for j in self.queue if j.get("session") == idx]:
            self.queue.remove(job)
            self.answer(job["id"], synthetic("killed", f"[executor: {note}]"), lost=note)
        if s is None:
            return
        s.kill_note = note
        if s.proc is not None:
            self.kill_run(s.proc, "killed", f"[executor: {note}]")


