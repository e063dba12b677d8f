"""Lanes: where runners run.

A lane is what one runner runs in: its own unprivileged uid, its own working directory (a private
tmpfs owned by that uid, mode 0700, under a root-owned 0711 directory, so other lanes can neither
list nor enter it), and its own cgroups. A one-shot slot is a lane reused run after run (cleaned in
between); a session is a lane that lives as long as the session.
"""
from __future__ import annotations

import os
import secrets
import shutil

from toolrl.executor.syscalls import MS_NODEV, MS_NOSUID, mount, umount


class Lane:
    __slots__ = ("name", "uid", "workdir", "mounted", "procs", "pdeathsig")

    def __init__(self, name: str, uid: int | None, workdir: str, mounted: bool, procs: list[str],
                 pdeathsig: bool):
        self.name, self.uid, self.workdir, self.mounted, self.procs = name, uid, workdir, mounted, procs
        self.pdeathsig = pdeathsig  # no PID namespace: runners must die with their parent themselves

    def for_child(self) -> dict:
        return {"uid": self.uid, "workdir": self.workdir, "cgroup_procs": self.procs,
                "pdeathsig": self.pdeathsig}


class LaneFactory:
    def __init__(self, scratch: str, report: dict, cgroups, uid_drop: bool, disk_mb: int, max_procs: int):
        self.scratch = scratch
        self.private_mounts = bool(report["namespaces"].get("mountns"))
        self.pdeathsig = not report["namespaces"].get("pidns")
        self.cgroups = cgroups
        self.uid_drop = uid_drop
        self.disk_mb = disk_mb
        self.max_procs = max_procs

    def make(self, name: str, uid: int) -> Lane:
        workdir = os.path.join(self.scratch, secrets.token_hex(8))  # unguessable, and the parent is 0711
        os.mkdir(workdir, 0o700)
        mounted = False
        if self.private_mounts:  # a tmpfs per lane: its own size limit, nothing shared with other lanes
            mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
                  f"size={self.disk_mb}m,nr_inodes={max(1024, self.disk_mb * 64)},mode=0700,"
                  f"uid={uid},gid={uid}")
            mounted = True
        elif self.uid_drop:
            os.chown(workdir, uid, uid)
        procs = self.cgroups.create(name, self.max_procs) if self.cgroups else []
        return Lane(name, uid if self.uid_drop else None, workdir, mounted, procs, self.pdeathsig)

    def clean(self, lane: Lane) -> None:
        """Empty the working dir between runs; cheap when the run wrote nothing (one getdents)."""
        with os.scandir(lane.workdir) as it:
            entries = list(it)
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path)
                else:
                    os.unlink(e.path)
            except FileNotFoundError:
                pass
        st = os.lstat(lane.workdir)
        if st.st_mode & 0o7777 != 0o700:  # the owner may have chmod-ed its own dir
            os.chmod(lane.workdir, 0o700)
        if lane.uid is not None and (st.st_uid, st.st_gid) != (lane.uid, lane.uid):
            os.chown(lane.workdir, lane.uid, lane.uid)

    def destroy(self, lane: Lane) -> None:
        if lane.mounted:
            umount(lane.workdir)
        else:
            shutil.rmtree(lane.workdir, ignore_errors=True)
        try:
            os.rmdir(lane.workdir)
        except OSError:
            pass
