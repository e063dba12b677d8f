"""A terminated test run (CI's timeout sends SIGTERM) still stops the services it started: each
runs in its own process group, which pytest's default SIGTERM death would leave running."""
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from procs import stop_all  # noqa: E402

# Under `make test`'s two pytest processes (pytest-xdist) each runs torch on one thread: with
# torch's default of one thread per core in both, their spinning OpenMP threads fought over the two
# cores and a learner test ran 5-20x slower than alone (tests/learner/test_trainer.py: 427 s ->
# 94 s in the suite, 2026-11-28). Only this process: the services a test starts keep their own
# thread settings, which tests check.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


def _terminate(signum, frame):
    stop_all()
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _terminate)
signal.signal(signal.SIGHUP, _terminate)

# `make test`'s order across its two processes (--dist loadfile). xdist's default hands out the
# files with the most tests first, so the three whole-system files (one to three tests, 3-7 minutes
# each) came last, together, and one process idled at the end (183-195 s of the 22-24 minutes).
# Instead: those three are one unit, on one process one after the other (beside each other they
# starved: the launch fixture took 341 s against 82-115 s alone), and the costliest units go first
# (measured per file in the suite, 2026-11-28), the rest in collection order.
WHOLE_SYSTEM = ("tests/test_launch.py", "tests/test_failures.py", "tests/test_launch_faults.py")
COSTLIEST_FIRST = WHOLE_SYSTEM + (
    "tests/worker/test_gen_worker.py", "tests/worker/test_chat.py", "tests/tasks/code/test_teacher_traces.py",
    "tests/weightsync/test_fanout_tree.py", "tests/learner/test_trainer.py", "tests/worker/test_rollout_only.py",
    "tests/worker/test_evaluate.py")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {f: i for i, f in enumerate(COSTLIEST_FIRST)}
        items.sort(key=lambda it: rank.get(it.nodeid.split("::", 1)[0], len(rank)))  # stable: in-file order kept


try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # pytest without pytest-xdist: one process, nothing to schedule
    LoadFileScheduling = None

if LoadFileScheduling is not None:
    class WholeSystemTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "whole-system" if file in WHOLE_SYSTEM else file

    def pytest_xdist_make_scheduler(config, log):
        if config.getoption("dist") != "loadfile":
            return None
        config.option.loadscopereorder = False  # the collection's order, set above
        return WholeSystemTogether(config, log)
