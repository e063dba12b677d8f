"""Stand-in gen workers (toolrl.worker.standin: the real receiver, gate and relay, a recording
engine) as real processes on 127.0.0.1, for the weight-sync tests."""
import contextlib
import os
import signal
import time

import httpx

from procs import Proc, free_port
from toolrl.worker.standin import tensor_digest

# How long a worker waits for each next bucket (and to drain, and for a sync) before it gives an
# update up. A silenced worker, woken, ends its half-done update only after this wait, and heal()
# waits for that: 30 s cost the silent-worker test 46 s. Buckets here arrive well under a second apart.
BUCKET_WAIT_S = 10


class Pool:
    """`n` receivers, restarted (or resumed) between tests when a test killed (or stopped) one."""

    def __init__(self, log_dir, n: int, token: str):
        self.log_dir, self.n, self.token = log_dir, n, token
        self.ports = [free_port() for _ in range(n)]
        self.procs: list[Proc | None] = [None] * n
        self.stopped: set[int] = set()

    def worker(self, i: int) -> dict:
        return {"id": f"w{i}", "url": f"http://127.0.0.1:{self.ports[i]}", "policy_version": 0}

    @property
    def workers(self) -> list[dict]:
        return [self.worker(i) for i in range(self.n)]

    def start(self, indices) -> None:
        for i in indices:
            self.procs[i] = Proc(f"w{i}", ["-m", "toolrl.worker.standin", "--id", f"w{i}", "--port", str(self.ports[i]),
                                           "--token", self.token, "--timeout-s", str(BUCKET_WAIT_S)], self.log_dir)
        for i in indices:
            self.procs[i].wait_http(f"{self.worker(i)['url']}/health", timeout_s=180)

    def kill(self, i: int) -> None:
        os.kill(self.procs[i].p.pid, signal.SIGKILL)

    def restart(self, i: int) -> None:
        """The worker comes back empty: it holds no version."""
        self.kill(i)
        self.procs[i].p.wait(30)
        self.procs[i].stop()
        self.start([i])

    def pause(self, i: int) -> None:
        self.stopped.add(i)
        os.kill(self.procs[i].p.pid, signal.SIGSTOP)

    def heal(self) -> None:
        for i in list(self.stopped):
            os.kill(self.procs[i].p.pid, signal.SIGCONT)
        self.stopped.clear()
        dead = [i for i, p in enumerate(self.procs) if p is None or p.p.poll() is not None]
        for i in dead:
            self.procs[i].stop()
        if dead:
            self.start(dead)
        for w in self.workers:  # idle again: no update half-way anywhere (a resumed relay ends by its timeout)
            deadline = time.time() + 60
            while httpx.get(f"{w['url']}/health", timeout=5).json()["update_phase"] is not None:
                assert time.time() < deadline, f"{w['id']} is still in an update"
                time.sleep(0.1)

    def stop(self) -> None:
        self.heal()
        for p in self.procs:
            if p is not None:
                p.stop()


@contextlib.contextmanager
def running(log_dir, n: int, token: str):
    """A Pool of `n` started receivers, stopped at the end however the tests went (a module's fixture)."""
    p = Pool(log_dir, n, token)
    try:
        p.start(range(n))
        yield p
    finally:
        p.stop()


def loaded(w: dict) -> dict:
    """What a stand-in worker holds: version, weights_ok, a digest per tensor, bytes received."""
    return httpx.get(f"{w['url']}/loaded", timeout=10).json()


def assert_exact(workers, named, version) -> None:
    """Every one of `workers` loaded exactly `named` as `version`."""
    want = {n: tensor_digest(t) for n, t in named}
    for w in workers:
        got = loaded(w)
        assert got["version"] == version and got["weights_ok"], (w["id"], got["version"])
        assert got["digests"] == want, f"{w['id']} loaded other weights"
