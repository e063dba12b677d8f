"""Weight updates under load: interrupting the rollouts in flight against draining them.

    python bench/interrupt.py [--pushes 6] [--gap-s 8] [--repeats 1] [--model smollm2-135m-instruct]

A real gen worker (vLLM on this CPU, the tool loop, the executor, a reference server) generates
without pause (flow control off and a deep queue, so it always has rollouts in flight, as a worker
behind a fast learner does) and takes `--pushes` full HTTP weight updates, `--gap-s` apart, from
this process acting as the learner; after each, the version is announced to the reference server
as the learner does. The same run twice, alternating: `rollout.interruptible: true` (the update
aborts the generation requests in flight, loads, and they go on under the new weights) and `false`
(the update waits for every rollout in flight to finish on the old weights). The same config,
seeds, weights and push schedule on both sides.

Per side: the push time the learner waits (median and max; what a synchronous learner step pays),
the worker's drain (time held back by rollouts in flight), requests interrupted, and over the whole
window generated tokens/s, samples uploaded, and samples holding tokens of two versions.

Last line: JSON with push_s_median per side, push_ratio (drain / interrupt) and tokens/s per side.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from procs import Proc, free_port  # noqa: E402  (tests/procs.py: real services as subprocesses)


def one_side(args, named, interruptible: bool, executor_url: str, work: Path) -> dict:
    from toolrl.refserver.client import RefServerClient
    from toolrl.weightsync.http import push_weights

    tag = "interrupt" if interruptible else "drain"
    ref_port, w_port = free_port(), free_port()
    sets = [f"ref_server.url=http://127.0.0.1:{ref_port}", f"executor.url={executor_url}", f"model.name={args.model}",
            "grpo.beta=0", "ref_server.flow_control=false", "ref_server.max_queue_samples=100000",
            "ref_server.max_staleness=1000", f"rollout.interruptible={str(interruptible).lower()}",
            "rollout.drain_timeout_s=300", "data.seed=0"]
    cli = ["--config", "configs/cpu_demo.yaml"] + [x for s in sets for x in ("--set", s)]
    ref = Proc(f"ref-{tag}", ["ref_server.py", *cli, "--port", str(ref_port)], work)
    worker = None
    try:
        ref.wait_http(f"http://127.0.0.1:{ref_port}/health", 300)
        worker = Proc(f"worker-{tag}", ["gen_worker.py", *cli, "--port", str(w_port)], work)
        url = f"http://127.0.0.1:{w_port}"
        worker.wait_http(f"{url}/health", 900)
        stats = lambda: httpx.get(f"{url}/stats", timeout=30).json()  # noqa: E731
        while stats()["generating_requests"] == 0:  # started generating
            time.sleep(0.2)
        time.sleep(args.gap_s)
        first, t0 = stats(), time.time()
        pushes = []
        with RefServerClient(f"http://127.0.0.1:{ref_port}") as rc:
            for v in range(1, args.pushes + 1):
                in_flight = stats()["generating_requests"]
                t = time.perf_counter()
                a = push_weights(url, named, version=v, bucket_mb=64, timeout_s=900)
                push_s = time.perf_counter() - t
                rc.set_version(v)
                pushes.append({"version": v, "push_s": round(push_s, 3), "drain_s": round(a["drain_s"], 3),
                               "reload_s": round(a["reload_s"], 3), "interrupted": a.get("interrupted", 0),
                               "generating_before": in_flight})
                print(f"  {tag} v{v}: push {push_s:.2f}s (drain {a['drain_s']:.2f}s, load {a['reload_s']:.2f}s, "
                      f"{a.get('interrupted', 0)} requests interrupted; {in_flight} generating)", flush=True)
                time.sleep(args.gap_s)
        last, window = stats(), time.time() - t0
    finally:
        if worker:
            worker.stop()
        ref.stop()
    push_s = [p["push_s"] for p in pushes]
    return {"side": tag, "pushes": pushes, "push_s_median": round(statistics.median(push_s), 3),
            "push_s_max": round(max(push_s), 3),
            "drain_s_median": round(statistics.median(p["drain_s"] for p in pushes), 3),
            "interrupted": sum(p["interrupted"] for p in pushes), "window_s": round(window, 1),
            "gen_tok_s": round((last["tokens"] - first["tokens"]) / window, 1),
            "samples": last["samples"] - first["samples"],
            "mixed_version_samples": last.get("mixed_version_samples", 0) - first.get("mixed_version_samples", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pushes", type=int, default=6)
    ap.add_argument("--gap-s", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()

    from toolrl.models import load_hf_model

    named = [(n, t.detach().clone()) for n, t in load_hf_model(args.model, dtype="bfloat16").state_dict().items()]
    work = Path(tempfile.mkdtemp(prefix="bench-interrupt-"))
    ex_port = free_port()
    ex = Proc("executor", ["executor_service.py", "--port", str(ex_port)], work)
    runs = []
    try:
        ex.wait_http(f"http://127.0.0.1:{ex_port}/health", 120)
        for _ in range(args.repeats):
            for interruptible in (True, False):
                runs.append(one_side(args, named, interruptible, f"http://127.0.0.1:{ex_port}", work))
    finally:
        ex.stop()
    side = {tag: [r for r in runs if r["side"] == tag] for tag in ("interrupt", "drain")}
    med = {tag: statistics.median(p["push_s"] for r in rs for p in r["pushes"]) for tag, rs in side.items()}
    tok = {tag: round(statistics.fmean(r["gen_tok_s"] for r in rs), 1) for tag, rs in side.items()}
    print("\nside       push median  push max  drain median  interrupted  gen tok/s  samples  mixed")
    for r in runs:
        print(f"{r['side']:<10} {r['push_s_median']:>10.2f}s {r['push_s_max']:>8.2f}s {r['drain_s_median']:>12.2f}s "
              f"{r['interrupted']:>11} {r['gen_tok_s']:>10.1f} {r['samples']:>8} {r['mixed_version_samples']:>6}")
    print(json.dumps({"push_s_median": {k: round(v, 3) for k, v in med.items()},
                      "push_ratio_drain_over_interrupt": round(med["drain"] / max(1e-9, med["interrupt"]), 2),
                      "gen_tok_s": tok, "pushes_per_side": args.pushes * args.repeats, "runs": runs}))


if __name__ == "__main__":
    main()
