"""The runner: what a runner process does between the fork server's fork() and its _exit().

Root phase (before any job): join the lane's cgroups and network namespace, enter a new IPC
namespace, put the pipes on fds 0-4, close every other inherited fd, enter the private working
directory. (Signal dispositions, no_new_privs, the environment and the stdio objects come ready from
the zygote.) Then it blocks on the job pipe. With the job: rlimits, drop to the lane's uid, stdin,
run the code as a script in one globals dict (so `import math` then `def f(): math.sqrt(...)`
works), kill what it left behind, report, exit.

A session runner keeps its globals and reads the next job instead of exiting.

Nothing here is trusted after user code has run: the code may have replaced any function. The fork
server therefore takes exit status, CPU time and leftover processes from the kernel, never from here.
"""
from __future__ import annotations

import builtins
import fcntl
import linecache
import os
import resource
import signal
import sys
import tempfile
import traceback
import types

from toolrl.executor import ipc
from toolrl.executor.runner import seccomp
from toolrl.executor.syscalls import CLONE_NEWNET, PR_SET_PDEATHSIG, become, prctl, setns, unshare

RESULT_FD, JOB_FD = 3, 4
SETUP_FAILED = 121  # exit code: the sandbox could not be set up; no user code ran
CODE_NAME = "<code>"
TB_FRAMES = 12  # a traceback keeps at most this many of the innermost frames
MAX_JOB = 64 << 20

# Bound before user code runs, so a snippet that reassigns os.kill and friends does not break its own
# report by accident.
_exit, _write, _kill, _waitpid = os._exit, os.write, os.kill, os.waitpid
# The interpreter's original stdio objects own fds 0-2 (closefd=True): if they were garbage-collected
# after being replaced, they would close the runner's new stdout. Keep them alive.
_KEEP: list = []

PARENT_HANDLED: list[int] = []  # signals the zygote handles (children reset them); usually none
_STDIO: tuple = ()
_STDIN_REPLACED = False


ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1", "VECLIB_MAXIMUM_THREADS": "1", "GOTO_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",  # model-written code gets no GPU, even on a GPU node
}


def child_main(lane: dict, fds: tuple[int, int, int, int, int], session: bool) -> None:
    """Entry point right after fork. Never returns."""
    try:
        g = _root_phase(lane, fds)
    except BaseException as exc:  # never run code in a half-built sandbox
        _die(f"sandbox setup failed: {type(exc).__name__}: {exc}")
    dropped = False
    while True:
        try:
            job = ipc.read_frame_blocking(JOB_FD, MAX_JOB)
        except BaseException:
            job = None
        if job is None:
            _exit(0)
        try:
            if not dropped:
                _drop(lane, job)
                dropped = True
            _set_stdin(job.get("stdin"))
        except BaseException as exc:
            _die(f"sandbox setup failed: {type(exc).__name__}: {exc}")
        if not session:
            os.close(JOB_FD)
        _reseed_numpy(job["code"])
        cpu0 = _cpu_s()
        code, oom = run_source(job["code"], g)
        _flush()
        if lane.get("uid") is not None:
            if not session:
                _try(resource.setrlimit, resource.RLIMIT_NPROC, (0, 0))  # threads can no longer fork
            _sweep_own_uid()
        report = {"x": code, "oom": oom, "cpu_ms": round((_cpu_s() - cpu0) * 1000, 3)}
        _try(_write, RESULT_FD, ipc.pack(report))
        if not session:
            _exit(code & 0xFF)


def _root_phase(lane: dict, fds: tuple[int, ...]) -> dict:
    """Everything that does not depend on the job, done while the runner waits as a spare.

    Kept lean on purpose: every page this touches is a copy-on-write fault (measured: ~700 faults
    per runner, a few microseconds each), so raw os calls, not the io stack."""
    for path in lane.get("cgroup_procs", ()):
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    flags = lane.get("unshare", 0)  # namespaces of the run's own (forkserver/lanes.py)
    if lane.get("netns_fd") is not None:  # the lane's network namespace, made once by the zygote
        setns(lane["netns_fd"], CLONE_NEWNET)
        flags &= ~CLONE_NEWNET
    if flags:
        unshare(flags)
    if fds[0] == 4 and min(fds[1:]) >= 5:  # the zygote's layout: no source is a target of a later dup2
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
    else:
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds]
        for target, fd in enumerate(high):
            os.dup2(fd, target)
    os.closerange(5, 1 << 20)
    if PARENT_HANDLED:  # only when the zygote had to fall back to a SIGCHLD handler
        signal.set_wakeup_fd(-1)
        for sig in PARENT_HANDLED:
            signal.signal(sig, signal.SIG_DFL)
    workdir = lane["workdir"]
    os.chdir(workdir)  # no_new_privs is inherited from the zygote: setuid binaries gain nothing
    environ = os.environ  # already exactly ENV (prepare_parent): only the per-lane paths differ
    environ["HOME"] = environ["TMPDIR"] = environ["PWD"] = workdir
    return _new_main(workdir)


def _drop(lane: dict, job: dict) -> None:
    lim = job["limits"]
    setrl = resource.setrlimit
    setrl(resource.RLIMIT_CORE, (0, 0))
    setrl(resource.RLIMIT_FSIZE, (lim["fsize"], lim["fsize"]))
    setrl(resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"]))
    setrl(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    cpu = lim["cpu_s"]
    setrl(resource.RLIMIT_CPU, (cpu, cpu + 1))  # soft: SIGXCPU, hard: SIGKILL
    as_bytes = lane["vm_bytes"] + lim["memory_bytes"]  # on top of the warm interpreter's address space
    setrl(resource.RLIMIT_AS, (as_bytes, as_bytes))
    uid = lane.get("uid")
    if uid is not None:
        become(uid)
    if lane.get("pdeathsig"):  # no PID namespace to take us down with the fork server
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
    if lane.get("seccomp"):  # last: from here on the code's syscalls are filtered
        seccomp.install()


def _new_main(workdir: str) -> dict:
    """A fresh __main__ and interpreter state, as `python script.py` would have."""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [CODE_NAME]
    sys.path.insert(0, workdir)
    _KEEP.extend((sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__))
    sys.stdin, sys.stdout, sys.stderr = _STDIO  # made in the parent; bound to fds 0-2, rebound by dup2
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = _STDIO
    return main.__dict__


def _reseed_numpy(src: str) -> None:
    """numpy's global RandomState was copied from the parent: reseed it, but only for code that can
    use it (Python's own `random` reseeds itself after fork)."""
    if "numpy" in src:
        npr = sys.modules.get("numpy.random")
        if npr is not None:
            npr.seed(int.from_bytes(os.urandom(4), "little"))


def prepare_parent(base_path: list[str], handled: tuple[int, ...]) -> None:
    """Run once in the fork server, so that each child has less to do (and fewer pages to copy).

    base_path: sys.path for user code, after the working dir (the forking process needs no more).
    handled: the signals the forking process gives handlers, which children reset. The environment
    becomes exactly ENV, and the stdio objects children will use are made here: they only hold fd
    numbers 0-2, which each child rebinds."""
    global _STDIO
    sys.path[:] = base_path
    PARENT_HANDLED[:] = handled
    os.environ.clear()
    os.environ.update(ENV)
    # Line-buffered, as on a terminal: what a run printed before it was killed (a time limit, a
    # crash) reaches the pipe, instead of dying in an 8 KiB buffer.
    _STDIO = (open(0, "r", encoding="utf-8", errors="replace", closefd=False),
              open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1),
              open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1))
    tempfile.tempdir = None  # computed in the child, from TMPDIR (the working dir)


def _set_stdin(text: str | None) -> None:
    """fd 0 is /dev/null from the zygote; with stdin text it becomes a memfd holding the text. In a
    session, a block without stdin gets /dev/null again, never the rest of an earlier block's."""
    global _STDIN_REPLACED
    if not text and not _STDIN_REPLACED:
        return
    if text:
        fd = os.memfd_create("stdin", 0)
        os.write(fd, text.encode("utf-8", "surrogatepass"))
        os.lseek(fd, 0, os.SEEK_SET)
    else:
        fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    _STDIN_REPLACED = bool(text)
    sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", errors="replace", closefd=False)


def run_source(src: str, g: dict) -> tuple[int, bool]:
    """Compile and run `src` in `g`; returns (exit code, ran out of memory). Prints short tracebacks."""
    linecache.cache[CODE_NAME] = (len(src), None, src.splitlines(True), CODE_NAME)
    try:
        code = compile(src, CODE_NAME, "exec", dont_inherit=True)
    except BaseException as exc:  # SyntaxError, ValueError (NUL bytes), MemoryError, RecursionError
        _print_exc(exc, None)
        return 1, isinstance(exc, MemoryError)
    try:
        exec(code, g)
        return 0, False
    except SystemExit as exc:
        return _exit_status(exc), False
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # drop harness frames
            tb = tb.tb_next
        _print_exc(exc, tb)
        return 1, isinstance(exc, MemoryError)


def _exit_status(exc: SystemExit) -> int:
    """As the interpreter does it: None -> 0, an int -> itself, anything else is printed -> 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    _emit(f"{code}\n")
    return 1


def _print_exc(exc: BaseException, tb) -> None:
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb, limit=-TB_FRAMES))
    except BaseException:
        text = f"{type(exc).__name__}\n"
    _emit(text)


def _emit(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    except BaseException:
        pass
    _try(_write, 2, text.encode("utf-8", "backslashreplace"))


def _flush() -> None:
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}.values():
        try:
            stream.flush()
        except BaseException:
            pass


def _sweep_own_uid() -> None:
    """kill(-1) as the lane's uid reaches exactly the processes this run left behind (not itself).
    A courtesy: the fork server checks and sweeps again from outside."""
    try:
        while _waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    _try(_kill, -1, signal.SIGKILL)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _try(fn, *args) -> None:
    try:
        fn(*args)
    except BaseException:
        pass


def _die(msg: str) -> None:
    _try(_write, 2, (msg + "\n").encode())
    _exit(SETUP_FAILED)


