"""Missing isolation is loud, never silent: reported in /health, logged, refusable, and the weaker
modes still clean up after every run."""
from __future__ import annotations

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


def test_without_a_tmpfs_per_lane_cleanup_still_leaves_nothing_and_survives_deep_trees(tmp_path):
    with LocalExecutor(sets=['executor.disable_isolation=["mountns"]', "executor.workers=2"],
                       log_path=tmp_path / "executor.log") as ex:
        with ExecutorClient(ex.url, timeout_s=60) as c:
            check_nothing_carries_over(c)
