"""Lanes: where runners run.

A lane is what one runner runs in: its own unprivileged uid, its own working directory (a private
tmpfs owned by that uid, mode 0700, under a root-owned 0711 directory, so other lanes can neither
list nor enter it), and its own cgroups. A one-shot slot is a lane reused run after run (cleaned in
between); a session is a lane that lives as long as the session.
"""
from __future__ import annotations

import os
import secrets

from toolrl.executor.syscalls import CLONE_NEWIPC, CLONE_NEWNET, MS_NODEV, MS_NOSUID, mount, umount


class Lane:
    __slots__ = ("name", "uid", "workdir", "mounted", "procs", "pdeathsig", "unshare", "seccomp")

    def __init__(self, name: str, uid: int | None, workdir: str, mounted: bool, procs: list[str],
                 pdeathsig: bool, unshare: int = 0, seccomp: bool = False):
        self.name, self.uid, self.workdir, self.mounted, self.procs = name, uid, workdir, mounted, procs
        self.pdeathsig = pdeathsig  # no PID namespace: runners must die with their parent themselves
        self.unshare = unshare  # namespaces each runner makes its own (CLONE_* flags)
        self.seccomp = seccomp  # filter the code's syscalls (toolrl.executor.runner.seccomp)

    def for_child(self) -> dict:
        return {"name": self.name, "uid": self.uid, "workdir": self.workdir, "cgroup_procs": self.procs,
                "pdeathsig": self.pdeathsig, "unshare": self.unshare, "seccomp": self.seccomp}


class LaneFactory:
    def __init__(self, scratch: str, report: dict, cgroups, uid_drop: bool, disk_mb: int, max_procs: int):
        self.scratch = scratch
        ns = report["namespaces"]
        self.private_mounts = bool(ns.get("mountns"))
        self.pdeathsig = not ns.get("pidns")
        # Each runner (a one-shot run, or a whole session) gets its own IPC namespace: SysV segments
        # and message queues die with the run instead of outliving it in the slot or crossing into
        # another session. Each lane gets its own network namespace, made once by the zygote and
        # joined by each of the lane's runners (forkserver/zygote.py): abstract unix sockets are
        # seen by the lane alone, and none outlives the processes holding it, which are all dead
        # before the lane runs again. Where the sandbox itself has none of a kind, runners cannot
        # make one either.
        self.unshare = (CLONE_NEWIPC if ns.get("ipcns") else 0) | (CLONE_NEWNET if ns.get("netns") else 0)
        self.seccomp = bool(report.get("seccomp"))
        self.cgroups = cgroups
        self.uid_drop = uid_drop
        self.disk_mb = disk_mb
        self.max_procs = max_procs

    def make(self, name: str, uid: int) -> Lane:
        workdir = os.path.join(self.scratch, secrets.token_hex(8))  # unguessable, and the parent is 0711
        os.mkdir(workdir, 0o700)
        mounted = False
        if self.private_mounts:  # a tmpfs per lane: its own size limit, nothing shared with other lanes
            self._mount(workdir, uid)
            mounted = True
        elif self.uid_drop:
            os.chown(workdir, uid, uid)
        procs = self.cgroups.create(name, self.max_procs) if self.cgroups else []
        return Lane(name, uid if self.uid_drop else None, workdir, mounted, procs, self.pdeathsig, self.unshare,
                    self.seccomp)

    def _mount(self, workdir: str, uid: int) -> None:
        mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
              f"size={self.disk_mb}m,nr_inodes={max(1024, self.disk_mb * 64)},mode=0700,uid={uid},gid={uid}")

    def clean(self, lane: Lane) -> None:
        """Give a slot's lane a working dir that carries nothing forward from the last run: no files,
        no extended attributes, timestamps or modes on the dir itself. With a tmpfs per lane that is
        a fresh tmpfs (O(1) whatever the run left); without, the tree is removed without recursion
        (model code can nest directories thousands deep) and the dir made anew under a new name."""
        if lane.mounted:
            umount(lane.workdir)  # detached: gone from the path even if something still holds it
            self._mount(lane.workdir, lane.uid if lane.uid is not None else 0)
            return
        old = lane.workdir
        if not remove_tree(old):
            raise OSError(f"could not empty {old}")
        lane.workdir = os.path.join(self.scratch, secrets.token_hex(8))
        os.mkdir(lane.workdir, 0o700)
        if self.uid_drop:
            os.chown(lane.workdir, lane.uid, lane.uid)

    def destroy(self, lane: Lane) -> None:
        if lane.mounted:
            umount(lane.workdir)
            try:
                os.rmdir(lane.workdir)
            except OSError:
                pass
        else:
            remove_tree(lane.workdir)


def remove_tree(path: str) -> bool:
    """Remove `path` and everything under it; never raises. Iterative, and by directory fd and entry
    name, so neither depth (no recursion) nor path length (PATH_MAX) can stop it: each directory's
    subdirectories are moved up to `path` itself, then its files unlinked and it removed. True when
    `path` is gone."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        top = os.open(path, flags)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    moved = 0
    try:
        todo = [e.name for e in os.scandir(top) if e.is_dir(follow_symlinks=False)]
        for e in os.scandir(top):
            if not e.is_dir(follow_symlinks=False):
                _unlink(e.name, top)
        while todo:
            name = todo.pop()
            try:
                d = os.open(name, flags, dir_fd=top)
            except OSError:
                continue
            try:
                for e in os.scandir(d):
                    if e.is_dir(follow_symlinks=False):
                        moved += 1
                        flat = f".rm{moved}"
                        try:
                            os.rename(e.name, flat, src_dir_fd=d, dst_dir_fd=top)
                            todo.append(flat)
                        except OSError:
                            pass
                    else:
                        _unlink(e.name, d)
            except OSError:
                pass
            finally:
                os.close(d)
            try:
                os.rmdir(name, dir_fd=top)
            except OSError:
                pass
    except OSError:
        pass
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
