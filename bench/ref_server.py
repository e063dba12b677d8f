"""Benchmark: reference-logprob throughput through the real ref server vs a bare forward pass, and
the upload->batch queue overhead beyond compute. Not a test.

    .venv/bin/python bench/ref_server.py [--model smollm2-135m-instruct] [--dtype bfloat16] [--samples 16]

One run, side by side, alternating rounds (this machine's speed drifts):
  forward  : in this process, `model(input_ids, attention_mask).logits` over the same samples, packed
             into the same length-sorted batches of at most `token_budget` padded tokens. It runs the
             head at every position, the server only at completion positions: not the same work;
  head at completion : the like-for-like baseline, in this process, in plain torch/transformers:
             the model body, then the head, an fp32 log-softmax at the temperature and the gather at
             completion positions only, `chunk` rows at a time, over the same batches: the server's
             math without its queue, HTTP, encoding and thread;
  server   : `ref_server.py` in a subprocess (same model, dtype, threads, temperature). Groups are uploaded
             through AsyncRefServerClient and pulled with RefServerClient.get_batch until every sample is
             back; tokens/s = real tokens / wall time from the first upload to the last batch.
Then the latency trials: one short sample at a time, upload -> get_batch, minus the compute time the
server reports for it (its window's forward pass): what the queue, HTTP and encoding add.

The last line is JSON with `ratio_vs_head_at_completion` (median over rounds of server/like-for-like
tokens/s), `ratio_vs_forward` (the same against the full-logits forward, kept for the history) and
`queue_latency_ms` (median overhead), plus the rest.
"""
from __future__ import annotations

import argparse
import asyncio
import json
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
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolrl.logprobs import pack_samples  # noqa: E402
from toolrl.models import load_hf_model  # noqa: E402
from toolrl.protocol import Sample  # noqa: E402
from toolrl.refserver.client import AsyncRefServerClient, RefServerClient  # noqa: E402
from toolrl.refserver.reference import plan_batches  # noqa: E402


def free_port(lo: int = 18280, hi: int = 18290) -> int:
    for port in random.sample(range(lo, hi), hi - lo):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in {lo}-{hi - 1}")


def make_groups(n_samples: int, group: int, vocab: int, seed: int = 0) -> list[list[Sample]]:
    """GRPO-like groups: one prompt per group (150-300 tokens), completions of 40-400 tokens."""
    rng = random.Random(seed)
    groups = []
    for g in range(0, n_samples, group):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(150, 300))]
        members = []
        for k in range(min(group, n_samples - g)):
            c = rng.randint(40, 400)
            mask = [0 if 10 <= j < 20 else 1 for j in range(c)]  # a tool-output span
            members.append(Sample(prompt_ids=prompt, completion_ids=[rng.randrange(vocab) for _ in range(c)],
                                  loss_mask=mask, logprobs=[-1.0 if m else None for m in mask],
                                  group_id=f"g{g}", policy_version=0, reward=float(k % 2), advantage=0.5))
        groups.append(members)
    return groups


def bare_forward(model, samples: list[Sample], token_budget: int) -> float:
    """Seconds for plain forward passes over `samples` in length-sorted batches (the server's packing)."""
    batches = plan_batches([s.num_tokens for s in samples], token_budget)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in batches:
            packed = pack_samples([samples[i] for i in b])
            model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits  # noqa: B018
    return time.perf_counter() - t0


def completion_forward(model, samples: list[Sample], token_budget: int, chunk_rows: int, temperature: float,
                       pad_id: int) -> tuple[float, list[list[float]]]:
    """Seconds for the server's math done plainly, and each sample's completion logprobs: the body's hidden
    states, then head + fp32 log-softmax + gather only where a completion token is predicted. Plain torch
    on purpose (no toolrl code beyond the batch plan, which fixes the shapes the server runs)."""
    batches = plan_batches([s.num_tokens for s in samples], token_budget)
    body, head = model.get_decoder(), model.get_output_embeddings()
    out: list[list[float]] = [[] for _ in samples]
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in batches:
            rows = [list(samples[i].prompt_ids) + list(samples[i].completion_ids) for i in b]
            T = max(map(len, rows))
            ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
            attn = torch.zeros((len(rows), T), dtype=torch.long)
            for r, row in enumerate(rows):
                ids[r, :len(row)] = torch.tensor(row)
                attn[r, :len(row)] = 1
            hidden = body(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
            # completion token j of a row is predicted by the hidden state at prompt_len + j - 1
            r_idx, c_idx, lens = [], [], []
            for r, i in enumerate(b):
                p, c = len(samples[i].prompt_ids), len(samples[i].completion_ids)
                r_idx += [r] * c
                c_idx += range(p - 1, p + c - 1)
                lens.append(c)
            r_idx, c_idx = torch.tensor(r_idx), torch.tensor(c_idx)
            h, tgt = hidden[r_idx, c_idx], ids[r_idx, c_idx + 1]
            lp = []
            for k in range(0, h.shape[0], chunk_rows):
                logits = head(h[k:k + chunk_rows]).float()
                if temperature != 1.0:  # as the server: no division at 1
                    logits = logits / temperature
                lp.append(logits.gather(-1, tgt[k:k + chunk_rows, None]).squeeze(-1) - logits.logsumexp(-1))
            for i, vals in zip(b, torch.cat(lp).split(lens)):
                out[i] = vals.tolist()
    return time.perf_counter() - t0, out


class Server:
    def __init__(self, args, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ref_server_bench_", suffix=".log", delete=False)
        cmd = [sys.executable, str(ROOT / "ref_server.py"), "--port", str(port), "--log-level", "WARNING",
               "--set", f"model.name={args.model}", "--set", f"model.dtype={args.dtype}",
               "--set", "grpo.beta=0.04", "--set", f"ref_server.token_budget={args.token_budget}",
               "--set", f"rollout.temperature={args.temperature}",
               "--set", f"ref_server.logprob_chunk={args.chunk}", "--set", "ref_server.max_queue_samples=4096"]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}  # the same threads as the bare forward
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ref_server.py exited: {Path(self.log.name).read_text()[-2000:]}")
            if time.time() > deadline:
                self.proc.kill()
                self.proc.wait(10)
                raise RuntimeError("ref_server.py did not become healthy in 300 s")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.loop = asyncio.new_event_loop()
        self.aclient = AsyncRefServerClient(self.url)
        self.client = RefServerClient(self.url, timeout_s=120)

    def upload(self, group: list[Sample]) -> None:
        self.loop.run_until_complete(self.aclient.upload(group))

    def roundtrip(self, groups: list[list[Sample]]) -> tuple[float, list[Sample]]:
        """Wall seconds from the first upload to the last sample back, and the samples back."""
        n = sum(len(g) for g in groups)
        got: list[Sample] = []
        t0 = time.perf_counter()
        uploader = threading.Thread(target=lambda: [self.upload(g) for g in groups])
        uploader.start()
        deadline = t0 + 3600
        while len(got) < n:
            batch = self.client.get_batch(max_samples=64, max_tokens=1 << 20, wait_s=60)
            if batch is None and time.perf_counter() > deadline:
                raise RuntimeError("the server returned nothing for an hour")
            got.extend(batch or [])
        dt = time.perf_counter() - t0
        uploader.join()
        assert all(s.ref_logprobs is not None for s in got)
        return dt, got

    def close(self) -> None:
        self.loop.run_until_complete(self.aclient.aclose())
        self.loop.close()
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--latency-trials", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=1.0, help="the server's rollout.temperature, both sides")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch threads on both sides (1 is steadier on a shared, oversubscribed machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]

    model = load_hf_model(args.model, dtype=args.dtype)
    groups = make_groups(args.samples, args.group, int(model.config.vocab_size))
    samples = [s for g in groups for s in g]
    tokens = sum(s.num_tokens for s in samples)
    completion = sum(len(s.completion_ids) for s in samples)
    print(f"model {args.model} ({args.dtype}), torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{len(samples)} samples in groups of {args.group}: {tokens} tokens ({completion} completion); "
          f"token budget {args.token_budget}, logprob chunk {args.chunk}", flush=True)

    server = Server(args, free_port())
    try:
        warm = [[s.model_copy(update={"prompt_ids": s.prompt_ids[:32], "completion_ids": s.completion_ids[:16],
                                      "loss_mask": s.loss_mask[:16], "logprobs": s.logprobs[:16]})
                 for s in groups[0][:2]]]
        server.roundtrip(warm)  # first forward pays one-time set-up on both sides
        bare_forward(model, [s for g in warm for s in g], args.token_budget)
        pad_id = int(getattr(model.config, "pad_token_id", None) or 0)  # the server's padding

        def plain_lp(xs):
            return completion_forward(model, xs, args.token_budget, args.chunk, args.temperature, pad_id)
        plain_lp([s for g in warm for s in g])
        fwd_tps, cmp_tps, srv_tps, ratios, cmp_ratios, diffs = [], [], [], [], [], []
        for r in range(args.rounds):
            f = tokens / bare_forward(model, samples, args.token_budget)
            dt, mine = plain_lp(samples)
            c = tokens / dt
            dt, got = server.roundtrip(groups)
            s = tokens / dt
            # the same numbers, or the baseline is not the server's work (batches differ: bf16 rounding)
            theirs = {(x.group_id, tuple(x.completion_ids)): x.ref_logprobs for x in got}
            diffs.append(max(abs(a - b) for x, lp in zip(samples, mine)
                             for a, b in zip(lp, theirs[(x.group_id, tuple(x.completion_ids))])))
            fwd_tps.append(f)
            cmp_tps.append(c)
            srv_tps.append(s)
            ratios.append(s / f)
            cmp_ratios.append(s / c)
            print(f"round {r + 1}: full-logits forward {f:8.1f} tok/s | head at completion {c:8.1f} tok/s | "
                  f"ref server {s:8.1f} tok/s | ratio {s / c:.3f} like-for-like, {s / f:.3f} vs full logits | "
                  f"max |logprob diff| {diffs[-1]:.2e}", flush=True)

        overheads, computes, rtts, inside = [], [], [], []
        rng = random.Random(7)
        for i in range(args.latency_trials):
            ids = [rng.randrange(1000, 40000) for _ in range(48)]
            s = Sample(prompt_ids=ids[:32], completion_ids=ids[32:], loss_mask=[1] * 16, logprobs=[-1.0] * 16,
                       group_id=f"lat{i}")
            t0 = time.perf_counter()
            server.upload([s])
            (back,) = server.client.get_batch(max_samples=1, max_tokens=1 << 20, wait_s=30)
            rtt = time.perf_counter() - t0
            compute = server.client.last_batch_meta["compute_s"][0]
            inside.append(server.client.last_batch_meta["queue_s"][0] - compute)  # server-side only, no HTTP
            rtts.append(rtt)
            computes.append(compute)
            overheads.append(rtt - compute)
        stats = server.client.stats()
    finally:
        server.close()

    ov = sorted(overheads)
    p50, p90 = statistics.median(ov) * 1e3, ov[min(len(ov) - 1, int(0.9 * len(ov)))] * 1e3
    print(f"queue latency over {len(ov)} trials (48-token sample): round trip median "
          f"{statistics.median(rtts) * 1e3:.1f} ms, compute median {statistics.median(computes) * 1e3:.1f} ms, "
          f"overhead median {p50:.1f} ms, p90 {p90:.1f} ms, max {ov[-1] * 1e3:.1f} ms; of which inside the "
          f"server (upload accepted -> batch taken, minus compute) median {statistics.median(inside) * 1e3:.1f} ms",
          flush=True)
    print(f"server-side: reference {stats['reference']['tokens_per_s']:.1f} tok/s over compute time, padding "
          f"{100 * stats['reference']['padding_fraction']:.1f}% of batch slots", flush=True)
    result = {"ratio_vs_head_at_completion": round(statistics.median(cmp_ratios), 3) if cmp_ratios else None,
              "ratio_vs_forward": round(statistics.median(ratios), 3) if ratios else None,
              "queue_latency_ms": round(p50, 2),
              "queue_latency_p90_ms": round(p90, 2), "queue_latency_max_ms": round(ov[-1] * 1e3, 2),
              "queue_latency_server_side_ms": round(statistics.median(inside) * 1e3, 2),
              "forward_tok_s": [round(x, 1) for x in fwd_tps],
              "head_at_completion_tok_s": [round(x, 1) for x in cmp_tps],
              "server_tok_s": [round(x, 1) for x in srv_tps], "ratios": [round(x, 3) for x in ratios],
              "ratios_head_at_completion": [round(x, 3) for x in cmp_ratios],
              "logprob_max_abs_diff": float(f"{max(diffs):.3g}") if diffs else None, "temperature": args.temperature,
              "model": args.model, "dtype": args.dtype,
              "samples": len(samples), "tokens": tokens, "completion_tokens": completion,
              "token_budget": args.token_budget, "logprob_chunk": args.chunk,
              "padding_fraction": stats["reference"]["padding_fraction"], "threads": args.threads,
              "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "cpus": os.cpu_count()}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
