"""Start the real services as subprocesses for tests: free ports, health waits, clean kills."""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from toolrl.net import free_port  # noqa: E402,F401  (tests import it from here)

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def serve(app, port: int | None = None):
    """An ASGI app (a service's create_app) served by uvicorn in a thread on `port` (default: a free
    one): its URL."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


_LIVE: set["Proc"] = set()


def _die_with_parent() -> None:
    # SIGKILL of pytest itself must not leave a service behind (PR_SET_PDEATHSIG = 1).
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def stop_all() -> None:
    """Stop every service still running: at exit, and when pytest is told to terminate."""
    for proc in list(_LIVE):
        proc.stop()


atexit.register(stop_all)


class Proc:
    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.args = args
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=open(self.log, "w"),
                                  stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                  preexec_fn=_die_with_parent)
        _LIVE.add(self)

    def wait_http(self, url: str, timeout_s: float = 300.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.p.returncode}:\n{self.tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy at {url} after {timeout_s}s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        _LIVE.discard(self)
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(timeout=20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait(timeout=10)
