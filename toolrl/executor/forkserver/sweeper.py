"""The sweeper, the kill of a session's other processes without a cgroup, and the fallback sweep
when lanes have no uid of their own.

The sweeper kills everything a lane's uid still owns. It is a small helper forked before the heavy
imports (so its own forks are cheap) that forks a child, drops to the uid and calls kill(-1, SIGKILL)
until /proc shows no live process of that uid: kill(-1) as a uid reaches exactly that uid's
processes, atomically with respect to fork, wherever they went (setsid, double fork). Its return
value says nothing (it succeeds whenever any process exists), hence the /proc check.
"""
from __future__ import annotations

import os
import signal
import struct
import time
from collections.abc import Container

from toolrl.executor.syscalls import become, kill

_REQ = struct.Struct(">I")
_REPLY = struct.Struct(">IB")


class Sweeper:
    def __init__(self):
        req_r, self._req_w = os.pipe()
        self.fd, rep_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                _sweeper_main(req_r, rep_w)
            finally:
                os._exit(1)
        os.close(req_r)
        os.close(rep_w)
        os.set_blocking(self.fd, False)
        self._buf = b""

    def request(self, uid: int) -> None:
        os.write(self._req_w, _REQ.pack(uid))  # 4 bytes to a pipe: atomic, and the helper always reads

    def replies(self) -> list[tuple[int, bool]]:
        try:
            self._buf += os.read(self.fd, 4096)
        except BlockingIOError:
            pass
        out = []
        while len(self._buf) >= _REPLY.size:
            uid, ok = _REPLY.unpack_from(self._buf)
            self._buf = self._buf[_REPLY.size:]
            out.append((uid, bool(ok)))
        return out

    def close(self) -> None:
        for fd in (self._req_w, self.fd):
            try:
                os.close(fd)
            except OSError:
                pass


def _sweeper_main(req_r: int, rep_w: int) -> None:
    os.dup2(req_r, 3)
    os.dup2(rep_w, 4)
    os.closerange(5, 1 << 20)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    while True:
        data = b""
        while len(data) < 4:
            chunk = os.read(3, 4 - len(data))
            if not chunk:
                os._exit(0)
            data += chunk
        (uid,) = _REQ.unpack(data)
        pid = os.fork()
        if pid == 0:
            ok = 0
            try:
                become(uid)
                for i in range(2000):
                    os.kill(-1, signal.SIGKILL)  # succeeds whenever any process exists: check by hand
                    if not _alive_with_uid(uid):
                        ok = 1
                        break
                    time.sleep(0.0005 if i < 20 else 0.002)
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        os.write(4, _REPLY.pack(uid, 1 if os.waitstatus_to_exitcode(status) == 0 else 0))


def _alive_with_uid(uid: int) -> bool:
    """Any process other than this one, not a zombie, whose real uid is `uid`."""
    try:  # this process's pid as /proc numbers it (in a pid namespace of its own, getpid() is not)
        me = os.readlink("/proc/self")
    except OSError:
        me = str(os.getpid())
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == me:
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read(2048)
        except OSError:
            continue
        real, state = None, b""
        for line in status.split(b"\n"):
            if line.startswith(b"State:"):
                state = line[6:].strip()[:1]
            elif line.startswith(b"Uid:"):
                real = int(line.split()[1])
                break
        if real == uid and state not in (b"Z", b"X"):
            return True
    return False


def kill_uid_others(uid: int, known: Container[int]) -> bool:
    """Kill every process whose uids (real, effective, saved, filesystem) are all `uid`, except those
    in `known` (the service's own: runners, zygotes, the sweeper, the caller); whether any of them was
    alive. How a session's leftover processes are found where no cgroup lists them: only its runner
    and what the runner started have its uid (a lane's processes cannot change uid; the service's are
    root, and the one that becomes the uid, the runner, is known). The sweeper cannot do it: its
    kill(-1) as the uid would take the runner too.

    Never signals a process it has not checked, whatever pid reuse happens meanwhile: a candidate is
    pinned by a pidfd, its /proc entry read again, and the signal sent through the pidfd. A pid freed
    and reused before that read leaves the pidfd on the process that is gone, and the signal fails.
    Needs pidfds (Linux 5.3) and a /proc whose pids are the caller's."""
    alive = False
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in known or _uid_alive(name, uid) is None:
            continue
        try:
            fd = os.pidfd_open(int(name))
        except OSError:  # gone
            continue
        try:
            state = _uid_alive(name, uid)  # again, now that this pid cannot name another process
            if state is not None:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                alive |= state
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    return alive


def _uid_alive(pid: str, uid: int) -> bool | None:
    """None unless every uid of `pid` is `uid`; else whether it is alive: not a zombie, or a zombie
    leader whose other threads still run (its main thread exited alone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return None
    at = status.find(b"\nUid:")
    uids = status[at + 5:status.find(b"\n", at + 1)].split() if at >= 0 else []
    if len(uids) != 4 or any(int(u) != uid for u in uids):
        return None
    fields = dict(line.split(b":", 1) for line in status.split(b"\n") if b":" in line)
    return fields.get(b"State", b"").strip()[:1] not in (b"Z", b"X") or int(fields.get(b"Threads", b"1")) > 1


def pidfds_work() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (AttributeError, OSError):
        return False


def sweep_descendants(protect: set[int], proc_consistent: bool) -> None:
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
            kill(pid)
        time.sleep(0.002)
