"""Run the real executor service as a subprocess: for tests, benchmarks and one-machine demos.

    with LocalExecutor(sets=["executor.workers=2"]) as ex:
        ExecutorClient(ex.url).execute("print(1)")
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from toolrl.executor.client import ExecutorClient

ROOT = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalExecutor:
    def __init__(self, port: int | None = None, sets: list[str] | tuple[str, ...] = (),
                 token: str | None = None, log_path: str | Path | None = None,
                 startup_timeout_s: float = 120.0):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.sets = list(sets) + ([f"executor.token={token}"] if token else [])
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LocalExecutor":
        cmd = [sys.executable, str(ROOT / "executor_service.py"), "--port", str(self.port)]
        for s in self.sets:
            cmd += ["--set", s]
        out = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:  # whatever interrupts the wait (timeout, Ctrl-C), the service we started goes too
            deadline = time.monotonic() + self.startup_timeout_s
            with ExecutorClient(self.url, token=self.token, timeout_s=5, retries=0) as c:
                while time.monotonic() < deadline:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"executor_service.py exited with {self.proc.returncode}: "
                                           f"{self.log_tail()}")
                    if c.health():
                        return self
                    time.sleep(0.1)
            raise TimeoutError(f"executor not healthy after {self.startup_timeout_s} s: {self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def log_tail(self, n: int = 30) -> str:
        if self.log_path and self.log_path.exists():
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return "(no log)"

    def stop(self) -> None:
        """SIGTERM (graceful: the front end stops its fork server), then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> "LocalExecutor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
