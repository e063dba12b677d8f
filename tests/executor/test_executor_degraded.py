"""Missing isolation is loud, never silent: reported in /health, logged, refusable, and the weaker
modes still clean up after every run."""
from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest

from test_executor import check_nothing_carries_over, processes_with_uid, sandbox_pid_ns, wait_for
from toolrl.executor.client import ExecutorClient
from toolrl.executor.local import LocalExecutor

pytestmark = pytest.mark.timeout(120)


def test_a_disabled_layer_is_reported_and_logged(tmp_path):
    log = tmp_path / "executor.log"
    with LocalExecutor(sets=['executor.disable_isolation=["netns"]'], log_path=log) as ex:
        with ExecutorClient(ex.url) as c:
            iso = c._http.get("/health").json()["isolation"]
            assert any(m.startswith("netns:") and "network" in m for m in iso["missing"]), iso["missing"]
            assert c.execute("print(6 * 7)").stdout == "42\n"
    assert "!!! ISOLATION MISSING !!! netns" in log.read_text()


def test_strict_isolation_refuses_to_start(tmp_path):
    log = tmp_path / "executor.log"
    ex = LocalExecutor(sets=['executor.disable_isolation=["netns"]', "executor.strict_isolation=true"],
                       log_path=log, startup_timeout_s=60)
    with pytest.raises(RuntimeError, match="exited"):
        ex.start()
    assert "strict_isolation is set and isolation is missing" in log.read_text()


def test_without_per_slot_uids_runs_are_serial_and_still_swept(tmp_path):
    with LocalExecutor(sets=['executor.disable_isolation=["uid"]', "executor.workers=3"],
                       log_path=tmp_path / "executor.log") as ex:
        with ExecutorClient(ex.url) as c:
            h = c._http.get("/health").json()
            assert h["workers"] == 1 and any(m.startswith("uid:") for m in h["isolation"]["missing"])
            code = ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                    "        os.execvp('sleep', ['sleep', '1000'])\n    os._exit(0)\nos.wait()\n"
                    "import time; time.sleep(0.2)\nprint(os.getuid())")
            r = c.execute(code)
            assert (r.status, r.stdout) == ("ok", "0\n")  # root: the missing layer is real
            ns = sandbox_pid_ns(h["forkserver_pid"])
            # only the manager, its helpers and the waiting spares may remain in the sandbox
            sleepers = wait_for(lambda: [p for p in processes_with_uid(0, 0, pid_ns=ns) if "sleep" in p])
            assert not sleepers
            r = c.execute("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                          timeout_s=1)
            assert r.status == "timeout" and c.health()
            assert c.execute("print('after')").stdout == "after\n"
            # runners that stay root could change a network namespace they share (bring lo up, set
            # sysctls): without uids each run gets a new one, not its lane's
            nets = [c.execute("import os\nprint(os.readlink('/proc/self/ns/net'))").stdout for _ in range(4)]
            assert len(set(nets)) == 4 and all(n.startswith("net:[") for n in nets), nets


def test_without_a_tmpfs_per_lane_cleanup_still_leaves_nothing_and_survives_deep_trees(tmp_path):
    with LocalExecutor(sets=['executor.disable_isolation=["mountns"]', "executor.workers=2"],
                       log_path=tmp_path / "executor.log") as ex:
        with ExecutorClient(ex.url, timeout_s=60) as c:
            check_nothing_carries_over(c)


# A block that replaces the runner's kill helper, then leaves children behind every way it can: plain
# forks, a setsid double fork (re-parented to PID 1), and a process whose main thread has exited while
# another thread runs (a zombie leader: "Z" in /proc, but alive).
LEAVE_CHILDREN = """import ctypes, os, platform, sys, threading, time
sys.modules['toolrl.executor.runner.child']._sweep_own_uid = lambda: None
for _ in range(3):
    if os.fork() == 0:
        time.sleep(1000)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1000)
    os._exit(0)
if os.fork() == 0:
    threading.Thread(target=time.sleep, args=(1000,)).start()
    ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)  # SYS_exit: this thread
x = 42
print('parent done')"""

# A block that keeps a child of its own alive for 1.5 s and checks, at its end, that it still runs.
KEEP_CHILD = """import os, time
pid = os.fork()
if pid == 0:
    time.sleep(1000)
time.sleep(1.5)
print('child alive' if os.waitpid(pid, os.WNOHANG) == (0, 0) else 'child gone')"""


def test_without_cgroups_a_blocks_children_are_killed_at_its_end_and_no_one_elses(tmp_path):
    """No cgroup (every cgroup-v2-only host): the fork server finds a session's other processes by its
    uid in /proc and kills them when a block ends, whatever the block did to the runner's own kill
    helper. Another session's processes, in the middle of its block, and the service's are untouched."""
    with LocalExecutor(sets=['executor.disable_isolation=["cgroup"]', "executor.workers=2"],
                       log_path=tmp_path / "executor.log") as ex, ExecutorClient(ex.url, timeout_s=60) as c:
        h = c._http.get("/health").json()
        assert any(m.startswith("cgroup:") for m in h["isolation"]["missing"]), h["isolation"]
        ns = sandbox_pid_ns(h["forkserver_pid"])
        sessions = lambda: processes_with_uid(*h["uids"]["sessions"], pid_ns=ns)  # noqa: E731
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(c.execute, KEEP_CHILD, session_id="other", timeout_s=10)
            time.sleep(0.5)  # "other" is in its block, its child alive, when this block ends
            r = c.execute(LEAVE_CHILDREN, session_id="helper")
            assert (r.status, r.stdout, r.session_note) == ("ok", "parent done\n", None), r
            assert len(sessions()) == 3, sessions()  # the two runners, and "other"'s child
            r = other.result()
        assert (r.status, r.stdout) == ("ok", "child alive\n"), r
        assert len(sessions()) == 2, sessions()  # each session's runner, waiting for its next block
        r = c.execute("print(x)", session_id="helper")
        assert (r.stdout, r.session_reset) == ("42\n", False), r
        h2 = c._http.get("/health").json()
        assert h2["forkserver_pid"] == h["forkserver_pid"] and h2["restarts"] == h["restarts"], h2
        assert c.execute("print('one-shot')").stdout == "one-shot\n"


HOLD = "x = bytearray({mb} << 20)\nx[::4096] = b'\\1' * (len(x) >> 12)\nprint('held')"  # every page touched


def private_mb(uids: list[int], pid_ns: str) -> float:
    """What the processes with a uid in [lo, hi] hold on their own (private resident pages), from /proc."""
    total = 0
    for line in processes_with_uid(*uids, pid_ns=pid_ns):
        pid = line.split()[1]
        for row in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if row.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(row.split()[1])
    return total / 1024


def test_without_a_memory_cgroup_sessions_are_bounded_by_admission(tmp_path):
    """No memory cgroup: the executor measures what sessions hold and keeps it within the part of
    total_memory_mb that workers x memory_mb (running executions) leaves them, here 650 - 3 x 150 =
    200 MB. The least recently used idle session is evicted and says so; busy sessions and those
    within the bound keep their state; a new session that cannot fit is refused (503), never hung."""
    sets = ['executor.disable_isolation=["cgroup"]', "executor.workers=3", "executor.memory_mb=150",
            "executor.total_memory_mb=650"]
    with LocalExecutor(sets=sets, log_path=tmp_path / "executor.log") as ex, \
            ExecutorClient(ex.url, timeout_s=60, retries=0) as c:
        h = c._http.get("/health").json()
        assert h["memory"]["mode"] == "admission" and h["memory"]["sessions_share_mb"] == 200, h["memory"]
        ns = sandbox_pid_ns(h["forkserver_pid"])
        assert [c.execute(HOLD.format(mb=80), session_id=s).stdout for s in ("s0", "s1")] == ["held\n"] * 2
        for s in ("s0", "s1"):  # both fit: untouched (and s0 is now the least recently used)
            assert c.execute("print(len(x) >> 20)", session_id=s).stdout == "80\n"
        assert c.execute(HOLD.format(mb=80), session_id="s2").stdout == "held\n"  # 3 x 80 MB do not
        for s in ("s1", "s2"):
            r = c.execute("print(len(x) >> 20)", session_id=s)
            assert (r.stdout, r.session_reset, r.executor_fault) == ("80\n", False, False), r
        r = c.execute("print(len(x) >> 20)", session_id="s0")  # the least recently used idle one
        assert r.session_reset and "evicted to bound the executor's memory" in r.session_note, r
        assert "NameError" in r.stderr and r.executor_fault
        held = private_mb(h["uids"]["sessions"], ns)
        assert 160 < held <= 200, held  # s1 and s2 (80 MB each) and a fresh s0, measured by the kernel

        # An execution asking 300 MB takes 150 MB more from the sessions' share while it runs: idle
        # sessions go; s1 is executing and stays. Then a new session cannot fit, and is refused.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            busy = pool.submit(c.execute, "import time\ntime.sleep(4)\nprint(len(x) >> 20)", session_id="s1")
            time.sleep(0.3)
            big = pool.submit(c.execute, "import time\ntime.sleep(2.5)", memory_mb=300)
            assert wait_for(lambda: c._http.get("/health").json()["memory"]["reserved_mb"] != 600, 3) is False
            for s in ("s3", "s2"):  # a new session; an evicted one that would start again
                r = c._http.post("/execute", json={"code": "print(1)", "session_id": s})
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert "no memory for a new session" in r.json()["detail"], r.text
            assert big.result().status == "ok"
            r = busy.result()
            assert (r.status, r.stdout, r.session_reset) == ("ok", "80\n", False), r
        assert c.execute("print('fresh')", session_id="s3").stdout == "fresh\n"  # room again
        r = c.execute("print(len(x) >> 20)", session_id="s2")  # still told why, after the refusal
        assert r.session_reset and "evicted to bound the executor's memory" in r.session_note and r.executor_fault
        memory = lambda: c._http.get("/health").json()["memory"]  # noqa: E731 (reported once a second)
        assert not wait_for(lambda: memory()["evicted"] < 3, 3)
        m = memory()
        assert m["refused"] >= 1 and m["held_mb"] <= m["sessions_share_mb"] == 200, m
