"""The zygotes: the warm processes runners are forked from, and nothing else.

There are two. The heavy one pre-imports everything (numpy, sympy, ...) and serves sessions and any
code that names a module only it has loaded. The light one pre-imports the standard-library part
and serves the rest: measured, a trivial run costs 6.2 ms of service CPU from it, 8.3-8.7 ms from
the heavy one (fork, copy-on-write and exit all grow with the parent's memory). Code that reaches
numpy only through a computed name still works from the light one; it imports it on first use.

It pre-imports the allowed modules, backs its heap with huge pages, and then only forks runners
and reaps them. The fork server (the manager) does all the bookkeeping in its own, light process.
Why two processes: after fork() every page the parent writes is copied, and writing into a huge page
splits it. A busy event loop that forks (measured: ~355 copy-on-write faults per execution, huge pages
down from 36 MB to 2 MB) pays for its own bookkeeping once more on every fork; a loop that only forks
barely writes.

Protocol (SOCK_SEQPACKET, one JSON datagram per message):
  manager -> zygote  {"t": tag, "lane": {...}, "s": is_session}
  zygote -> manager  {"t": tag, "pid": pid, "vm": bytes} + the parent ends of the runner's pipes
                     (stdout, stderr, result, job) as SCM_RIGHTS; or {"t": tag, "err": reason}
  zygote -> manager  {"exit": pid, "st": wait status, "cpu": ms} when a runner is reaped
  zygote -> manager  {"hello": {...}} once, first

It learns of exits through a pidfd per runner, so it has no signal handler that runners would inherit.
"""
from __future__ import annotations

import collections
import ctypes
import gc
import importlib
import json
import os
import resource
import select
import signal
import socket
import sys
import threading

from toolrl.executor.runner import child
from toolrl.executor.syscalls import (CLONE_NEWNET, PR_SET_NO_NEW_PRIVS, clear_wakeup, prctl, setns,
                                      raise_nofile_limit, sigchld_wakeup, unshare)

VM_REFRESH = 256  # forks between re-reads of our own address-space size


class ZygoteLink:
    """The manager's handle on one zygote: its pid, socket, hello and a bounded send backlog."""

    def __init__(self, kind: str, preimport: list[str], base_path: list[str]):
        self.kind = kind
        self.pid, self.sock = start(preimport, base_path)
        hello, _ = receive(self.sock)  # blocks until its imports are done
        if not hello or "hello" not in hello:
            raise RuntimeError(f"the {kind} zygote did not start: {hello!r}")
        self.hello = hello["hello"]
        self.modules = set(self.hello.pop("modules", ()))
        self.sock.setblocking(False)
        self.backlog: collections.deque = collections.deque()  # at most one request per lane

    def fileno(self) -> int:
        return self.sock.fileno()

    def ask(self, tag: int, lane: dict, session: bool) -> None:
        self.backlog.append(json.dumps({"t": tag, "lane": lane, "s": session}).encode())
        self.flush()

    def flush(self) -> bool:
        """Send what the socket takes; True while something is still waiting (poll for POLLOUT)."""
        while self.backlog:
            try:
                self.sock.send(self.backlog[0])
            except BlockingIOError:
                return True
            self.backlog.popleft()
        return False


def start(preimport: list[str], base_path: list[str]) -> tuple[int, socket.socket]:
    """Fork a zygote from the manager; returns (pid, the manager's end of the socket)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)  # the manager's; closed just below
            os.dup2(theirs.fileno(), 3)
            os.closerange(4, 1 << 20)  # nothing of the manager's (front-end socket, epoll, pipes) stays open
            _main(socket.socket(fileno=3), preimport, base_path)
        finally:
            os._exit(1)
    theirs.close()
    return pid, mine


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message from the zygote (manager side); (None, []) when it is gone."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
    if not data:
        return None, fds
    return json.loads(data), fds


def _main(sock: socket.socket, preimport: list[str], base_path: list[str]) -> None:
    # Runners inherit our signal dispositions: make them those of a plain Python program, so a
    # child has nothing to reset (each reset costs copy-on-write faults).
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGALRM, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    loaded, missing = [], []
    extra = ["numpy.random"] if "numpy" in preimport else []  # numpy 2 loads it lazily: ~40 ms a run
    for name in preimport + extra + ["tempfile", "traceback", "linecache"]:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as exc:  # an optional module (numpy, sympy) that is not installed
            missing.append(f"{name}: {type(exc).__name__}")
    devnull = os.open(os.devnull, os.O_RDONLY)  # fd 4: with 0-4 taken, every pipe end is >= 5
    # One pidfd per live runner and one namespace fd per lane (runners set their own limit before
    # any code runs)
    raise_nofile_limit()
    reaper = _Reaper()
    netns = _LaneNetns()
    child.prepare_parent(base_path, reaper.handled)
    prctl(PR_SET_NO_NEW_PRIVS, 1)  # inherited by every runner; we never exec
    _skip_threading_after_fork()
    gc.collect()
    gc.freeze()  # objects made so far are never scanned again: runners do not touch their pages
    huge_mb = collapse_heap()
    vm = _vm_bytes()
    watch = "pidfd" if reaper.pidfds is not None else "SIGCHLD"
    modules = sorted({name.partition(".")[0] for name in sys.modules})
    sock.send(json.dumps({"hello": {"preimported": loaded, "preimport_missing": missing, "modules": modules,
                                    "hugepages_mb": huge_mb, "vm_bytes": vm, "exit_watch": watch}}).encode())
    sock_fd = sock.fileno()
    reaper.poller.register(sock_fd, select.POLLIN)
    forks = 0
    while True:
        for fd, _ in reaper.poller.poll():
            if fd != sock_fd:
                reaper.ready(fd, sock)
                continue
            data = sock.recv(1 << 16)
            if not data:
                os._exit(0)  # the manager is gone; our runners die with the PID namespace
            req = json.loads(data)
            forks += 1
            if forks % VM_REFRESH == 0:
                vm = _vm_bytes()
            req["lane"]["vm_bytes"] = vm
            req["lane"]["netns_fd"] = netns.fd(req["lane"])
            pid = _fork_runner(sock, req, devnull, vm)
            if pid:
                reaper.watch(pid)


def _fork_runner(sock: socket.socket, req: dict, devnull: int, vm: int) -> int:
    fds = []
    try:
        for _ in range(4):
            fds.extend(os.pipe())
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"t": req["t"], "err": str(exc)}).encode())
        return 0
    out_r, out_w, err_r, err_w, res_r, res_w, job_r, job_w = fds
    if pid == 0:
        try:
            child.child_main(req["lane"], (devnull, out_w, err_w, res_w, job_r), req["s"])
        finally:
            os._exit(child.SETUP_FAILED)
    for fd in (out_w, err_w, res_w, job_r):
        os.close(fd)
    try:
        socket.send_fds(sock, [json.dumps({"t": req["t"], "pid": pid, "vm": vm}).encode()],
                        [out_r, err_r, res_r, job_w])
    finally:
        for fd in (out_r, err_r, res_r, job_w):
            os.close(fd)
    return pid


class _Reaper:
    """Learns when runners exit: a pidfd per runner (Linux 5.3+), so no signal handler exists for
    children to inherit; else SIGCHLD with a wakeup pipe (children then reset it)."""

    def __init__(self):
        self.poller = select.poll()
        self.pidfds: dict[int, int] | None = {}
        self.handled: tuple[int, ...] = ()
        try:
            os.close(os.pidfd_open(os.getpid()))
        except (AttributeError, OSError):
            self.pidfds = None
            self.wake_r = sigchld_wakeup()
            self.poller.register(self.wake_r, select.POLLIN)
            self.handled = (signal.SIGCHLD,)

    def watch(self, pid: int) -> None:
        if self.pidfds is not None:
            fd = os.pidfd_open(pid)
            self.pidfds[fd] = pid
            self.poller.register(fd, select.POLLIN)

    def ready(self, fd: int, sock: socket.socket) -> None:
        if self.pidfds is None:
            clear_wakeup(self.wake_r)
            _reap(sock, -1)
            return
        pid = self.pidfds.pop(fd)
        self.poller.unregister(fd)
        os.close(fd)
        _reap(sock, pid)


class _LaneNetns:
    """One network namespace per lane, made here on the lane's first fork and joined by each of its
    runners (setns), instead of a new one per runner. Making a network namespace costs ~1 ms of the
    runner's CPU and tearing it down more in a kernel worker (measured: 14% of the service's CPU per
    trivial run). Reuse keeps the guarantee that matters: what a runner can leave in one without
    privileges is sockets, which die with the processes holding them, all killed before the lane runs
    again, and the namespace's counters (a covert channel to a later run of the lane, as the host's
    own figures are; docs/EXECUTOR.md, "Not covered"). Bounded by the number of lanes (slots +
    session indexes)."""

    def __init__(self):
        try:
            self.own = os.open("/proc/self/ns/net", os.O_RDONLY)
        except OSError:
            self.own = None
        self.fds: dict[str, int] = {}

    def fd(self, lane: dict) -> int | None:
        """The lane's namespace fd (inherited by the runner); None: the runner makes its own.

        Only for lanes with a uid of their own: a runner that stays root (no uid drop) could change
        the namespace itself (bring `lo` up, set sysctls), so it gets a new one every run."""
        if self.own is None or lane.get("uid") is None or not lane.get("unshare", 0) & CLONE_NEWNET:
            return None
        fd = self.fds.get(lane["name"])
        if fd is None:
            try:
                unshare(CLONE_NEWNET)
                try:
                    fd = os.open("/proc/self/ns/net", os.O_RDONLY)
                finally:
                    setns(self.own, CLONE_NEWNET)
            except OSError:
                return None  # the runner tries unshare itself, and reports the failure if it fails too
            self.fds[lane["name"]] = fd
        return fd


def _reap(sock: socket.socket, which: int) -> None:
    """wait4 `which` (a pid, or -1 for any) and tell the manager; never blocks."""
    while True:
        try:
            pid, status, ru = os.wait4(which, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        cpu = round((ru.ru_utime + ru.ru_stime) * 1000, 3)
        sock.send(json.dumps({"exit": pid, "st": status, "cpu": cpu}).encode())
        if which != -1:
            return


def _skip_threading_after_fork() -> None:
    """threading's after-fork hook rebuilds the thread bookkeeping in every child: ~146 of a runner's
    ~580 copy-on-write faults (measured). Here it has nothing to rebuild: the zygote never starts a
    thread and forks only from its loop, holding no lock, so the child's copy is already right (one
    main thread, unlocked module locks). Only then is the hook made a no-op."""
    hook = getattr(threading, "_after_fork", None)
    if hook is not None and threading.active_count() == 1 and not hook.__code__.co_freevars:
        hook.__code__ = (lambda *args, **kwargs: None).__code__


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def collapse_heap() -> int:
    """Back the warm heap with transparent huge pages (MADV_COLLAPSE, Linux 6.1+).

    fork() copies page tables and exit() tears them down: with 2 MB pages that is one entry instead
    of 512. Measured here: fork 2.3-2.8 ms -> 0.8-1.2 ms, and faster child exits. Best effort: on older
    kernels, or with THP disabled, nothing changes. Returns the MB now in huge pages."""
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


if __name__ == "__main__":  # pragma: no cover - started through start(), never directly
    sys.exit("the zygote is started by the fork server")
