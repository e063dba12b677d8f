"""Run the real executor service as a subprocess: for tests, benchmarks and one-machine tools.

    with LocalExecutor(sets=["executor.workers=2"]) as ex:
        ExecutorClient(ex.url).execute("print(1)")
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import httpx

from toolrl.config import Config
from toolrl.net import LocalService, free_port


class LocalExecutor(LocalService):
    def __init__(self, port: int | None = None, sets: list[str] | tuple[str, ...] = (),
                 token: str | None = None, log_path: str | Path | None = None,
                 startup_timeout_s: float = 120.0):
        self.port = port or free_port()
        self.sets = list(sets) + ([f"executor.token={token}"] if token else [])
        args = ["--port", str(self.port)] + [x for s in self.sets for x in ("--set", s)]
        super().__init__("toolrl.executor", args, f"http://127.0.0.1:{self.port}", token=token,
                         log_path=log_path, startup_timeout_s=startup_timeout_s)


@contextlib.contextmanager
def executor_available(cfg: Config, log=print):
    """Use the configured executor; if nothing answers there, run a private one for the duration."""
    try:
        if httpx.get(f"{cfg.executor.url}/health", timeout=2).status_code == 200:
            yield cfg
            return
    except httpx.HTTPError:
        pass
    with LocalExecutor(startup_timeout_s=60) as ex:
        log(f"no executor at {cfg.executor.url}; started a private one at {ex.url}")
        yield cfg.model_copy(update={"executor": cfg.executor.model_copy(update={"url": ex.url})})
