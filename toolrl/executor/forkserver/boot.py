"""Start-up of the fork server (`python -m toolrl.executor.forkserver FD`; FD is the front end's socket).

The first process reads the config frame, claims a block of uids, creates the cgroups and unshares
the mount/net/IPC/UTS/PID namespaces, then only waits for its child (and removes the cgroups
afterwards). The child, PID 1 of the new PID namespace, mounts a private /proc and /tmp, makes /
read-only, probes the uid drop, starts the sweeper and serves (manager.ForkServer, which starts the
zygotes and answers `hello`).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time

from toolrl.executor import ipc
from toolrl.executor.forkserver import isolation
from toolrl.executor.forkserver.lanes import LaneFactory
from toolrl.executor.forkserver.manager import ForkServer
from toolrl.executor.forkserver.session_runners import SESSION_UID_OFFSET
from toolrl.executor.forkserver.sweeper import Sweeper
from toolrl.executor.runner import seccomp
from toolrl.executor.syscalls import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, kill, prctl, raise_nofile_limit

log = logging.getLogger("toolrl.forkserver")


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s toolrl.forkserver %(levelname)s %(message)s", datefmt="%H:%M:%S")
    sock_fd = int(sys.argv[1])
    cfg = ipc.read_frame_blocking(sock_fd)
    disabled = set(cfg["disabled"])
    report = isolation.new_report(sorted(disabled))
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the front end dies -> we die -> PID 1 too
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
    total = cfg["total_memory_bytes"] = cfg.get("total_memory_bytes") or isolation.host_memory_bytes() // 2
    if "cgroup" in disabled:
        report["missing"].append(f"cgroup: {isolation.IMPACT['cgroup']} "
                                 "(disabled by executor.disable_isolation)")
    else:
        try:
            cgroups = isolation.Cgroups(f"toolrl-exec-{os.getpid()}")
            report["cgroups"] = {"pids": True, "memory": True}
        except OSError as exc:
            report["missing"].append(f"cgroup: {isolation.IMPACT['cgroup']} ({exc})")
    if cgroups is not None:
        try:
            cgroups.set_total_memory(total)
            report["cgroups"].update(total_memory_mb=total >> 20, memory_cgroup=cgroups.base["memory"])
            report["memory"] = {"mode": "cgroup", "total_mb": total >> 20, "cgroup": cgroups.base["memory"]}
        except OSError as exc:  # the manager bounds the total by admission instead (no "memory" here)
            report.setdefault("warnings", []).append(f"could not bound all lanes' memory together: {exc}")
    isolation.enter_namespaces(report, disabled)
    pid = os.fork()
    if pid:
        _wait_child(pid, sock_fd, cgroups)
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if not report["namespaces"].get("pidns"):
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans come to us, not to init
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
    if "seccomp" in disabled:
        report["missing"].append(f"seccomp: {isolation.IMPACT['seccomp']} (disabled by executor.disable_isolation)")
    elif not seccomp.supported():
        report["missing"].append(f"seccomp: {isolation.IMPACT['seccomp']} (its syscall table is x86_64's)")
    report["seccomp"] = "seccomp" not in disabled and seccomp.supported()
    sweeper = Sweeper()
    lanes = LaneFactory(scratch, report, cgroups, report["uid_drop"], cfg["limits"]["disk_mb"],
                        cfg["limits"]["nproc"])
    # The manager holds four pipe ends per live runner: with hundreds of sessions, past the usual
    # soft 1024 (an OSError there would take it down)
    limit, need = raise_nofile_limit(), 4 * (cfg["workers"] + 2 + cfg["max_sessions"]) + 64
    if limit < need:
        log.warning("RLIMIT_NOFILE is %d, below the %d open files that %d workers and %d sessions may need: "
                    "raise the hard limit or lower executor.max_sessions", limit, need, cfg["workers"],
                    cfg["max_sessions"])
    server = ForkServer(sock_fd, cfg, report, cgroups, lanes, sweeper)
    server.serve()
    os._exit(0)


def _wait_child(pid: int, sock_fd: int, cgroups) -> None:
    """The first process only waits: when it is told to stop, the PID-1 child and with it the whole
    namespace go (PDEATHSIG); afterwards it removes the cgroups."""
    os.close(sock_fd)
    signal.signal(signal.SIGTERM, lambda *_: kill(pid))
    signal.signal(signal.SIGINT, lambda *_: kill(pid))
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
