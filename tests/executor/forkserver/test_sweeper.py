"""Killing a lane's other processes by uid (no cgroup): exactly the processes wholly of that uid, and
none the caller knows as its own."""
import ctypes
import os
import platform
import signal
import threading
import time

import pytest

from toolrl.executor.forkserver.sweeper import kill_uid_others

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run processes under other uids")
LANE, OTHER = 2_000_000_000 + os.getpid() % 1000 * 2, 2_000_000_001 + os.getpid() % 1000 * 2


def child(uids: tuple[int, int, int], main_thread_exits: bool = False) -> int:
    """A process that sleeps under (real, effective, saved) uids; with main_thread_exits, only one of
    its threads lives on (/proc shows a zombie leader)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(*uids)
            if main_thread_exits:
                threading.Thread(target=time.sleep, args=(60,)).start()
                ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)  # SYS_exit
            time.sleep(60)
        finally:
            os._exit(0)
    return pid


def killed(pid: int) -> bool:
    """Whether pid died of SIGKILL (reaped here); False while it runs."""
    for _ in range(200):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        time.sleep(0.01)
    return False


def test_kills_every_process_of_the_uid_but_the_known_and_nothing_else():
    runner = child((LANE, LANE, LANE))  # the lane's runner: known to the caller
    leftover = child((LANE, LANE, LANE))
    others = [child((OTHER, OTHER, OTHER)),  # another lane
              child((LANE, 0, 0))]  # root, half-way to the uid: not the lane's
    time.sleep(0.3)  # every child has its uids
    try:
        assert kill_uid_others(LANE, {os.getpid(), runner}) is True
        os.waitid(os.P_PID, leftover, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie
        assert kill_uid_others(LANE, {os.getpid(), runner}) is False  # a zombie is not alive
        assert killed(leftover)
        for pid in (runner, *others):
            assert os.waitpid(pid, os.WNOHANG) == (0, 0), pid  # still running
    finally:
        for pid in (runner, *others):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_process_whose_main_thread_exited_alone_is_alive_and_killed():
    pid = child((LANE, LANE, LANE), main_thread_exits=True)
    time.sleep(0.3)  # /proc shows it as a zombie with 2 threads
    assert kill_uid_others(LANE, {os.getpid()}) is True
    assert killed(pid)
