"""A terminated test run (CI's timeout sends SIGTERM) still stops the services it started: each
runs in its own process group, which pytest's default SIGTERM death would leave running."""
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from procs import stop_all  # noqa: E402


def _terminate(signum, frame):
    stop_all()
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _terminate)
signal.signal(signal.SIGHUP, _terminate)
