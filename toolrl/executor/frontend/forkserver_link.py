"""The front end's handle on the fork server: start it, admit work, match results, restart it if it dies.

The front end never forks runners itself (it is multi-threaded under uvicorn); it talks to the fork
server over one Unix socket. Admission is bounded (`max_queue` executions queued or running): beyond
that `run` raises QueueFull at once, so memory never grows with offered load.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import subprocess
import sys

import toolrl
from toolrl.config import ExecutorConfig
from toolrl.executor import ipc

log = logging.getLogger("toolrl.executor")

HELLO_TIMEOUT_S = 120.0


class ForkServerDown(RuntimeError):
    """The fork server is not running (starting, or restarting after a crash)."""


class QueueFull(RuntimeError):
    def __init__(self, msg: str, retry_after: int):
        super().__init__(msg)
        self.retry_after = retry_after


class ForkServerLink:
    def __init__(self, cfg: ExecutorConfig, on_restart=None):
        self.cfg = cfg
        self.on_restart = on_restart  # called when a new fork server replaces a dead one
        self.proc: subprocess.Popen | None = None
        self.hello: dict = {}
        self.memory: dict = {}  # how the total memory is bounded; in admission mode updated once a second
        self.ready = False
        self.stopping = False
        self.admitted = 0
        self.restarts = 0
        self._ids = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._avg_s = 0.01  # moving average of one execution's wall time, for Retry-After

    # -- life cycle ------------------------------------------------------------------------------
    async def start(self) -> dict:
        parent, child = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.abspath(toolrl.__file__)))
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONPATH": root,
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "NUMEXPR_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               # symbols resolved once at load, in the zygotes, not lazily again in every runner
               # (each lazy lookup writes the GOT: a copy-on-write fault; ~0.25 ms a run measured)
               "LD_BIND_NOW": "1"}  # nothing of ours (tokens, keys) gets in
        # cwd: `-m` puts it on sys.path, and the sandbox can read what is on sys.path; the service's
        # own cwd (a home or /tmp directory, say) must not be, so it is the package's root, already there
        self.proc = subprocess.Popen([sys.executable, "-m", "toolrl.executor.forkserver", str(child.fileno())],
                                     pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, close_fds=True, cwd=root)
        child.close()
        parent.sendall(ipc.pack(self._fork_config()))
        reader, self._writer = await asyncio.open_connection(sock=parent, limit=ipc.MAX_FRAME)
        try:
            hello = await asyncio.wait_for(ipc.read_frame_async(reader), HELLO_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ipc.FrameError) as exc:
            self._kill_proc()
            raise ForkServerDown(f"the fork server did not start (exit code {self.proc.poll()}): "
                              f"{exc!r}") from None
        if hello.get("op") != "hello":
            self._kill_proc()
            raise ForkServerDown(f"unexpected first message from the fork server: {hello!r}")
        self.hello = hello
        self.memory = dict(hello["isolation"].get("memory", {}))
        self.ready = True
        self._reader_task = asyncio.create_task(self._read_loop(reader))
        return hello

    def _fork_config(self) -> dict:
        c = self.cfg
        return {"workers": c.workers, "max_queue": c.max_queue, "max_sessions": c.max_sessions,
                "uid_base": c.uid_base, "preimport": list(c.preimport),
                "heavy_modules": list(c.heavy_modules),
                "disabled": list(c.disable_isolation),
                "max_output_bytes": c.max_output_bytes, "output_kill_bytes": c.output_kill_bytes,
                "total_memory_bytes": (c.total_memory_mb << 20) if c.total_memory_mb else None,
                "memory_mb": c.memory_mb,
                "limits": {"fsize": c.max_file_mb << 20, "nofile": c.max_open_files, "nproc": c.max_procs,
                           "disk_mb": c.scratch_mb}}

    async def stop(self) -> None:
        self.stopping = True
        self.ready = False
        if self._writer is not None:
            try:
                self._writer.write(ipc.pack({"op": "stop"}))
                await asyncio.wait_for(self._writer.drain(), 2)
            except (OSError, asyncio.TimeoutError, ConnectionError):
                pass
        if self.proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 5)
            except asyncio.TimeoutError:
                self._kill_proc()
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._fail_all("the executor is shutting down")

    def _kill_proc(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # its PID-1 child has PDEATHSIG: the whole sandbox namespace goes with it
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                log.error("fork server %d did not exit after SIGKILL", self.proc.pid)

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg = await ipc.read_frame_async(reader)
                if msg.get("op") == "results":
                    for item in msg["items"]:
                        fut = self._pending.pop(item["id"], None)
                        if fut is not None and not fut.done():
                            fut.set_result(item)
                        self._avg_s = 0.95 * self._avg_s + 0.05 * item["result"]["wall_ms"] / 1000
                elif msg.get("op") == "memory":
                    self.memory = msg["memory"]
        except (asyncio.IncompleteReadError, ConnectionError, ipc.FrameError, OSError) as exc:
            if not self.stopping:
                log.error("lost the fork server (%r, exit code %s)", exc,
                          self.proc.poll() if self.proc else None)
        except asyncio.CancelledError:
            return
        self.ready = False
        self._fail_all("the fork server stopped")
        if not self.stopping:
            asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        self._kill_proc()
        delay = 0.5
        while not self.stopping:
            try:
                await self.start()
                self.restarts += 1
                log.warning("fork server restarted (%d restarts so far)", self.restarts)
                if self.on_restart:
                    self.on_restart()
                return
            except (ForkServerDown, OSError) as exc:
                log.error("fork server restart failed: %s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(30.0, delay * 2)

    def _fail_all(self, why: str) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ForkServerDown(why))

    def memory_status(self) -> dict:
        """How the executor's total memory is bounded and what is held: in admission mode as the fork
        server last reported it; in cgroup mode the group's usage, read now (nothing per execution)."""
        status = dict(self.memory)
        if status.get("mode") == "cgroup":
            try:
                with open(os.path.join(status["cgroup"], "memory.usage_in_bytes")) as f:
                    status["held_mb"] = round(int(f.read()) / (1 << 20))
            except (OSError, ValueError):
                pass
        return status

    # -- work ------------------------------------------------------------------------------------
    def retry_after(self) -> int:
        return max(1, min(30, math.ceil(self.admitted * self._avg_s / max(1, self.cfg.workers))))

    def admit(self, n: int) -> None:
        """Reserve room for n executions, or raise at once."""
        if not self.ready:
            raise ForkServerDown("the fork server is starting or restarting")
        if self.admitted + n > self.cfg.max_queue:
            raise QueueFull(f"the executor queue is full ({self.admitted} of {self.cfg.max_queue} admitted)",
                            self.retry_after())
        self.admitted += n

    def release(self, n: int) -> None:
        self.admitted -= n

    async def run(self, jobs: list[dict]) -> list[dict]:
        """Send admitted jobs (`admit` first) and wait for every result, in order.

        Each result is {"result": ExecResult fields, "reset": str|None, "lost": str|None}."""
        loop = asyncio.get_running_loop()
        futs = []
        for job in jobs:
            self._ids += 1
            job["id"] = self._ids
            fut = loop.create_future()
            self._pending[self._ids] = fut
            futs.append(fut)
        try:
            if not self.ready or self._writer is None:
                raise ForkServerDown("the fork server is not running")
            self._writer.write(ipc.pack({"op": "run", "jobs": jobs}))
            await asyncio.wait_for(self._writer.drain(), 30)
            done, not_done = await asyncio.wait(futs, timeout=self.cfg.max_wait_s)
            if not_done:
                raise asyncio.TimeoutError(f"no result within executor.max_wait_s={self.cfg.max_wait_s:g} s")
            return [f.result() for f in futs]
        finally:
            # timed out, or cancelled (the client went away): withdraw what has no result yet, or it
            # would run for nobody while its queue slot counts as free again
            if unfinished := [job["id"] for job, fut in zip(jobs, futs) if not fut.done()]:
                self.send({"op": "cancel", "ids": unfinished})
            for job, fut in zip(jobs, futs):
                self._pending.pop(job["id"], None)
                if not fut.done():
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()  # retrieved: no "exception never retrieved" noise

    def send(self, msg: dict) -> None:
        if self.ready and self._writer is not None:
            try:
                self._writer.write(ipc.pack(msg))
            except (OSError, ConnectionError) as exc:
                log.warning("could not send %s to the fork server: %s", msg.get("op"), exc)
