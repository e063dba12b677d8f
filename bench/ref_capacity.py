"""Benchmark: the reference server's capacity. How many uploads, samples and MB of payload per second
one `ref_server.py` accepts, sustained, from C concurrent gen workers while one learner drains it,
at grpo.beta = 0 and beta > 0; and from that, how many gen workers of a stated rate one server can
take (`workers_served`). Not a test.

    .venv/bin/python bench/ref_capacity.py [--clients 1,4,16,64] [--settings beta0,tiny-random]
        [--smollm2] [--shape realistic|demo] [--worker-samples-s 10] [--quick]

What runs, for each setting (a server of its own, all started at once, each idle until its turn):
  server   : `ref_server.py` in a subprocess, `ref_server.flow_control=false`, so that the figures are
             the server's own limits and not the grant policy's (with flow control on, workers start
             groups only while the learner can still use them: in a real run the learner's speed,
             not the server, sets the rate). Settings: `beta0` (grpo.beta = 0: no reference model;
             admission checks, decoding and queueing only; the vocabulary comes from tiny-random's
             config), `tiny-random` (beta 0.04, the 2-layer toy model, reference forward on the CPU),
             and with --smollm2 `smollm2-135m-instruct` in bf16 (beta 0.04, on the CPU: ~520 tok/s on
             an idle 2-core host, bench/ref_server.py, so a window of two groups takes it half a minute
             or more: give it --clients 1,4 --ref-measure-s 120). A 128-sample
             queue (`max_queue_samples`), the default token budget (8192), 1 torch thread.
  uploads  : C simulated gen workers in one child process (asyncio), each with its own
             AsyncRefServerClient, uploading groups back to back (closed loop, no think time: the
             offered load is as high as C clients can make it). Every upload is the real thing:
             encode_samples, POST /upload with an X-Upload-Id, waits and retries as the worker's.
  learner  : one consumer in this process draining `GET /batch` (RefServerClient.get_batch, 64
             samples a batch, decoded) at full speed, as the learner would if its step took no time.
  window   : after a warm-up (2 s) and once the queue is steady (full, or holding at most two
             groups while uploads go on: not still filling, which would count the filling rate), the
             uploads that complete inside a fixed window (6 s; 12 s with a reference model, which
             completes a window of groups at a time, seconds each on a CPU) are counted: uploads/s,
             samples/s, MB/s (bytes of encoded upload bodies), and the latency of each upload (client
             side, encoding included) at p50 and p99. The consumer's delivered samples/s over the
             same window says whether the queue kept up (in steady state they agree). Between client
             counts the learner's version moves past max_staleness, so what a phase left queued or
             waiting is dropped as stale at once and the next phase starts empty.
  where the time goes: the server's CPU time per thread (/proc/PID/task: the event-loop thread,
             which does HTTP, decoding, admission checks, queueing and small-batch encoding; and every
             other thread: the reference compute thread, big-payload codecs), the server's own /stats
             counters over the window (reference compute seconds and tokens, uploads that waited
             for space), the client and consumer processes' CPU, and the machine's CPU busy share.
             Before the runs, single-threaded timings of one group's encode, decode, admission checks
             and a 64-sample batch's encode split the event loop's share.

Capacity: the best sustained samples/s over the client counts, and a ceiling that the busy machine
cannot show: the samples one fully used core would take at the measured event-loop CPU per upload
(the server's loop is one thread). With a reference model the ceiling is the reference's own
tokens/s over its compute time, divided by the tokens per sample.
`workers_served` = floor(sustained samples/s / the rate of one gen worker) (`measured`; `measured_exact`
unrounded; `ceiling` from the ceiling). The default worker rate,
10 samples/s, is an assumption: a 7B model in bf16 under vLLM on one H100 decodes several thousand
tokens/s with large batches (public third-party benchmarks put Llama-3.1-8B at ~12,500 output tok/s
peak on 1 x H100); RL rollouts with tool calls and long tails get less, say 5,000 tok/s, and at ~500
completion tokens a sample that is 10 samples/s (1.25 groups of 8). Pass --worker-samples-s for another.
A 7B reference is not measured here (no GPU, no 7B weights); `estimate_7b_reference_h100` is arithmetic:
2 x 7e9 FLOPs a token, an H100's 989 dense bf16 TFLOP/s at 40% MFU.

On a small shared machine the clients, the consumer and the server compete for the same cores: the
sustained figures are lower bounds on the server, and the CPU split says by how much.

The last line is JSON: `results[setting][clients]` = {uploads_per_s, samples_per_s, mb_per_s,
latency_p50_ms, latency_p99_ms, delivered_samples_per_s, ...}, and `workers_served[setting]`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolrl.protocol import Sample, ToolCall, decode_samples, encode_samples  # noqa: E402
from toolrl.refserver.checks import check_samples  # noqa: E402
from toolrl.refserver.client import AsyncRefServerClient, RefServerClient  # noqa: E402

VOCAB = 49152  # SmolLM2's tokenizer, shared by tiny-random
SETTINGS = {  # name -> (--set overrides for the server)
    "beta0": ["grpo.beta=0.0", "model.name=tiny-random"],
    "tiny-random": ["grpo.beta=0.04", "model.name=tiny-random", "model.dtype=float32"],
    "smollm2-135m-instruct": ["grpo.beta=0.04", "model.name=smollm2-135m-instruct", "model.dtype=bfloat16"],
    # reference replicas (toolrl/refserver/replicas.py): a front that computes nothing itself and K
    # `ref_server.py --replica-of` processes of 1 torch thread each, on this machine
    "tiny-random+1replica": ["grpo.beta=0.04", "model.name=tiny-random", "model.dtype=float32",
                             "ref_server.local_reference=false"],
    "tiny-random+2replicas": ["grpo.beta=0.04", "model.name=tiny-random", "model.dtype=float32",
                              "ref_server.local_reference=false"],
}
REPLICAS = {"tiny-random+1replica": 1, "tiny-random+2replicas": 2}
# Group shapes. realistic: 8 samples sharing a ~300-token prompt, completions of ~500 tokens (300-700)
# with one 40-token tool output (mask 0), ~3 characters of text per completion token, one tool call,
# three rewards. demo: what configs/cpu_demo.yaml's samples look like (runs' samples.jsonl): groups of
# 6 (4 rollouts + 2 teacher traces), ~360-token prompts, completions of 40-350 tokens.
SHAPES = {"realistic": dict(group=8, prompt=(280, 320), completion=(300, 700)),
          "demo": dict(group=6, prompt=(347, 362), completion=(40, 350))}
CLK_TCK = os.sysconf("SC_CLK_TCK")
H100_BF16_TFLOPS = 989  # dense, SXM: NVIDIA's data sheet
ASSUMED_MFU = 0.4  # a prefill-only forward of long, packed batches


def free_ports(n: int, lo: int = 18290, hi: int = 18300) -> list[int]:
    ports = []
    for port in random.sample(range(lo, hi), hi - lo):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports in {lo}-{hi - 1}")


def make_groups(shape: str, n_groups: int, seed: int = 0) -> list[list[Sample]]:
    sh, rng = SHAPES[shape], random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     \n0123456789()=+"
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(*sh["prompt"]))]
        members = []
        for k in range(sh["group"]):
            c = rng.randint(*sh["completion"])
            t0 = rng.randrange(0, max(1, c - 40))
            mask = [0 if t0 <= j < t0 + 40 else 1 for j in range(c)]
            members.append(Sample(
                prompt_ids=prompt, completion_ids=[rng.randrange(VOCAB) for _ in range(c)], loss_mask=mask,
                logprobs=[-rng.random() * 3 if m else None for m in mask], group_id=f"bench-{seed}-{g}",
                rewards={"correct": float(k % 2), "format": 0.2, "tool": 0.2}, reward=float(k % 2) + 0.4,
                advantage=(k % 2) - 0.5, stop_reason="eos", text="".join(rng.choices(letters, k=3 * c)),
                tool_calls=[ToolCall(code="".join(rng.choices(letters, k=200)), status="ok",
                                     output="".join(rng.choices(letters, k=100)))]))
        groups.append(members)
    return groups


# -- the uploading workers: a child process ------------------------------------------------------

async def _phase(url: str, clients: int, groups, sizes, stop) -> dict:
    """C clients upload back to back until `stop` is set; returns every upload (start, end, samples, bytes)."""
    done: list[tuple[float, float, int, int]] = []
    waits = [0]

    async def worker(k: int) -> None:
        async with AsyncRefServerClient(url, timeout_s=120.0, max_wait_s=300.0) as c:
            i = k
            while not stop.is_set():
                g = i % len(groups)
                i += clients
                t0 = time.monotonic()
                await c.upload(groups[g])
                done.append((t0, time.monotonic(), len(groups[g]), sizes[g]))
            waits[0] += c.upload_waits

    await asyncio.gather(*(worker(k) for k in range(clients)))
    return {"uploads": done, "upload_waits": waits[0]}


def uploader_main(conn, stop, shape: str, n_groups: int) -> None:
    groups = make_groups(shape, n_groups)
    sizes = [len(encode_samples(g)) for g in groups]
    conn.send("ready")
    while (job := conn.recv()) is not None:
        url, clients, version = job
        mine = [[s.model_copy(update={"policy_version": version}) for s in g] for g in groups]
        try:
            conn.send(asyncio.run(_phase(url, clients, mine, sizes, stop)))
        except Exception as exc:  # noqa: BLE001 - reported by the parent
            conn.send({"error": f"{type(exc).__name__}: {exc}"})


# -- the server ------------------------------------------------------------------------------

class Server:
    def __init__(self, setting: str, args, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ref_capacity_", suffix=".log", delete=False)
        sets = [*SETTINGS[setting], "ref_server.flow_control=false",
                f"ref_server.max_queue_samples={args.queue_samples}", f"ref_server.token_budget={args.token_budget}",
                "ref_server.device=cpu", "ref_server.batch_wait_s=1"]
        cmd = [sys.executable, str(ROOT / "ref_server.py"), "--port", str(port), "--log-level", "WARNING"]
        for s in sets:
            cmd += ["--set", s]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.replicas = [subprocess.Popen(
            [sys.executable, str(ROOT / "ref_server.py"), "--replica-of", self.url, "--replica-id", f"r{k}",
             "--log-level", "WARNING", *[x for s in sets for x in ("--set", s)]],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env) for k in range(REPLICAS.get(setting, 0))]
        self.closed = False

    def wait_ready(self) -> None:
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ref_server.py exited: {Path(self.log.name).read_text()[-2000:]}")
            if time.time() > deadline:
                self.close()
                raise RuntimeError("ref_server.py did not become healthy in 300 s")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.client = RefServerClient(self.url, timeout_s=60)
        while len(self.client.stats()["reference"].get("replicas", {})) < len(self.replicas):  # all asking
            if time.time() > deadline or any(p.poll() is not None for p in self.replicas):
                self.close()
                raise RuntimeError("the replicas did not start")
            time.sleep(0.2)

    def replicas_cpu(self) -> float:
        return sum(proc_cpu(p.pid) for p in self.replicas)

    def thread_cpu(self) -> tuple[float, float]:
        """(event-loop thread, all other threads) CPU seconds so far. uvicorn runs the loop in the
        main thread, whose tid is the pid."""
        loop = other = 0.0
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            try:
                fields = Path(f"/proc/{self.proc.pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # a thread that ended meanwhile
                continue
            s = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
            if int(tid) == self.proc.pid:
                loop += s
            else:
                other += s
        return loop, other

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if hasattr(self, "client"):
            self.client.close()
        for p in self.replicas:
            p.kill()
            p.wait(10)
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


class Consumer(threading.Thread):
    """Drains GET /batch as fast as it can, recording (time, samples) of every batch."""

    def __init__(self, url: str, beta: bool):
        super().__init__(daemon=True)
        self.client, self.beta = RefServerClient(url, timeout_s=60), beta
        self.got: list[tuple[float, int]] = []
        self.stop, self.error = threading.Event(), None
        self.cpu_s = 0.0

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                batch = self.client.get_batch(max_samples=64, max_tokens=1 << 20, wait_s=0.5)
                if batch:
                    if self.beta and any(s.ref_logprobs is None for s in batch):
                        raise RuntimeError("a batch without ref_logprobs at beta > 0")
                    self.got.append((time.monotonic(), len(batch)))
        except Exception as exc:  # noqa: BLE001 - reported by the parent
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.client.close()


def _thread_cpu(tid: int) -> float:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs so far, from /proc/stat."""
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]  # idle, iowait
    return sum(vals) - idle, sum(vals)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def codec_timings(groups: list[list[Sample]], reps: int = 5) -> dict:
    """Single-threaded ms for one group's encode (client), decode and admission checks (server loop),
    and the encode of a 64-sample batch (server, /batch): medians over `reps`."""
    g = groups[0]
    body = encode_samples(g)
    batch = [s for grp in groups for s in grp][:64]

    def ms(fn) -> float:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return round(statistics.median(ts), 2)
    return {"encode_group_ms": ms(lambda: encode_samples(g)), "decode_group_ms": ms(lambda: decode_samples(body)),
            "checks_group_ms": ms(lambda: check_samples(g, VOCAB, 4096)),
            "encode_batch64_ms": ms(lambda: encode_samples(batch)),
            "decode_batch64_ms": ms(lambda: decode_samples(encode_samples(batch))),
            "group_bytes": len(body), "batch64_samples": len(batch)}


EPOCH = 10  # learner versions between phases, > max_staleness: a phase's leftovers go stale at once


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def run_phase(server: Server, uploader, stop, uploader_pid: int, clients: int, args, beta: bool, epoch: int,
              group: int) -> dict:
    """One client count on one server: warm up, wait for a steady queue, count a window, flush."""
    version = epoch * EPOCH
    server.client.set_version(version)  # an earlier phase's leftovers are stale now
    consumer = Consumer(server.url, beta)
    consumer.start()
    stop.clear()
    uploader.send((server.url, clients, version))
    time.sleep(args.warmup_s)
    # Steady state: the queue full (uploads wait for space: the consumer or the reference is the
    # limit), or holding at most two groups at two polls in a row with uploads accepted in between
    # (the consumer keeps up). Otherwise it is still filling, and uploads would be counted at the
    # filling rate: wait, within bounds.
    settle_by, settled, prev = time.monotonic() + args.settle_s, False, None
    while time.monotonic() < settle_by:
        st = server.client.stats()
        depth, taken_in = st["queue_depth"], st["samples_in"]
        if depth + group > args.queue_samples:
            settled = True
            break
        if prev is not None and depth <= 2 * group and prev[0] <= 2 * group and taken_in > prev[1]:
            settled = True
            break
        prev = (depth, taken_in)
        time.sleep(0.25)

    def snap():
        return (time.monotonic(), server.client.stats(), server.thread_cpu(), machine_busy(),
                consumer_cpu(consumer), proc_cpu(uploader_pid), os.getloadavg()[0], server.replicas_cpu())
    w0, s0, c0, m0, k0, u0, load0, p0 = snap()
    time.sleep(args.ref_measure_s if beta else args.measure_s)
    w1, s1, c1, m1, k1, u1, _, p1 = snap()
    stop.set()
    server.client.set_version(version + EPOCH)  # what is queued or waiting now goes stale: a quick drain
    up = uploader.recv()
    deadline = time.monotonic() + 300
    while server.client.stats()["queue_depth"] > 0 and time.monotonic() < deadline and consumer.is_alive():
        time.sleep(0.1)
    consumer.stop.set()
    consumer.join(30)
    if "error" in up:
        raise RuntimeError(f"uploader: {up['error']}")
    if consumer.error:
        raise RuntimeError(f"consumer: {consumer.error}")

    span = w1 - w0
    inside = [u for u in up["uploads"] if w0 <= u[1] < w1]
    lat = [(u[1] - u[0]) * 1e3 for u in inside]
    n_up, n_samples, n_bytes = len(inside), sum(u[2] for u in inside), sum(u[3] for u in inside)
    delivered = sum(n for t, n in consumer.got if w0 <= t < w1)
    q0, q1, r0, r1 = s0["queue"], s1["queue"], s0["reference"], s1["reference"]
    loop_cpu, other_cpu = c1[0] - c0[0], c1[1] - c0[1]
    ref_s, ref_tok = r1["compute_s_total"] - r0["compute_s_total"], r1["tokens_total"] - r0["tokens_total"]
    return {"uploads_per_s": round(n_up / span, 2), "samples_per_s": round(n_samples / span, 1),
            "mb_per_s": round(n_bytes / span / 1e6, 3),
            "latency_p50_ms": round(pct(lat, 0.5), 1) if lat else None,
            "latency_p99_ms": round(pct(lat, 0.99), 1) if lat else None,
            "delivered_samples_per_s": round(delivered / span, 1),
            "server_loop_cpu": round(loop_cpu / span, 3),  # cores' worth, over the window
            "server_other_threads_cpu": round(other_cpu / span, 3),
            "loop_cpu_ms_per_upload": round(loop_cpu * 1e3 / n_up, 2) if n_up else None,
            "ref_compute_s": round(ref_s, 3), "ref_tokens": ref_tok,
            "ref_tokens_per_compute_s": round(ref_tok / ref_s, 1) if ref_s > 0 else None,
            "uploads_waited_full": q1["waited_full"] - q0["waited_full"],
            "upload_503s_seen": up["upload_waits"], "queue_depth_start_end": [q0["samples"], q1["samples"]],
            "settled": settled, "clients_cpu": round((u1 - u0) / span, 3), "replicas_cpu": round((p1 - p0) / span, 3),
            "consumer_cpu": round((k1 - k0) / span, 3),
            "machine_busy": round((m1[0] - m0[0]) / max(1, m1[1] - m0[1]), 3),
            "loadavg_1m": round(load0, 2), "window_s": round(span, 2), "uploads_counted": n_up}


def consumer_cpu(consumer: Consumer) -> float:
    try:
        return _thread_cpu(consumer.native_id)
    except (OSError, TypeError):
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,4,16,64", help="concurrent uploading workers, comma-separated")
    ap.add_argument("--settings", default="beta0,tiny-random", help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--smollm2", action="store_true", help="add smollm2-135m-instruct (bf16, CPU) to the settings")
    ap.add_argument("--shape", default="realistic", choices=sorted(SHAPES))
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--measure-s", type=float, default=6.0)
    ap.add_argument("--settle-s", type=float, default=20.0,
                    help="after the warm-up, wait at most this long for the queue to stop filling")
    ap.add_argument("--queue-samples", type=int, default=128, help="ref_server.max_queue_samples")
    ap.add_argument("--ref-measure-s", type=float, default=12.0,
                    help="the window with a reference model: it completes a window of groups at a time (seconds each "
                         "on a CPU), so a short window would count too few")
    ap.add_argument("--token-budget", type=int, default=8192, help="ref_server.token_budget (its default)")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads (OMP_NUM_THREADS)")
    ap.add_argument("--worker-samples-s", type=float, default=10.0,
                    help="one gen worker's rate, for workers_served (default: a 7B on one H100, see above)")
    ap.add_argument("--quick", action="store_true",
                    help="smallest setting (a smoke test): 2 clients, 0.5 s warm-up, 1.5 s window (3 s with a "
                         "reference), 64-sample queue, token budget 1024, the demo's shape")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.warmup_s, args.measure_s, args.ref_measure_s = "2", 0.5, 1.5, 3.0
        args.queue_samples, args.token_budget, args.shape = 64, 1024, "demo"
    settings = [s for s in args.settings.split(",") if s]
    if args.smollm2 and "smollm2-135m-instruct" not in settings:
        settings.append("smollm2-135m-instruct")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    clients = [int(c) for c in args.clients.split(",")]
    t_start, load_before = time.monotonic(), os.getloadavg()[0]

    groups = make_groups(args.shape, 64 // SHAPES[args.shape]["group"] + 1)
    codec = codec_timings(groups)
    per_group = len(groups[0])
    tokens_per_sample = statistics.mean(s.num_tokens for g in groups for s in g)
    print(f"shape {args.shape}: groups of {per_group}, ~{tokens_per_sample:.0f} tokens a sample, "
          f"{codec['group_bytes'] / 1e3:.1f} kB a group on the wire; single-threaded: encode "
          f"{codec['encode_group_ms']} ms, decode {codec['decode_group_ms']} ms, checks {codec['checks_group_ms']} "
          f"ms a group; a {codec['batch64_samples']}-sample batch encodes in {codec['encode_batch64_ms']} ms, "
          f"decodes in {codec['decode_batch64_ms']} ms", flush=True)
    print("flow control off (ref_server.flow_control=false): the server's limits, not the grant policy's", flush=True)

    # Every server and the uploader start together (each takes seconds to import torch); a server
    # waiting for its turn is idle (its loops wake once a second).
    servers = {s: Server(s, args, port) for s, port in zip(settings, free_ports(len(settings)))}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    stop = ctx.Event()
    uploader = ctx.Process(target=uploader_main, args=(child, stop, args.shape, 16), daemon=True)
    uploader.start()
    results: dict[str, dict[str, dict]] = {}
    try:
        if not parent.poll(120) or parent.recv() != "ready":
            raise RuntimeError("the uploader process did not start")
        for setting in settings:
            beta, server = setting != "beta0", servers[setting]
            try:
                server.wait_ready()
                warm = argparse.Namespace(**{**vars(args), "warmup_s": 0.2, "measure_s": 0.3, "settle_s": 0.0})
                run_phase(server, parent, stop, uploader.pid, 1, warm, beta, 1, per_group)  # first-use set-up
                results[setting] = {}
                for i, c in enumerate(clients):
                    r = run_phase(server, parent, stop, uploader.pid, c, args, beta, i + 2, per_group)
                    results[setting][str(c)] = r
                    print(f"{setting:>22} C={c:<3} {r['uploads_per_s']:8.2f} uploads/s {r['samples_per_s']:8.1f} "
                          f"samples/s {r['mb_per_s']:7.3f} MB/s  p50 {r['latency_p50_ms']} ms p99 "
                          f"{r['latency_p99_ms']} ms | delivered {r['delivered_samples_per_s']} samples/s | server "
                          f"loop {r['server_loop_cpu']:.2f} + other threads {r['server_other_threads_cpu']:.2f} "
                          f"cores ({r['loop_cpu_ms_per_upload']} ms loop CPU an upload), ref compute "
                          f"{r['ref_compute_s']} s, queue {r['queue_depth_start_end']}"
                          f"{'' if r['settled'] else ' (still filling)'} | replicas {r['replicas_cpu']:.2f}, "
                          f"clients {r['clients_cpu']:.2f}, consumer "
                          f"{r['consumer_cpu']:.2f} cores | machine {100 * r['machine_busy']:.0f}% busy, "
                          f"load {r['loadavg_1m']}", flush=True)
            finally:
                server.close()
    finally:
        for server in servers.values():
            server.close()
        parent.send(None)
        uploader.join(30)
        if uploader.is_alive():
            uploader.kill()

    # Capacity and workers served.
    capacity, served = {}, {}
    for setting, rows in results.items():
        best_c, best = max(rows.items(), key=lambda kv: kv[1]["samples_per_s"])
        cpu_ms = [r["loop_cpu_ms_per_upload"] for r in rows.values() if r["loop_cpu_ms_per_upload"]]
        ceiling = 1e3 / statistics.median(cpu_ms) * per_group if cpu_ms else None  # one core for the loop
        if setting != "beta0":
            ref = [r["ref_tokens_per_compute_s"] for r in rows.values() if r["ref_tokens_per_compute_s"]]
            # each replica computes at the measured rate (tokens per second of its compute)
            ref_ceiling = max(1, REPLICAS.get(setting, 0)) * statistics.median(ref) / tokens_per_sample if ref else None
            ceiling = min(x for x in (ceiling, ref_ceiling) if x is not None) if (ceiling or ref_ceiling) else None
        capacity[setting] = {"samples_per_s": best["samples_per_s"], "at_clients": int(best_c),
                             "ceiling_samples_per_s": round(ceiling, 1) if ceiling else None}
        exact = best["samples_per_s"] / args.worker_samples_s
        served[setting] = {"measured": math.floor(exact), "measured_exact": round(exact, 2),
                           "ceiling": math.floor(ceiling / args.worker_samples_s) if ceiling else None}
        print(f"{setting}: sustained {best['samples_per_s']} samples/s (C={best_c}), ceiling "
              f"{capacity[setting]['ceiling_samples_per_s']} samples/s -> workers of {args.worker_samples_s:g} "
              f"samples/s served: {exact:.2f} measured, {served[setting]['ceiling']} at the ceiling", flush=True)
    # Not measured: a 7B reference on one H100, from FLOPs (a forward pass is ~2 x params FLOPs a token).
    ref_tok_s = H100_BF16_TFLOPS * 1e12 * ASSUMED_MFU / (2 * 7e9)
    est = {"ref_tokens_per_s": round(ref_tok_s), "samples_per_s": round(ref_tok_s / tokens_per_sample, 1),
           "workers": math.floor(ref_tok_s / tokens_per_sample / args.worker_samples_s),
           "assumption": f"2 x 7e9 FLOPs a token, H100 bf16 dense {H100_BF16_TFLOPS} TFLOP/s at {ASSUMED_MFU:.0%} MFU; "
                         "arithmetic, not measured"}
    print(f"estimate, not measured: a 7B reference on one H100 scores ~{est['ref_tokens_per_s']} tok/s = "
          f"{est['samples_per_s']} samples/s -> {est['workers']} workers of {args.worker_samples_s:g} samples/s",
          flush=True)

    summary = {
        "results": {s: {c: {k: r[k] for k in ("uploads_per_s", "samples_per_s", "mb_per_s", "latency_p50_ms",
                                               "latency_p99_ms", "delivered_samples_per_s", "loop_cpu_ms_per_upload",
                                               "server_loop_cpu", "server_other_threads_cpu", "ref_compute_s",
                                               "ref_tokens_per_compute_s", "clients_cpu", "consumer_cpu",
                                               "replicas_cpu", "machine_busy", "settled")}
                        for c, r in rows.items()} for s, rows in results.items()},
        "capacity": capacity, "workers_served": served, "estimate_7b_reference_h100": est,
        "worker_samples_per_s": args.worker_samples_s,
        "worker_rate_assumption": "7B bf16 under vLLM on one H100: ~5,000 generated tok/s in RL rollouts / "
                                  "~500 completion tokens a sample",
        "shape": args.shape, "group": per_group, "tokens_per_sample": round(tokens_per_sample, 1),
        "codec": codec, "flow_control": False, "server_threads": args.threads, "queue_samples": args.queue_samples,
        "warmup_s": args.warmup_s, "measure_s": args.measure_s, "ref_measure_s": args.ref_measure_s,
        "token_budget": args.token_budget, "cpus": os.cpu_count(),
        "loadavg_start_end": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.monotonic() - t_start, 1)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
