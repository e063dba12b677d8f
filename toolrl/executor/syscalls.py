"""The Linux calls the fork server's processes and the runners share: ctypes wrappers for what the
os module lacks (unshare, setns, mount, prctl), and the few process operations every one of them does the
same way (kill, drop to a uid, per-process limits, a wakeup pipe for SIGCHLD).
"""
from __future__ import annotations

import ctypes
import os
import platform
import resource
import signal

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def setns(fd: int, nstype: int) -> None:
    """Join the namespace `fd` refers to (os.setns only exists from Python 3.12)."""
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), f"setns({nstype:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def umount(target: str) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(2)), f"umount {target}")  # MNT_DETACH


def prctl(option: int, arg: int, arg3: int = 0) -> None:
    _check(_prctl(option, arg, arg3, 0, 0), f"prctl({option})")


def become(uid: int) -> None:
    """Drop to `uid` (and the group of the same number, no supplementary groups) for good."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError("uid drop did not take")


def kill(pid: int) -> None:
    """SIGKILL, for a process that may already be gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def prlimit(pid: int, res: int, value: int) -> None:
    """Set another process's limit (soft = hard, but for CPU: SIGXCPU first, SIGKILL a second later)."""
    try:
        resource.prlimit(pid, res, (value, value + 1 if res == resource.RLIMIT_CPU else value))
    except (ProcessLookupError, PermissionError, ValueError):
        pass


_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """CPU seconds a live process has used so far, from /proc (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


_READ_SYSCALL = {"x86_64": 0, "aarch64": 63}.get(platform.machine())


def waiting_on_read(pid: int, fd: int) -> bool | None:
    """From /proc, never from the process: whether `pid`'s main thread is blocked in read(fd) and none
    of its threads is running. None when this cannot be told here (another architecture, or /proc
    refuses)."""
    if _READ_SYSCALL is None:
        return None
    try:
        with open(f"/proc/{pid}/syscall") as f:
            fields = f.read().split()
        if not fields or fields[0] == "running" or int(fields[0]) != _READ_SYSCALL or int(fields[1], 16) != fd:
            return False
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "R":
                    return False
        return True
    except FileNotFoundError:
        return False  # gone: its exit is on its way
    except (OSError, ValueError, IndexError):
        return None


def sigchld_wakeup() -> int:
    """Make SIGCHLD (and any other handled signal) write to a pipe; returns its non-blocking read end,
    for a poll loop that must wake when a child exits."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return wake_r


def clear_wakeup(fd: int) -> None:
    """Empty the wakeup pipe: its bytes only say that a signal came."""
    try:
        os.read(fd, 4096)
    except BlockingIOError:
        pass


def raise_nofile_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard limit (the usual soft 1024 is too few for the fork
    server's pipes, pidfds and namespace fds once hundreds of sessions live); -> the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    except (ValueError, OSError):
        return soft
