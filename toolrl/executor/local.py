"""Run the real executor service as a subprocess: for tests, benchmarks and one-machine tools.

    with LocalExecutor(sets=["executor.workers=2"]) as ex:
        ExecutorClient(ex.url).execute("print(1)")
"""
from __future__ import annotations

import contextlib
import secrets
from pathlib import Path

import httpx

from toolrl.config import TOKEN_ENV, Config
from toolrl.net import AUTH_REFUSED, LocalService, auth_headers, free_port


class LocalExecutor(LocalService):
    """`token`: the service requires it (passed in the environment, never on the command line); none,
    and the service requires none, whatever TOOLRL_EXECUTOR_TOKEN says in ours."""

    def __init__(self, port: int | None = None, sets: list[str] | tuple[str, ...] = (),
                 token: str | None = None, log_path: str | Path | None = None,
                 startup_timeout_s: float = 120.0):
        self.port = port or free_port()
        self.sets = list(sets)
        args = ["--port", str(self.port)] + [x for s in self.sets for x in ("--set", s)]
        super().__init__("toolrl.executor", args, f"http://127.0.0.1:{self.port}", token=token,
                         log_path=log_path, startup_timeout_s=startup_timeout_s,
                         env={TOKEN_ENV["executor"]: token})


class ExecutorRefused(RuntimeError):
    """An executor answers at the configured URL but refuses this token."""


@contextlib.contextmanager
def executor_available(cfg: Config, log=print):
    """Use the configured executor; if nothing answers there, run a private one for the duration,
    under a token of its own (nobody else on the machine can run code through it)."""
    try:
        status = httpx.get(f"{cfg.executor.url}/health", headers=auth_headers(cfg.executor.token),
                           timeout=2).status_code
    except httpx.HTTPError:
        status = None
    if status in AUTH_REFUSED:
        raise ExecutorRefused(f"the executor at {cfg.executor.url} refuses "
                              f"{'our token' if cfg.executor.token else 'requests without a token'}: set "
                              f"executor.token or {TOKEN_ENV['executor']} to its token (RUN_DIR/tokens.env)")
    if status in (200, 503):  # 503: its fork server is restarting (clients wait for it)
        yield cfg
        return
    token = secrets.token_urlsafe(24)
    with LocalExecutor(startup_timeout_s=60, token=token) as ex:
        log(f"no executor at {cfg.executor.url}; started a private one at {ex.url}")
        yield cfg.model_copy(update={"executor": cfg.executor.model_copy(update={"url": ex.url, "token": token})})
