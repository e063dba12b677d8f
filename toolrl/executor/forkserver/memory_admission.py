"""Admission by memory: the bound on the executor's total memory where no memory cgroup can hold it.

With a writable cgroup-v1 memory controller, one group above all lanes bounds everything (boot.py)
and nothing here runs. Without one (every cgroup-v2-only host), the manager bounds the total itself,
from /proc, against the same `total_memory_mb`:

- running executions (one-shot runs and session blocks alike; at most `workers` at once) are each
  held by RLIMIT_AS to their memory_mb, so `workers x memory_mb` of the total is kept for them, plus,
  while it runs, whatever one asks above memory_mb;
- the rest is the sessions' share: what sessions keep between blocks, measured. Past it, idle
  sessions are evicted, least recently used first (their next block is told, like any lost
  session); a new session that cannot fit even then (what holds the share is executing) is refused.

Measuring. /proc/PID/smaps_rollup gives a process's private memory exactly (the zygote's pages it
still shares are not its own) but walks its page tables: ~1 ms per 60 MB. /proc/PID/statm costs
~15 us, and its anonymous RSS moves exactly with what the process allocates and frees, though not
with the zygote's pages it copies on write. So a session counts as its private memory at its last
exact measurement plus its anonymous RSS change since. The end of a block reads statm (and its
working dir's tmpfs) only; each tick re-reads the idle sessions the same way (leftover threads may
allocate) and measures a few of them exactly, stalest first, to take in the copies; it also counts
any other process of a session's uid (what a block left running).

Why in the manager, not the front end: only the manager sees the runners (their pids are its own,
/proc is its namespace's), knows which sessions are executing and under which limit, and can evict
between two blocks without a round trip. The front end only answers a refusal as it answers a full
house of sessions (503), and an eviction reaches the client like any session lost between blocks.
"""
from __future__ import annotations

import os
import time

from toolrl.executor.forkserver.session_runners import SESSION_UID_OFFSET

PAGE = os.sysconf("SC_PAGE_SIZE")
TICK_S = 1.0
EXACT_PER_TICK = 2  # idle sessions measured exactly per tick (each ~1 ms per 60 MB it maps)
NEW_SESSION_BYTES = 16 << 20  # a new session counts this much until its first block has ended


def private_bytes(pid: int) -> int | None:
    """What only this process holds in memory (its private resident pages): exact, not cheap."""
    data = _read(f"/proc/{pid}/smaps_rollup")
    if data is None:
        return None
    kb = 0
    for line in data.split(b"\n"):
        if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
            kb += int(line.split()[1])
    return kb << 10


def anon_bytes(pid: int) -> int | None:
    """Resident anonymous memory (statm: resident minus file and shmem pages), a cheap counter."""
    data = _read(f"/proc/{pid}/statm")
    if not data:
        return None
    fields = data.split()
    return (int(fields[1]) - int(fields[2])) * PAGE


def tmpfs_bytes(path: str) -> int:
    """What the files on a lane's own tmpfs take (tmpfs pages are memory)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def uid_of(pid: int) -> int | None:
    """A process's real uid (its /proc dir belongs to root once it has dropped privileges)."""
    data = _read(f"/proc/{pid}/status")
    if data:
        for line in data.split(b"\n"):
            if line.startswith(b"Uid:"):
                return int(line.split()[1])
    return None


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 14)
    except OSError:
        return None
    finally:
        os.close(fd)


def _mb(n: int) -> int:
    return round(n / (1 << 20))


class Held:
    """What one session holds: exact private bytes at exact_at, plus the anonymous RSS change since."""

    __slots__ = ("exact", "anon_ref", "anon", "disk", "extra", "bytes", "exact_at", "last_used")

    def __init__(self, now: float):
        self.exact = self.anon_ref = self.anon = self.disk = self.extra = 0
        self.bytes = NEW_SESSION_BYTES  # what it counts for now
        self.exact_at = self.last_used = now

    def value(self) -> int:
        return max(0, self.exact + self.anon - self.anon_ref) + self.disk + self.extra


class MemoryAdmission:
    """The sessions' share of `total`, kept by measuring them and evicting idle ones (see above).

    sessions: the manager's dict of session records (index -> records.Session), read only;
    evict(index, note): end an idle session, and tell its next block why;
    waiting(): indices of sessions with a block queued (not evicted: it is about to run);
    known_pids(): every runner's pid (a session's other processes are what its blocks left running);
    session_uid0: the uid of session 0 when sessions have uids of their own, else None."""

    def __init__(self, total: int, workers: int, default_bytes: int, sessions: dict, evict, waiting,
                 known_pids, session_uid0: int | None):
        self.total, self.default = total, default_bytes
        self.reserve = workers * default_bytes
        self.sessions, self.evict, self.waiting, self.known_pids = sessions, evict, waiting, known_pids
        self.session_uid0 = session_uid0
        self.held: dict[int, Held] = {}
        self.sum = 0  # sum of held[*].bytes
        self.excess = 0  # what running executions asked above memory_mb
        self.excess_of: dict[int, int] = {}  # job id -> its part of excess
        self.evicted = self.refused = 0
        self._last_status: dict = {}

    # -- the share -----------------------------------------------------------------------------
    def share(self) -> int:
        return self.total - self.reserve - self.excess

    def fit(self, need: int = 0, or_none: bool = False) -> bool:
        """Evict idle sessions, least recently used first, until what sessions hold plus `need` is
        within their share; whether it now is. With `or_none`, evict nothing when evicting every idle
        session would not be enough (a new session that is refused anyway costs no one's state)."""
        room = self.share() - need
        if self.sum <= room:
            return True
        waiting = self.waiting()
        idle = sorted((h.last_used, idx) for idx, h in self.held.items()
                      if idx not in waiting and _idle(self.sessions.get(idx)))
        if or_none and self.sum - sum(self.held[idx].bytes for _, idx in idle) > room:
            return False
        for _, idx in idle:
            if self.sum <= room:
                break
            note = (f"evicted to bound the executor's memory (sessions held {_mb(self.sum)} MB, over the "
                    f"{_mb(max(0, self.share()))} MB that executor.total_memory_mb={_mb(self.total)} "
                    f"leaves them; least recently used idle session first)")
            self.evicted += 1
            self.forget(idx)
            self.evict(idx, note)
        return self.sum <= room

    def admit(self, idx: int) -> str | None:
        """A new session process at `idx`: None when it fits (it then counts NEW_SESSION_BYTES until
        measured), else why it is refused."""
        if not self.fit(NEW_SESSION_BYTES, or_none=True):
            self.refused += 1
            why = "every session holding it is executing" if self.sum else "that is less than a session needs"
            return (f"no memory for a new session: sessions hold {_mb(self.sum)} MB of the "
                    f"{_mb(max(0, self.share()))} MB that executor.total_memory_mb={_mb(self.total)} leaves "
                    f"them beside {_mb(self.reserve + self.excess)} MB kept for running executions, and {why}")
        self.forget(idx)
        self.held[idx] = Held(time.monotonic())
        self.sum += NEW_SESSION_BYTES
        return None

    def forget(self, idx: int) -> None:
        h = self.held.pop(idx, None)
        if h is not None:
            self.sum -= h.bytes

    def _set(self, h: Held) -> None:
        v = h.value()
        self.sum += v - h.bytes
        h.bytes = v

    # -- measuring -----------------------------------------------------------------------------
    def started(self, idx: int, pid: int) -> None:
        """The session's process exists: what it maps now is the zygote's, shared (counted as 0)."""
        h = self.held.get(idx)
        if h is not None:
            h.anon_ref = h.anon = anon_bytes(pid) or 0

    def block_done(self, idx: int) -> None:
        """After each block: a statm read and a statvfs (no page-table walk), then the share."""
        h, s = self.held.get(idx), self.sessions.get(idx)
        if h is None or s is None or s.proc is None:
            return
        h.last_used = time.monotonic()
        self._cheap(h, s)
        self.fit()

    def _cheap(self, h: Held, s) -> None:
        anon = anon_bytes(s.proc.pid)
        if anon is not None:
            h.anon = anon
        h.disk = tmpfs_bytes(s.lane.workdir) if s.lane.mounted else 0
        self._set(h)

    def _exact(self, h: Held, s) -> None:
        exact, anon = private_bytes(s.proc.pid), anon_bytes(s.proc.pid)
        if exact is None or anon is None:
            return  # gone, or no smaps_rollup (before Linux 4.14): the cheap count stands
        h.exact, h.anon_ref, h.anon, h.exact_at = exact, anon, anon, time.monotonic()
        self._set(h)

    def tick(self) -> dict | None:
        """Every TICK_S: re-read idle sessions, measure the stalest exactly, count what blocks left
        running, apply the share; the status when it changed since the last tick."""
        idle = []
        for idx, h in self.held.items():
            s = self.sessions.get(idx)
            if _idle(s):
                idle.append((h, s))
                self._cheap(h, s)
        for h, s in sorted(idle, key=lambda hs: hs[0].exact_at)[:EXACT_PER_TICK]:
            self._exact(h, s)
        if self.session_uid0 is not None:
            self._count_left_behind()
        self.fit()
        status = self.status()
        if status == self._last_status:
            return None
        self._last_status = status
        return status

    def _count_left_behind(self) -> None:
        """Processes of a session's uid other than its runner (children a block left running)."""
        known = self.known_pids()
        extra: dict[int, int] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in known:
                continue
            uid = uid_of(int(name))
            idx = None if uid is None else uid - self.session_uid0
            if idx in self.held:
                extra[idx] = extra.get(idx, 0) + (private_bytes(int(name)) or 0)
        for idx, h in self.held.items():
            if h.extra != extra.get(idx, 0):
                h.extra = extra.get(idx, 0)
                self._set(h)

    # -- running executions ------------------------------------------------------------------------
    def run_started(self, job_id: int, memory_bytes: int) -> None:
        """An execution asking more than memory_mb takes the rest from the sessions' share while it runs."""
        over = memory_bytes - self.default
        if over > 0:
            self.excess_of[job_id] = over
            self.excess += over
            self.fit()

    def answered(self, job_id: int) -> None:
        if self.excess_of:
            self.excess -= self.excess_of.pop(job_id, 0)

    def status(self) -> dict:
        return {"mode": "admission", "total_mb": _mb(self.total), "reserved_mb": _mb(self.reserve + self.excess),
                "sessions_share_mb": _mb(max(0, self.share())), "held_mb": _mb(self.sum),
                "sessions": len(self.held), "evicted": self.evicted, "refused": self.refused}


def _idle(s) -> bool:
    """Between blocks, and not already on its way out."""
    return s is not None and s.state == "idle" and s.proc is not None and s.kill_note is None


def admission_for(server) -> MemoryAdmission | None:
    """Admission for the manager (manager.ForkServer) where no memory cgroup bounds the total
    (boot.py), if /proc shows its runners under its own pids; else nothing bounds the total, and
    that is reported missing."""
    report, cfg = server.report, server.cfg
    if report.get("memory", {}).get("mode") == "cgroup":
        return None
    total = cfg["total_memory_bytes"]
    if not server.proc_consistent:
        report["memory"] = {"mode": "none", "total_mb": _mb(total)}
        report["missing"].append("memory: nothing bounds the executor's total memory (no memory cgroup, "
                                 "and /proc here does not show the sandbox's pids)")
        return None
    # Other processes of a session's uid are looked for only in the sandbox's own /proc (small).
    walk = report["uid_drop"] and report["filesystem"].get("proc_private")
    memory = MemoryAdmission(total, server.workers, cfg["memory_mb"] << 20, server.sessions,
                             server.evict_for_memory, lambda: {j.get("session") for j in server.queue},
                             lambda: server.procs, cfg["uid_base"] + SESSION_UID_OFFSET if walk else None)
    report["memory"] = memory.status()
    if memory.share() < NEW_SESSION_BYTES:
        report.setdefault("warnings", []).append(
            f"executor.total_memory_mb={_mb(total)} leaves sessions {_mb(memory.share())} MB beside "
            f"workers x memory_mb for running executions: new sessions will be refused")
    return memory
