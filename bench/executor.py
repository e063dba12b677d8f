"""Executor benchmark (not a test): the real service against a subprocess-per-snippet baseline.

    python bench/executor.py [--port 18170] [--workers N] [--batch 128] [--rounds 2] [--c8-requests 1500]

Starts executor_service.py, then measures, side by side in one run (alternating, because this
machine's speed drifts from minute to minute):
  * trivial `print(1+1)` executions per second through POST /execute_batch;
  * the same through a baseline that starts a fresh `python -c` per snippet, one per core at a time;
  * session blocks per second, as rollouts use them (new session, three blocks, delete);
  * latency of one trivial snippet through POST /execute with 8 concurrent clients: a minimal
    HTTP/1.1 load generator (p99_ms_c8, the service's latency) and AsyncExecutorClient callers
    (p99_ms_c8_async_client, which adds the client's CPU on the same two cores), the client as
    shipped (aiohttp transport) alternating with the same client on httpx's own transport
    (p99_ms_c8_async_client_httpx), each with the caller's CPU per request.
Prints readable lines, then one final JSON line with batch_exec_per_s, ratio_vs_subprocess, p99_ms_c8.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolrl.executor.client import AsyncExecutorClient, ExecutorClient  # noqa: E402
from toolrl.executor.local import LocalExecutor  # noqa: E402
from toolrl.net import free_port  # noqa: E402

SNIPPET = "print(1+1)"


def start_service(port: int, workers: int | None) -> LocalExecutor:
    sets = ["executor.max_queue=1024"] + ([f"executor.workers={workers}"] if workers else [])
    return LocalExecutor(port=port, sets=sets).start()


def bench_batch(url: str, batch: int, total: int) -> float:
    """Executions per second through /execute_batch, two batches in flight (one runs, one is parsed)."""
    n_batches = max(2, total // batch)
    items = [{"code": SNIPPET}] * batch

    def one(_):
        with ExecutorClient(url, timeout_s=300) as c:
            res = c.execute_batch(items)
        bad = [r for r in res if r.status != "ok" or r.stdout != "2\n"]
        if bad:
            raise SystemExit(f"wrong result in the batch benchmark: {bad[0]}")
        return len(res)

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = sum(pool.map(one, range(n_batches)))
    return done / (time.perf_counter() - t)


async def bench_sessions(url: str, rollouts: int, concurrency: int = 8) -> float:
    """What a rollout does: a new session, three dependent blocks, delete. Blocks per second."""
    async with AsyncExecutorClient(url, timeout_s=120) as c:
        sem = asyncio.Semaphore(concurrency)

        async def rollout(i: int):
            async with sem:
                sid = f"bench-{i}"
                await c.execute("x = 6", session_id=sid)
                await c.execute("y = x * 7", session_id=sid)
                r = await c.execute("print(y)", session_id=sid)
                await c.delete_session(sid)
                if r.stdout != "42\n":
                    raise SystemExit(f"wrong session result: {r}")

        t = time.perf_counter()
        await asyncio.gather(*(rollout(i) for i in range(rollouts)))
        return 3 * rollouts / (time.perf_counter() - t)


def bench_subprocess(total: int) -> float:
    """The naive executor: a fresh interpreter per snippet, as many at a time as there are cores."""
    def one(_):
        out = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, timeout=60)
        if out.stdout != "2\n":
            raise SystemExit(f"baseline printed {out.stdout!r}")

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        list(pool.map(one, range(total)))
    return total / (time.perf_counter() - t)


async def bench_latency_raw(port: int, clients: int, requests: int) -> list[float]:
    """Latency through /execute from a minimal HTTP/1.1 keep-alive load generator (like wrk or hey):
    the service's latency, without the ~2 ms of CPU per request that httpx spends on the same cores."""
    body = json.dumps({"code": SNIPPET}).encode()
    head = (f"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    lat: list[float] = []

    async def worker(n: int, record: bool):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(n):
                t = time.perf_counter()
                writer.write(head + body)
                headers = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in headers.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                res = json.loads(await reader.readexactly(length))
                if record:
                    lat.append((time.perf_counter() - t) * 1000)
                if not headers.startswith(b"HTTP/1.1 200") or res["stdout"] != "2\n":
                    raise SystemExit(f"wrong answer in the latency benchmark: {headers[:40]!r} {res}")
        finally:
            writer.close()

    await asyncio.gather(*(worker(10, False) for _ in range(clients)))  # warm connections and spares
    await asyncio.gather(*(worker(requests // clients, True) for _ in range(clients)))
    return lat


async def bench_latency(url: str, clients: int, requests: int, httpx_transport: bool = False
                        ) -> tuple[list[float], float]:
    """Latencies (ms) and the caller's CPU per request (ms) of AsyncExecutorClient callers; with
    `httpx_transport`, the client on httpx's own transport (the baseline of toolrl.net.async_transport)."""
    lat: list[float] = []
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=256, max_keepalive_connections=64)) \
        if httpx_transport else None
    async with AsyncExecutorClient(url, timeout_s=60, transport=transport) as c:
        for _ in range(20):  # warm connections
            await c.execute(SNIPPET)

        async def worker(n: int):
            for _ in range(n):
                t = time.perf_counter()
                r = await c.execute(SNIPPET)
                lat.append((time.perf_counter() - t) * 1000)
                if r.status != "ok" or r.stdout != "2\n":
                    raise SystemExit(f"wrong result in the latency benchmark: {r}")

        cpu0 = time.process_time()
        await asyncio.gather(*(worker(requests // clients) for _ in range(clients)))
        cpu_ms = (time.process_time() - cpu0) * 1000 / len(lat)
    return lat, cpu_ms


_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and all its descendants, including reaped children (cutime/cstime):
    the service's own CPU, whatever else runs on the machine."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                stats[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        todo += [p for p, (ppid, _) in stats.items() if ppid == pid]
    return total / _TICK


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def port_or_free(preferred: int) -> int:
    """`preferred` when it is free now, else any free port."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            return free_port()


def _interrupt(*_):
    raise KeyboardInterrupt  # so `kill` unwinds through the finally that stops the service


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=18170)
    ap.add_argument("--workers", type=int, default=None, help="executor.workers (default: the config's)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--batch-total", type=int, default=1024)
    ap.add_argument("--subprocess-total", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--c8-requests", type=int, default=1600)
    ap.add_argument("--rollouts", type=int, default=100, help="session rollouts (3 blocks each)")
    args = ap.parse_args()

    port = port_or_free(args.port)
    url = f"http://127.0.0.1:{port}"
    service = start_service(port, args.workers)
    try:
        with ExecutorClient(url) as c:
            c.execute_batch([{"code": SNIPPET}] * 64)  # warm-up
            workers = c._http.get("/health").json()["workers"]
        batch_rates, sub_rates, cpu_ms = [], [], []
        for r in range(args.rounds):  # alternate, so drift hits both sides alike
            sub_rates.append(bench_subprocess(args.subprocess_total))
            cpu0 = tree_cpu_s(service.proc.pid)
            batch_rates.append(bench_batch(url, args.batch, args.batch_total))
            n_exec = max(2, args.batch_total // args.batch) * args.batch  # what bench_batch ran
            cpu_ms.append((tree_cpu_s(service.proc.pid) - cpu0) * 1000 / n_exec)
            print(f"round {r + 1}: /execute_batch {batch_rates[-1]:.0f} exec/s   "
                  f"subprocess-per-snippet {sub_rates[-1]:.0f} exec/s", flush=True)
        session_blocks = asyncio.run(bench_sessions(url, args.rollouts))
        lat = asyncio.run(bench_latency_raw(port, 8, args.c8_requests))
        lat_client, lat_httpx, cpu_client, cpu_httpx = [], [], [], []
        for _ in range(2):  # alternate the two transports, so drift hits both alike
            for on_httpx, lats, cpus in ((False, lat_client, cpu_client), (True, lat_httpx, cpu_httpx)):
                got, cpu_req = asyncio.run(bench_latency(url, 8, args.c8_requests // 4, on_httpx))
                lats += got
                cpus.append(cpu_req)
    finally:
        service.stop()
    batch = statistics.median(batch_rates)
    sub = statistics.median(sub_rates)
    p50, p99 = pct(lat, 0.50), pct(lat, 0.99)
    cpu = statistics.median(cpu_ms)
    print(f"batch (median of {args.rounds}): {batch:.0f} exec/s; subprocess baseline {sub:.0f} exec/s; "
          f"ratio {batch / sub:.2f}x")
    print(f"service CPU per batched execution: {cpu:.2f} ms (all its processes) -> at most "
          f"{2000 / cpu:.0f} exec/s on two idle cores; load average now {os.getloadavg()[0]:.1f}")
    print(f"sessions (new session, 3 blocks, delete; 8 at a time, AsyncExecutorClient): "
          f"{session_blocks:.0f} blocks/s")
    print(f"/execute with 8 concurrent clients (raw HTTP load generator), {len(lat)} requests: "
          f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max(lat):.1f} ms")
    for name, lats, cpus in (("AsyncExecutorClient", lat_client, cpu_client),
                             ("AsyncExecutorClient on httpx's own transport", lat_httpx, cpu_httpx)):
        print(f"/execute with 8 concurrent {name} callers, {len(lats)} requests: p50 "
              f"{pct(lats, 0.5):.1f} ms, p99 {pct(lats, 0.99):.1f} ms; caller CPU "
              f"{statistics.mean(cpus):.2f} ms per request")
    print(json.dumps({"batch_exec_per_s": round(batch, 1), "ratio_vs_subprocess": round(batch / sub, 2),
                      "p99_ms_c8": round(p99, 1), "p50_ms_c8": round(p50, 1),
                      "p99_ms_c8_async_client": round(pct(lat_client, 0.99), 1),
                      "p99_ms_c8_async_client_httpx": round(pct(lat_httpx, 0.99), 1),
                      "client_cpu_ms_per_request": round(statistics.mean(cpu_client), 2),
                      "client_cpu_ms_per_request_httpx": round(statistics.mean(cpu_httpx), 2),
                      "service_cpu_ms_per_exec": round(cpu, 2),
                      "session_blocks_per_s": round(session_blocks, 1),
                      "loadavg_1m_end": round(os.getloadavg()[0], 2),
                      "subprocess_exec_per_s": round(sub, 1),
                      "batch_rounds": [round(x, 1) for x in batch_rates],
                      "subprocess_rounds": [round(x, 1) for x in sub_rates], "batch_size": args.batch,
                      "workers": workers, "c8_requests": len(lat)}))


if __name__ == "__main__":
    main()
