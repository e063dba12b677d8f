"""Linux isolation for the fork server, set up with plain syscalls (no bubblewrap/nsjail needed).

`enter_namespaces` and `Cgroups` run in the fork server's first process (where /proc still shows the
host); `setup_filesystem` and `probe_uid_drop` run in the PID-1 child it forks. Each layer that
cannot be set up is recorded in `report["missing"]` with what its absence means; the front end
logs every entry loudly and can refuse to start (`executor.strict_isolation`). Nothing is weakened
without appearing there.
"""
from __future__ import annotations

import errno
import fcntl
import os
import pwd
import sys
import tempfile

from toolrl.executor.syscalls import (CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER,
                                      CLONE_NEWUTS, MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE,
                                      MS_RDONLY, MS_REC, MS_REMOUNT, become, mount, unshare)

IMPACT = {
    "mountns": "no mount namespace: runners share /tmp, /dev/shm and the rest of the host filesystem "
               "(writable wherever the slot uid may write), and cannot read a Python installed under /root",
    "netns": "no network namespace: runners can reach the network, including this service's own port",
    "pidns": "no PID namespace: runners see every host process in /proc (command lines included)",
    "ipcns": "no IPC namespace: runners share SysV IPC and POSIX message queues with the host",
    "utsns": "no UTS namespace: runners see the host name",
    "uid": "no per-slot uid: runners run as the service's own uid, can signal each other and the fork "
           "server, and read each other's files; concurrency is forced to 1 slot",
    "cgroup": "no cgroups: memory is limited per process (RLIMIT_AS) not per slot, process count only by "
              "RLIMIT_NPROC, out-of-memory kills by the kernel read as 'killed', and the kernel does not bound "
              "the executor's total memory (admission does instead, measured from /proc: `memory` in /health)",
    "seccomp": "no seccomp filter: runners can make user namespaces (and mount inside them), use ptrace, "
               "io_uring, BPF and keyrings",
}


def new_report(disabled: list[str]) -> dict:
    return {"euid": os.geteuid(), "namespaces": {}, "uid_drop": False, "cgroups": {}, "filesystem": {},
            "disabled": sorted(disabled), "missing": []}


def _missing(report: dict, layer: str, why: str) -> None:
    report["missing"].append(f"{layer}: {IMPACT.get(layer, layer)} ({why})")


# ---------------------------------------------------------------------------------------------
# Namespaces (called in the fork server's first process, before it forks the PID-1 child)

def enter_namespaces(report: dict, disabled: set[str]) -> None:
    ns = report["namespaces"]
    if os.geteuid() != 0:
        # Unprivileged: a user namespace makes the others possible, but maps a single uid only.
        uid, gid = os.geteuid(), os.getegid()
        try:
            unshare(CLONE_NEWUSER)
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
            ns["user"] = True
        except OSError as exc:
            ns["user"] = False
            report["userns_error"] = str(exc)
    for layer, flag in (("mountns", CLONE_NEWNS), ("netns", CLONE_NEWNET), ("ipcns", CLONE_NEWIPC),
                        ("utsns", CLONE_NEWUTS), ("pidns", CLONE_NEWPID)):
        if layer in disabled:
            ns[layer] = False
            _missing(report, layer, "disabled by executor.disable_isolation")
            continue
        try:
            unshare(flag)
            ns[layer] = True
        except OSError as exc:
            ns[layer] = False
            _missing(report, layer, str(exc))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def claim_uid_range(base: int, size: int, tries: int = 64) -> tuple[int, int]:
    """A block of `size` uids from `base` upwards that no other executor on this machine holds.

    Each executor holds an flock on a lock file named after its block for as long as it lives, so two
    services (tests, colleagues) never share slot uids (RLIMIT_NPROC counts per uid system-wide).
    Returns (first uid, lock fd to keep open)."""
    step = 1 << 16
    for k in range(tries):
        first = base + k * step
        path = os.path.join(tempfile.gettempdir(), f"toolrl-exec-uids-{first}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if uids_in_use(first, first + size - 1):
            os.close(fd)
            continue
        return first, fd
    raise OSError(f"no free block of {size} uids in {tries} tries from {base}")


def uids_in_use(first: int, last: int) -> list[str]:
    """Accounts or live processes that already use a uid in [first, last]: sharing one would let
    the sandbox signal them (kill(-1) as that uid) or read their files."""
    found = [f"user {p.pw_name}" for p in pwd.getpwall() if first <= p.pw_uid <= last]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{pid}")
        except OSError:
            continue
        if first <= st.st_uid <= last:
            found.append(f"process {pid}")
    return found


# ---------------------------------------------------------------------------------------------
# Filesystem (in the PID-1 child)

def setup_filesystem(report: dict, scratch_mb: int) -> str:
    """Private /proc, /tmp and friends, read-only root; returns the scratch root for working dirs."""
    fs = report["filesystem"]
    if not report["namespaces"].get("mountns"):
        root = tempfile.mkdtemp(prefix="toolrl-exec-")
        os.chmod(root, 0o711)
        fs.update(scratch=root, private_tmp=False, readonly_root=False, proc_private=False)
        return root
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below leaks back to the host
    if report["namespaces"].get("pidns"):
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        fs["proc_private"] = True
    else:
        fs["proc_private"] = False
    fs["exposed"] = _expose_python()
    covered = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/run/shm", "/dev/mqueue", "/home")
    keep = _open_python_under(covered)  # a checkout (and its .venv) may live in /tmp or /home
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={scratch_mb}m,mode=0711,nr_inodes={max(4096, scratch_mb * 256)}")
    fs["exposed"] += _bind_back(keep, "/tmp")
    fs["scratch"] = "/tmp"
    fs["private_tmp"] = True
    hidden = []
    for d in covered[1:]:
        if os.path.isdir(d) and not os.path.islink(d):
            try:
                mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0755")
                fs["exposed"] += _bind_back(keep, d)
                mount(None, d, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                      "size=64k,mode=0755")
                hidden.append(d)
            except OSError as exc:
                report.setdefault("warnings", []).append(f"could not hide {d}: {exc}")
    for _, fd in keep:
        os.close(fd)
    fs["hidden"] = hidden
    # No pseudo-terminals: /dev/ptmx would allocate in the host's devpts (shared with the host's
    # terminals and its pty limit). /dev/null over it: opening works, making a pty does not.
    for ptmx in ("/dev/ptmx", "/dev/pts/ptmx"):
        if os.path.exists(ptmx):
            try:
                mount("/dev/null", ptmx, None, MS_BIND)
                fs.setdefault("no_pty", []).append(ptmx)
            except OSError as exc:
                report.setdefault("warnings", []).append(f"could not hide {ptmx}: {exc}")
    try:
        keep = _statvfs_flags("/")
        mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep)
        fs["readonly_root"] = True
    except OSError as exc:
        fs["readonly_root"] = False
        report["missing"].append(f"readonly_root: runners may write wherever the slot uid may ({exc})")
    return "/tmp"


def _statvfs_flags(path: str) -> int:
    f = os.statvfs(path).f_flag
    return (MS_NOSUID if f & os.ST_NOSUID else 0) | (MS_NODEV if f & os.ST_NODEV else 0) | \
        (MS_NOEXEC if f & os.ST_NOEXEC else 0)


def _python_paths() -> set[str]:
    paths = {sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))}
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    return {os.path.realpath(p) for p in paths}


def _blocked_ancestor(path: str) -> str | None:
    """The first directory on the way to `path` that other users cannot traverse."""
    cur = "/"
    for part in path.strip("/").split("/"):
        cur = os.path.join(cur, part)
        try:
            if not os.stat(cur).st_mode & 0o001:
                return cur
        except OSError:
            return None
    return None


def _open_python_under(dirs: tuple[str, ...]) -> list[tuple[str, int]]:
    """Python trees inside directories about to be covered by a tmpfs, opened (O_PATH) before the
    cover goes on, so they can be bound back read-only afterwards."""
    keep: list[tuple[str, int]] = []
    for p in sorted(_python_paths()):
        inside = any(p == d or p.startswith(d + "/") for d in dirs)
        if inside and not any(p.startswith(q + "/") for q, _ in keep):
            keep.append((p, os.open(p, os.O_PATH | os.O_DIRECTORY)))
    return keep


def _bind_back(keep: list[tuple[str, int]], under: str) -> list[str]:
    out = []
    for p, fd in keep:
        if p == under or p.startswith(under + "/"):
            _bind_readonly(fd, p)
            out.append(p)
    return out


def _bind_readonly(fd: int, path: str) -> None:
    """Bind the directory open (O_PATH) at `fd` onto `path`, read-only; `path` is made if missing."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _statvfs_flags(path))


def _expose_python() -> list[str]:
    """Python may live under a directory others cannot enter (pyenv under /root). Cover that directory
    with an empty tmpfs and bind back, read-only, only the Python trees: the runners can import the
    standard library and site-packages and see nothing else there."""
    by_ancestor: dict[str, list[str]] = {}
    for p in sorted(_python_paths()):
        anc = _blocked_ancestor(p)
        if anc and anc != p:
            by_ancestor.setdefault(anc, []).append(p)
    exposed = []
    for anc, paths in by_ancestor.items():
        paths = [p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths)]
        fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in paths}
        mount("tmpfs", anc, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for p, fd in fds.items():
            _bind_readonly(fd, p)
            os.close(fd)
            exposed.append(p)
        mount(None, anc, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    return exposed


# ---------------------------------------------------------------------------------------------
# Privilege drop and cgroups (in the PID-1 child)

def probe_uid_drop(uid: int) -> str | None:
    """None when a child can switch to `uid` and can read the Python installation as that uid."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            become(uid)
            code = 4
            with open(os.__file__, "rb"):
                pass
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return {0: None, 3: "setresuid failed (not root in the initial user namespace?)",
            4: f"the Python installation ({os.__file__}) is not readable by an unprivileged uid"}.get(
        code, f"probe exited with {code}")


class Cgroups:
    """cgroup v1 `pids` and `memory` hierarchies: one child group per lane (slot or session).

    A lane's group caps its processes and memory as a whole (a runner cannot multiply its memory by
    forking) and tells exactly whether anything of the lane is still alive (pids.current).
    """

    CONTROLLERS = ("pids", "memory")

    def __init__(self, tag: str):
        self.base: dict[str, str] = {}
        self.mem_limit: dict[str, int] = {}
        mounts = _cgroup_v1_mounts()
        own = _own_cgroups()
        for ctl in self.CONTROLLERS:
            if ctl not in mounts or ctl not in own:
                raise OSError(errno.ENOENT, f"no cgroup v1 '{ctl}' hierarchy")
            base = os.path.join(mounts[ctl], own[ctl].lstrip("/"), tag)
            _remove_stale(os.path.dirname(base))
            os.makedirs(base, exist_ok=True)
            self.base[ctl] = base

    def create(self, lane: str, max_pids: int) -> list[str]:
        """Make the lane's groups; returns the cgroup.procs files a runner writes '0' into to join."""
        procs = []
        for base in self.base.values():
            d = os.path.join(base, lane)
            os.makedirs(d, exist_ok=True)
            procs.append(os.path.join(d, "cgroup.procs"))
        _write(os.path.join(self.base["pids"], lane, "pids.max"), str(max_pids))
        return procs

    def set_total_memory(self, nbytes: int) -> None:
        """Bound all lanes together: the group above them (hierarchical, as v1 always is now)."""
        _write(os.path.join(self.base["memory"], "memory.limit_in_bytes"), str(nbytes))

    def set_memory(self, lane: str, nbytes: int) -> None:
        if self.mem_limit.get(lane) != nbytes:
            _write(os.path.join(self.base["memory"], lane, "memory.limit_in_bytes"), str(nbytes))
            self.mem_limit[lane] = nbytes

    def pids(self, lane: str) -> int:
        with open(os.path.join(self.base["pids"], lane, "pids.current")) as f:
            return int(f.read())

    def procs(self, lane: str) -> list[int]:
        """The lane's processes, as pids of the reader's PID namespace (0: not visible from here)."""
        with open(os.path.join(self.base["pids"], lane, "cgroup.procs")) as f:
            return [p for p in (int(x) for x in f.read().split()) if p > 0]

    def failures(self, lane: str) -> int:
        """How often a charge failed at the lane's own limit (v1 counts a failure on the group whose
        limit refused it: the lane's, or the group's above every lane)."""
        with open(os.path.join(self.base["memory"], lane, "memory.failcnt")) as f:
            return int(f.read())

    def oom_kills(self, lane: str) -> int:
        with open(os.path.join(self.base["memory"], lane, "memory.oom_control")) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def remove_all(self) -> None:
        for base in self.base.values():
            _rmdir_tree(base)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_v1_mounts() -> dict[str, str]:
    found = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = right.split()
            if len(fields) >= 3 and fields[0] == "cgroup":
                for opt in fields[2].split(","):
                    if opt in Cgroups.CONTROLLERS:
                        found[opt] = left.split()[4]
    return found


def _own_cgroups() -> dict[str, str]:
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctls, path = line.rstrip("\n").split(":", 2)
            for ctl in ctls.split(","):
                own[ctl] = path
    return own


def _remove_stale(parent: str) -> None:
    """Remove groups left by an earlier fork server that died (`toolrl-exec-<pid>`, that pid gone).
    Must run where /proc shows host pids, i.e. before the PID namespace's /proc is mounted."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if name.startswith("toolrl-exec-") and not _alive(name.rsplit("-", 1)[-1]):
            _rmdir_tree(os.path.join(parent, name))


def _rmdir_tree(d: str) -> None:
    """A group and its lanes; cgroup dirs are removed with rmdir, and only when empty of tasks."""
    try:
        for sub in os.listdir(d):
            if os.path.isdir(os.path.join(d, sub)):
                try:
                    os.rmdir(os.path.join(d, sub))
                except OSError:
                    pass
        os.rmdir(d)
    except OSError:
        pass


def _alive(pid: str) -> bool:
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")
