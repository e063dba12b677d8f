"""End to end against TRL: launch.sh and TRL's GRPOTrainer training the same model on the same task,
one after the other on this machine, with equal work and equal wall clock (issue 23, item 3).

    python bench/e2e_vs_trl.py [--minutes 30] [--quick] [--repeats 1] [--no-tool-run] [--lr 1e-5]
        [--train-minutes M] [--eval-problems 64] [--eval-samples 1] [--setup-only]

The peer: TRL's GRPOTrainer (transformers generation, no vLLM: TRL's CPU path), installed by this
script into its own virtualenv, bench/.venv-trl, with pinned versions (PEER_PINS) and run by
bench/trl_peer.py; toolrl never imports it. Both sides get:

- the model: SmolLM2-135M-Instruct, the same converted directory (toolrl.models);
- the task: the plain think/answer variant of the arithmetic task (prompts/think_answer.txt, the
  "<think>" prefill, no tool: TRL has no mid-generation tool loop), the same problems in the same
  order (the stream toolrl's gen worker draws, written to a JSONL that the peer reads; the peer checks
  TRL tokenises each prompt to the ids toolrl uses), the same reward (correct 1.0, format 0.2;
  bench/peer_reward.py, tested to agree with toolrl's);
- the batch: 4 prompts x 4 samples a step, at most 256 new tokens, temperature 0.8, top_p 1;
- the objective: GRPO with the token-mean (DAPO) loss, clip 0.2 / 0.28, no KL, group-std advantages
  (sample std, as TRL), one update per batch, AdamW at the same learning rate, 1 warm-up step then
  constant, gradient clipping 1.0;
- the dtype: bf16 where the CPU has it natively (toolrl's `auto`; TRL: fp32 weights under bf16
  autocast, its `bf16=True`), fp32 elsewhere.

Each side does what it does by design, and the report says so: our learner skips the forward and
backward of samples whose advantage is zero and computes each group's prompt once, our gen worker
generates ahead of the learner (samples may go stale and be dropped: `stale_drop_fraction`), and
vLLM batches continuously; TRL computes every sample, pads each batch and generates with
transformers, with gradient checkpointing on (its default; --peer-gradient-checkpointing off).

Runs alternate: ours (plain), the peer, then toolrl's own tool-task run (configs/cpu_demo.yaml as
shipped: tool prompt, teacher traces), reported beside them; --repeats N alternates ours and the peer
N times. Our learner trains for a time budget; its training window runs from the start of its first
step to the end of its last, plus the seconds the gen worker spent generating before that first step
(it starts while the learner is still setting up; flow control bounds that head start to
(max_staleness + 1) batches). The peer's window runs from its first step to its last; it gets the
window of the run before it as its budget and stops at the end of the first step that reaches it
(so it never has less time). Start-up (launch to first step) is reported apart, for both.
Before each run a short matmul measures the host's speed, to show drift between runs (this machine's
speed moves up to 2x from one hour to the next, more while others use it). Every second the PSS of
each side's whole process tree (every descendant's /proc/PID/smaps_rollup, summed) is sampled; the
peak is over start-up, training and export (our end-of-run report is left out).

Held-out accuracy at equal wall clock: after all runs, ONE evaluator (toolrl's Agent.evaluate on one
vLLM engine, the weights of each final policy loaded in place in turn) scores the base model and every
run's final policy on the same held-out problems (arithmetic levels 1-3, data.eval_seed) with the same
sampling; the tool-task policy is scored with the tool prompt and the tool loop, the others with the
plain prompt. One evaluator for all, after all training, so no side is scored by its own code or
under other machine load.

Reported per side: policy samples trained per hour (all samples in a trained batch; also those with
a nonzero advantage), generation tokens/s (model tokens over the seconds the generator was busy:
TRL's generate calls; our worker's seconds with rollouts in flight, sampled each second), learner
tokens/s (prompt + completion tokens of the trained samples over the learner's seconds: TRL's step
less generation and scoring; our compute + weight sync), whole tokens/s (completion tokens trained
over the window), peak PSS, start-up time.

Last line: JSON with samples_per_hour_ratio (ours / peer), accuracy_at_equal_time {ours, peer},
peak_mem_ratio (ours / peer), stale_drop_fraction (ours), the goals met and the side-by-side
figures; every run's own figures and the PSS readings are in OUT/result.json and OUT/*/bench_readings.json.
The default takes about 30 minutes (--minutes sets the whole; --quick: about 12, for a smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from toolrl.config import load_config  # noqa: E402
from toolrl.models import cpu_flags  # noqa: E402
from toolrl.net import free_port  # noqa: E402

CONFIG = "configs/cpu_demo.yaml"
PEER_VENV = ROOT / "bench" / ".venv-trl"
# torch 2.13.0 is the CPU build on PyPI (any other version pulls CUDA wheels); the rest as in .venv
PEER_PINS = ["torch==2.13.0", "trl==1.16.0", "transformers==5.19.0", "accelerate==1.15.0", "datasets==5.2.0",
             "math-verify==0.9.0"]
REWARD_WEIGHTS = {"correct": 1.0, "format": 0.2}
PREFILL = "<think>\n"
WORKER_ID = "worker-0"  # launch.sh's single worker: its problem stream is what the peer gets
# rough costs beyond the training budgets (minutes), to fit a run into --minutes
OURS_OVERHEAD_MIN, PEER_OVERHEAD_MIN, EVAL_START_MIN, EVAL_PER_MODEL_MIN = 2.5, 1.0, 2.0, 0.8
# Reading smaps_rollup costs the kernel about 20 ms per GB mapped: for an 8 GB tree about 15% of one
# core at one reading a second, paid alike by both sides (their trees are of a size)
SAMPLE_EVERY_S = 1.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# The peer's virtualenv

def ensure_peer_venv() -> Path:
    """bench/.venv-trl with PEER_PINS (torch first, so nothing resolves to a CUDA build); redone when
    the pins change. Network-bound: a few minutes the first time."""
    py, stamp = PEER_VENV / "bin" / "python", PEER_VENV / ".pins"
    if py.is_file() and stamp.is_file() and stamp.read_text().split() == PEER_PINS:
        return py
    log(f"installing the TRL peer into {PEER_VENV.relative_to(ROOT)}: {' '.join(PEER_PINS)}")
    if not py.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--upgrade", "pip>=24,<27"], check=True)
    subprocess.run(pip + [PEER_PINS[0]], check=True)
    subprocess.run(pip + PEER_PINS, check=True)
    subprocess.run([str(py), "-c", "import trl, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"],
                   check=True)
    stamp.write_text("\n".join(PEER_PINS) + "\n")
    return py


# ---------------------------------------------------------------------------------------------
# Configs: the plain think/answer variant, and the tool task as shipped

def common_sets(budget_s: float, ports: dict) -> list[str]:
    return [f"executor.port={ports['executor']}", f"ref_server.port={ports['ref_server']}",
            f"rollout.port={ports['rollout']}", "learner.steps=1000000", f"learner.time_budget_s={budget_s:.0f}",
            "learner.run_budget_s=null",  # the training budget alone decides (the demo's bound would cut long ones)
            "learner.checkpoint_every=0", "eval.before_after=false", "logging.dump_samples=true",
            "logging.wandb_mode=disabled", "logging.tensorboard=false"]


def plain_sets(args) -> list[str]:
    """cpu_demo.yaml made into plain GRPO on the think/answer prompt, as the peer runs it."""
    batch = args.prompts_per_step * args.group_size
    return ["prompt.system=think_answer", f"prompt.prefill={json.dumps(PREFILL)}",
            "rollout.max_tool_calls=0", "rollout.stop_at_program_close=false",
            f"rollout.prompts_per_step={args.prompts_per_step}", f"rollout.group_size={args.group_size}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
            "rollout.top_p=1.0", "teacher.traces_per_group=0", "grpo.w_teacher=0", "grpo.w_self=0",
            "grpo.beta=0", "grpo.loss_type=token", "grpo.epsilon_low=0.2", "grpo.epsilon_high=0.28",
            "grpo.std=sample", "grpo.updates_per_batch=1",
            f"rewards.weights={json.dumps(REWARD_WEIGHTS)}", f"learner.batch_samples={batch}",
            f"ref_server.max_queue_samples={batch}", f"learner.lr={args.lr}", "learner.warmup_steps=1",
            "learner.lr_schedule=constant", "learner.grad_clip=1.0", "learner.weight_decay=0"]


# ---------------------------------------------------------------------------------------------
# Measuring: process trees, PSS, host speed

def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(pid))
    return kids


def tree(root: int) -> list[int]:
    kids, out, todo = children_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def short_name(pid: int) -> str:
    """A process as a reader knows it: the script it runs (learner.py, gen_worker.py, ...) or its
    own title (vLLM's engine core and worker name themselves)."""
    words = cmdline(pid).split()
    script = next((Path(w).name for w in words if w.endswith(".py")), None)
    return script or (words[0].rsplit("/", 1)[-1] if words else str(pid))


def host_gflops(dtype: str, seconds: float = 1.5) -> float:
    """A 512x512 matmul loop in the run's dtype: the host's speed right now (shared machines drift)."""
    import torch

    dt = getattr(torch, dtype)
    a, b = torch.randn(512, 512, dtype=dt), torch.randn(512, 512, dtype=dt)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return round(2 * 512 ** 3 * n / (time.perf_counter() - t0) / 1e9, 1)


class Sampler(threading.Thread):
    """Every `period` s: PSS of root's whole tree, and `probe()`'s extra readings."""

    def __init__(self, root: int, probe=None, period: float = 1.0):
        super().__init__(daemon=True)
        self.root, self.probe, self.period = root, probe, period
        self.rows: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.time()
            pids = tree(self.root)
            each = {p: pss_mb(p) for p in pids}
            row = {"t": t, "pss_mb": round(sum(each.values()), 1), "procs": len(pids),
                   # where the memory is: the largest processes, by a short name
                   "top": [[short_name(p), round(mb)] for p, mb in sorted(each.items(), key=lambda x: -x[1])[:6]]}
            if self.probe is not None:
                try:
                    row.update(self.probe(pids))
                except Exception as exc:  # a reading is never worth the run
                    row["probe_error"] = repr(exc)
            self.rows.append(row)
            self.stop.wait(max(0.0, self.period - (time.time() - t)))


# ---------------------------------------------------------------------------------------------
# Our side

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_ours(name: str, extra_sets: list[str], budget_s: float, run_dir: Path, dtype: str) -> dict:
    """launch.sh on configs/cpu_demo.yaml with `extra_sets` and a training budget, on free ports,
    until the learner has exported; then it is stopped (its end-of-run report, a sync probe, is no
    part of training)."""
    import httpx

    speed = host_gflops(dtype)
    ports = {"executor": free_port(), "ref_server": free_port(), "rollout": free_port()}
    sets = common_sets(budget_s, ports) + extra_sets
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLRL_")}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    flags = [x for s in sets for x in ("--set", s)]
    t0 = time.time()
    launch = subprocess.Popen(["bash", "launch.sh", "--config", CONFIG, "--run-dir", str(run_dir), "--workers", "1",
                               *flags], cwd=ROOT, stdout=open(run_dir.parent / f"{run_dir.name}.launch.log", "w"),
                              stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log(f"{name}: launch.sh in {run_dir} (host {speed} GFLOP/s {dtype})")
    metrics_path = run_dir / "logs" / "metrics.jsonl"
    seen = {"metric_lines": 0, "metric_times": [], "learner": False, "token": None}
    client = httpx.Client(timeout=0.8)

    def probe(pids: list[int]) -> dict:
        row = {}
        learner = any("learner.py" in c for c in map(cmdline, pids))  # the rank or its DeepSpeed launchers
        seen["learner"] |= learner
        row["learner"] = learner
        n = metrics_path.read_bytes().count(b"\n") if metrics_path.is_file() else 0  # whole lines only
        if n > seen["metric_lines"]:
            seen["metric_times"] += [time.time()] * (n - seen["metric_lines"])
            seen["metric_lines"] = n
        tokens = run_dir / "tokens.env"
        if seen["token"] is None and tokens.is_file():
            seen["token"] = dict(line.split("=", 1) for line in tokens.read_text().splitlines())["TOOLRL_ROLLOUT_TOKEN"]
        if seen["token"]:
            try:
                st = client.get(f"http://127.0.0.1:{ports['rollout']}/stats",
                                headers={"Authorization": f"Bearer {seen['token']}"}).json()
                row.update(inflight=st["inflight_groups"], gen_tokens=st["tokens"], gen_samples=st["samples"])
            except Exception:
                pass
        return row

    sampler = Sampler(launch.pid, probe, SAMPLE_EVERY_S)
    sampler.start()
    try:
        while launch.poll() is None:
            if seen["learner"] and sampler.rows and not sampler.rows[-1].get("learner", True):
                break  # the learner has trained, exported and exited
            time.sleep(0.5)
    finally:
        sampler.stop.set()
        sampler.join()
        client.close()
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGINT)
            try:
                launch.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(launch.pid, signal.SIGKILL)
                launch.wait()
    wall = time.time() - t0
    metrics = read_jsonl(metrics_path)
    if not metrics:
        raise RuntimeError(f"{name}: no training step was logged; see {run_dir}/logs and "
                           f"{run_dir.parent / (run_dir.name + '.launch.log')}")
    samples = read_jsonl(run_dir / "logs" / "samples.jsonl")
    rows = sampler.rows
    times = seen["metric_times"]
    first_step_start = times[0] - metrics[0]["step_time_s"]
    end = times[len(metrics) - 1]
    # seconds with rollouts in flight (each reading's interval to the next), before the learner's first
    # step and in all: the worker starts generating while the learner is still setting up, and that
    # work (at most (max_staleness + 1) batches, by flow control) counts as training time
    busy = [(a["t"], b["t"]) for a, b in zip(rows, rows[1:]) if a.get("inflight", 0) > 0]
    busy_s = sum(b - a for a, b in busy)
    head_start_s = sum(min(b, first_step_start) - a for a, b in busy if a < first_step_start)
    window = end - first_step_start + head_start_s
    policy = [s for s in samples if s.get("source", "policy") == "policy"]
    trained_tokens = sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples)
    completion_tokens = sum(sum(s["loss_mask"]) for s in samples)  # model-written tokens (tool output masked)
    learner_s = sum(m.get("time_compute_s", 0.0) + m.get("time_sync_s", 0.0) for m in metrics)
    gen_tokens = max([r.get("gen_tokens", 0) for r in rows] + [0])  # groups still in flight at the end: not counted
    last = metrics[-1]
    res = {
        "run_dir": str(run_dir), "host_gflops": speed, "steps": len(metrics), "wall_s": round(wall, 1),
        "startup_s": round(first_step_start - t0, 1), "window_s": round(window, 1),
        "head_start_s": round(head_start_s, 1),
        "samples_trained": len(samples), "policy_samples_trained": len(policy),
        "teacher_samples_trained": len(samples) - len(policy),
        "signal_samples": sum(1 for s in policy if s["advantage"] != 0),
        "samples_no_signal_skipped": int(sum(m.get("samples_no_signal", 0) for m in metrics)),
        "policy_samples_per_hour": round(len(policy) / window * 3600, 1),
        "signal_samples_per_hour": round(sum(1 for s in policy if s["advantage"] != 0) / window * 3600, 1),
        "generated_tokens": gen_tokens,
        "generator_busy_s": round(busy_s, 1), "gen_tok_s": round(gen_tokens / max(1e-9, busy_s), 1),
        "learner_tok_s": round(trained_tokens / max(1e-9, learner_s), 1), "learner_s": round(learner_s, 1),
        "whole_tok_s": round(completion_tokens / window, 1),
        "mean_completion_tokens": round(completion_tokens / max(1, len(samples)), 1),
        "peak_pss_mb": max(r["pss_mb"] for r in rows),  # start-up, training and export
        "peak_pss_by_process": max(rows, key=lambda r: r["pss_mb"])["top"],
        "stale_drop_fraction": last.get("queue/stale_drop_fraction"),
        "dropped_stale": last.get("queue/dropped_stale"), "samples_received": last.get("queue/samples_in"),
        "train_reward_first": metrics[0].get("reward/total_mean"), "train_reward_last": last.get("reward/total_mean"),
        "train_accuracy_mean": round(sum(s["rewards"].get("correct", 0.0) for s in policy) / max(1, len(policy)), 3),
        "export": str(run_dir / "export"),
    }
    (run_dir / "bench_readings.json").write_text(json.dumps({"result": res, "readings": rows}))
    # the learner's final checkpoint (weights and optimizer states: 2.7-4 GB in fp32) is no part of the
    # result, and a few runs' worth filled this host's disk mid-benchmark; the export stays for the evaluation
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    log(f"{name}: {res['steps']} steps, {res['policy_samples_trained']} policy samples in {window:.0f}s "
        f"({res['policy_samples_per_hour']:.0f}/h), peak PSS {res['peak_pss_mb']:.0f} MB, "
        f"stale {res['stale_drop_fraction']}")
    return res


# ---------------------------------------------------------------------------------------------
# The peer

def write_problems(path: Path, n: int, args) -> None:
    """The first `n` problems of the stream our worker draws, with toolrl's prompt ids and their text."""
    from toolrl.models import load_tokenizer
    from toolrl.prompts import load_chat_prompt
    from toolrl.tasks import problem_stream

    cfg = load_config(CONFIG, plain_sets(args))
    tok = load_tokenizer(cfg.model.name)
    chat = load_chat_prompt(cfg.prompt.system)
    stream = problem_stream(cfg.data, WORKER_ID)
    with open(path, "w") as f:
        for _ in range(n):
            p = next(stream)
            ids = chat.ids(tok, p.question, cfg.prompt.prefill)
            f.write(json.dumps({"id": p.id, "level": p.level, "prompt": tok.decode(ids), "prompt_ids": ids,
                                "answer": p.answer}) + "\n")


def run_peer(name: str, py: Path, out: Path, problems: Path, budget_s: float, dtype: str, args) -> dict:
    from toolrl.models import resolve_model

    speed = host_gflops(dtype)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(py), str(ROOT / "bench" / "trl_peer.py"), "--model", resolve_model("smollm2-135m-instruct"),
           "--problems", str(problems), "--out", str(out), "--budget-s", f"{budget_s:.1f}",
           "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
           "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature),
           "--lr", str(args.lr), "--warmup-steps", "1", "--weights", json.dumps(REWARD_WEIGHTS),
           "--prefill", PREFILL, "--bf16" if dtype == "bfloat16" else "--no-bf16",
           "--gradient-checkpointing" if args.peer_gradient_checkpointing == "on" else "--no-gradient-checkpointing"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOOLRL_", "PYTHON", "VIRTUAL_ENV"))}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(out / "peer.log", "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    log(f"{name}: TRL GRPOTrainer, budget {budget_s:.0f}s, in {out} (host {speed} GFLOP/s {dtype})")
    sampler = Sampler(proc.pid, None, SAMPLE_EVERY_S)
    sampler.start()
    try:
        rc = proc.wait()
    finally:
        sampler.stop.set()
        sampler.join()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    wall = time.time() - t0
    steps = read_jsonl(out / "steps.jsonl")
    if rc != 0 or not steps:
        tail = "\n".join((out / "peer.log").read_text().splitlines()[-25:])
        raise RuntimeError(f"{name}: trl_peer.py failed (exit {rc}); last lines of {out}/peer.log:\n{tail}")
    summ = json.loads((out / "summary.json").read_text())
    start, end = steps[0]["t_start"], steps[-1]["t_end"]
    window = end - start
    n = sum(s["samples"] for s in steps)
    signal_n = sum(s["signal_samples"] for s in steps)
    completion_tokens = sum(s["completion_tokens"] for s in steps)
    gen_s = sum(s["gen_s"] for s in steps)
    learner_s = sum(s["learner_s"] for s in steps)
    res = {
        "out_dir": str(out), "host_gflops": speed, "steps": len(steps), "wall_s": round(wall, 1),
        "startup_s": round(start - t0, 1), "window_s": round(window, 1), "budget_s": round(budget_s, 1),
        "samples_trained": n, "policy_samples_trained": n, "signal_samples": signal_n,
        "policy_samples_per_hour": round(n / window * 3600, 1),
        "signal_samples_per_hour": round(signal_n / window * 3600, 1),
        "generated_tokens": completion_tokens, "generator_busy_s": round(gen_s, 1),
        "gen_tok_s": round(completion_tokens / max(1e-9, gen_s), 1),
        "learner_tok_s": round((completion_tokens + sum(s["prompt_tokens"] for s in steps)) / max(1e-9, learner_s), 1),
        "learner_s": round(learner_s, 1), "whole_tok_s": round(completion_tokens / window, 1),
        "mean_completion_tokens": round(completion_tokens / max(1, n), 1),
        "peak_pss_mb": max(r["pss_mb"] for r in sampler.rows),
        "peak_pss_by_process": max(sampler.rows, key=lambda r: r["pss_mb"])["top"],
        "zero_std_groups": sum(s["zero_std_groups"] for s in steps),
        "train_reward_first": steps[0]["reward_mean"], "train_reward_last": steps[-1]["reward_mean"],
        "train_accuracy_mean": round(sum(s["accuracy"] * s["samples"] for s in steps) / max(1, n), 3),
        "versions": summ.get("versions"), "export": summ["export"],
    }
    (out / "bench_readings.json").write_text(json.dumps({"result": res, "readings": sampler.rows}))
    log(f"{name}: {res['steps']} steps, {n} samples in {window:.0f}s ({res['policy_samples_per_hour']:.0f}/h), "
        f"peak PSS {res['peak_pss_mb']:.0f} MB")
    return res


# ---------------------------------------------------------------------------------------------
# One evaluator for every policy

def evaluate(models: list[dict], args, work: Path) -> list[dict]:
    """Run the evaluator (this script's --_eval) in its own process: one vLLM engine, each policy
    loaded into it in turn."""
    spec = {"models": models, "task": "arithmetic:1-3", "n_problems": args.eval_problems,
            "samples": args.eval_samples, "plain_sets": plain_sets(args)}
    path = work / "eval_spec.json"
    path.write_text(json.dumps(spec, indent=1))
    out = work / "eval_results.json"
    log(f"evaluating {len(models)} policies on {args.eval_problems} held-out problems x {args.eval_samples}")
    with open(work / "eval.log", "w") as f:
        rc = subprocess.run([sys.executable, __file__, "--_eval", str(path), "--_eval-out", str(out)], cwd=ROOT,
                            stdout=f, stderr=subprocess.STDOUT,
                            env={k: v for k, v in os.environ.items() if not k.startswith("TOOLRL_")}).returncode
    if rc != 0 or not out.is_file():
        tail = "\n".join((work / "eval.log").read_text().splitlines()[-25:])
        raise RuntimeError(f"the evaluation failed (exit {rc}); last lines of {work}/eval.log:\n{tail}")
    return json.loads(out.read_text())


def eval_main(spec_path: str, out_path: str) -> None:
    import asyncio

    from toolrl.executor.local import LocalExecutor
    from toolrl.format import PROGRAM_CLOSE
    from toolrl.models import resolve_model
    from toolrl.tasks import load_task, task_seed
    from toolrl.worker.agent import Agent
    from toolrl.worker.engine import VllmEngine

    spec = json.loads(Path(spec_path).read_text())

    async def go(ex_url: str) -> list[dict]:
        ex = [f"executor.url={ex_url}", "executor.token=null"]
        cfgs = {"plain": load_config(CONFIG, spec["plain_sets"] + ex), "tool": load_config(CONFIG, ex)}
        engine = VllmEngine(cfgs["plain"], resolve_model(cfgs["plain"].model.name), seed=1234)
        agents = {k: Agent(c, f"bench-eval-{k}", engine=engine) for k, c in cfgs.items()}
        stops = {k: [c.rollout.stop_marker] + ([PROGRAM_CLOSE] if c.rollout.stop_at_program_close else [])
                 for k, c in cfgs.items()}
        base = cfgs["plain"]
        problems = load_task(spec["task"], spec["n_problems"], task_seed(base.data, spec["task"]), base.data)
        results = []
        try:
            for m in spec["models"]:
                t = time.time()
                engine.stops = stops[m["kind"]]  # what the run trained with (the plain one never stops at </program>)
                if m["path"] is not None:  # None: the base model the engine started with
                    await engine._load("reload_weights", {"weights_path": m["path"], "is_checkpoint_format": True},
                                       600, f"loading {m['path']}")
                res = await agents[m["kind"]].evaluate(problems, spec["samples"], [1], base.eval.concurrency)
                keep = {k: res[k] for k in ("accuracy", "format_rate", "tool_calls_per_answer",
                                            "mean_completion_tokens", "n_problems", "n_samples") if k in res}
                results.append({**m, **keep, "eval_s": round(time.time() - t, 1)})
                print(json.dumps(results[-1]), flush=True)
        finally:
            for a in agents.values():
                await a.executor.aclose()
            engine.shutdown()
        return results

    with LocalExecutor(startup_timeout_s=120) as ex:
        results = asyncio.run(go(ex.url))
    Path(out_path).write_text(json.dumps(results, indent=1))


# ---------------------------------------------------------------------------------------------

def plan_minutes(args, n_ours: int, n_peer: int, n_models: int) -> float:
    """The training budget of each run that fits the whole into --minutes."""
    if args.train_minutes:
        return args.train_minutes
    fixed = (n_ours * OURS_OVERHEAD_MIN + n_peer * PEER_OVERHEAD_MIN + EVAL_START_MIN
             + n_models * EVAL_PER_MODEL_MIN)
    return max(1.0, (args.minutes - fixed) / (n_ours + n_peer))


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="the whole benchmark, evaluation included")
    ap.add_argument("--train-minutes", type=float, help="each run's training budget (default: fitted to --minutes)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: 1.5-minute budgets, 16 held-out problems")
    ap.add_argument("--repeats", type=int, default=1, help="ours and the peer alternate this many times")
    ap.add_argument("--no-tool-run", action="store_true", help="leave out toolrl's tool-task run")
    ap.add_argument("--lr", type=float, default=1e-5, help="both sides' learning rate")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--peer-gradient-checkpointing", choices=["on", "off"], default="on",
                    help="TRL's default is on (slower, less memory)")
    ap.add_argument("--eval-problems", type=int, default=64)
    ap.add_argument("--eval-samples", type=int, default=1)
    ap.add_argument("--out", help="default runs/e2e-vs-trl-TIMESTAMP")
    ap.add_argument("--setup-only", action="store_true", help="install the peer's virtualenv and stop")
    ap.add_argument("--_eval", help=argparse.SUPPRESS)
    ap.add_argument("--_eval-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._eval:
        return eval_main(args._eval, args._eval_out)

    py = ensure_peer_venv()
    if args.setup_only:
        print(json.dumps({"peer_python": str(py), "pins": PEER_PINS}))
        return
    from toolrl.models import resolve_dtype, resolve_model

    if args.quick:
        args.train_minutes = args.train_minutes or 1.5
        args.eval_problems = min(args.eval_problems, 16)
    work = Path(args.out or ROOT / "runs" / f"e2e-vs-trl-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(load_config(CONFIG, []).model.dtype)
    resolve_model("smollm2-135m-instruct")  # converted once, before anything is timed
    schedule = [kind for _ in range(args.repeats) for kind in ("ours", "peer")]
    if not args.no_tool_run:
        schedule.append("ours_tool")
    n_ours = sum(k.startswith("ours") for k in schedule)
    train_min = plan_minutes(args, n_ours, len(schedule) - n_ours, len(schedule) + 1)
    flags = cpu_flags()
    log(f"e2e vs TRL in {work}: runs {', '.join(schedule)}; training budget {train_min:.1f} min each; {dtype}; "
        f"CPU flags {' '.join(flags)}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}")
    problems = work / "problems.jsonl"
    per_step = args.prompts_per_step
    write_problems(problems, max(64, int(train_min * 60 / 5 * per_step) + 64), args)  # > any step rate here

    budget_s = train_min * 60
    runs: dict[str, list[dict]] = {"ours": [], "peer": [], "ours_tool": []}
    for kind in schedule:
        name = f"{kind}-{len(runs[kind]) + 1}"
        if kind == "ours":
            runs[kind].append(run_ours(name, plain_sets(args), budget_s, work / name, dtype))
        elif kind == "ours_tool":  # configs/cpu_demo.yaml as shipped
            runs[kind].append(run_ours(name, [], budget_s, work / name, dtype))
        else:  # the window of the ours-plain run just before, so both train for the same wall clock
            runs[kind].append(run_peer(name, py, work / name, problems, runs["ours"][-1]["window_s"], dtype, args))

    models = [{"name": "base", "kind": "plain", "path": None}]
    for kind, rs in runs.items():
        for j, r in enumerate(rs):
            models.append({"name": f"{kind}-{j + 1}", "kind": "tool" if kind == "ours_tool" else "plain",
                           "path": r["export"]})
    accs = {e["name"]: e for e in evaluate(models, args, work)}
    for kind, rs in runs.items():
        for j, r in enumerate(rs):
            e = accs[f"{kind}-{j + 1}"]
            r.update(heldout_accuracy=e["accuracy"], heldout_format_rate=e.get("format_rate"))

    def mean(rs: list[dict], key: str):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    ours, peer, tool = runs["ours"], runs["peer"], runs["ours_tool"]
    res = {
        "samples_per_hour_ratio": ratio(mean(ours, "policy_samples_per_hour"), mean(peer, "policy_samples_per_hour")),
        "accuracy_at_equal_time": {"ours": mean(ours, "heldout_accuracy"), "peer": mean(peer, "heldout_accuracy"),
                                   "base": accs["base"]["accuracy"],
                                   "window_s": {"ours": mean(ours, "window_s"), "peer": mean(peer, "window_s")}},
        "peak_mem_ratio": ratio(mean(ours, "peak_pss_mb"), mean(peer, "peak_pss_mb")),
        "stale_drop_fraction": mean(ours, "stale_drop_fraction"),
        "signal_samples_per_hour_ratio": ratio(mean(ours, "signal_samples_per_hour"),
                                               mean(peer, "signal_samples_per_hour")),
        # what each side leaves out: our learner's forward/backward of zero-advantage samples and the
        # samples our reference server dropped as stale; TRL leaves out nothing (it computes every sample)
        "skips": {"ours_zero_advantage_not_computed": sum(r["samples_no_signal_skipped"] for r in ours),
                  "ours_samples_trained": sum(r["samples_trained"] for r in ours),
                  "ours_dropped_stale": sum(r["dropped_stale"] or 0 for r in ours),
                  "peer_zero_advantage_computed": sum(r["samples_trained"] - r["signal_samples"] for r in peer),
                  "peer_samples_trained": sum(r["samples_trained"] for r in peer)},
        "gen_tok_s": {"ours": mean(ours, "gen_tok_s"), "peer": mean(peer, "gen_tok_s")},
        "learner_tok_s": {"ours": mean(ours, "learner_tok_s"), "peer": mean(peer, "learner_tok_s")},
        "whole_tok_s": {"ours": mean(ours, "whole_tok_s"), "peer": mean(peer, "whole_tok_s")},
        "peak_pss_mb": {"ours": mean(ours, "peak_pss_mb"), "peer": mean(peer, "peak_pss_mb")},
        "tool_run": ({"heldout_accuracy": tool[0]["heldout_accuracy"],
                      "policy_samples_per_hour": tool[0]["policy_samples_per_hour"],
                      "teacher_samples_trained": tool[0]["teacher_samples_trained"],
                      "peak_pss_mb": tool[0]["peak_pss_mb"], "stale_drop_fraction": tool[0]["stale_drop_fraction"],
                      "window_s": tool[0]["window_s"]} if tool else None),
        "runs": runs, "eval": list(accs.values()),
        "setup": {"model": "smollm2-135m-instruct", "task": "arithmetic levels 1-3, prompts/think_answer.txt",
                  "reward": REWARD_WEIGHTS, "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
                  "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "lr": args.lr,
                  "dtype": dtype, "train_minutes": round(train_min, 2), "peer_pins": PEER_PINS,
                  "peer_gradient_checkpointing": args.peer_gradient_checkpointing, "cpu_flags": flags,
                  "eval": f"arithmetic:1-3, {args.eval_problems} problems x {args.eval_samples}", "quick": args.quick},
    }
    res["goals"] = {"samples_per_hour_3x": bool(res["samples_per_hour_ratio"] and res["samples_per_hour_ratio"] >= 3),
                    "accuracy_at_least_peer": res["accuracy_at_equal_time"]["ours"]
                    >= res["accuracy_at_equal_time"]["peer"],
                    "peak_mem_at_most_half": bool(res["peak_mem_ratio"] and res["peak_mem_ratio"] <= 0.5)}
    (work / "result.json").write_text(json.dumps(res, indent=1))
    print(f"\n{'':28s}{'ours':>12s}{'TRL':>12s}")
    for label, key in (("policy samples / hour", "policy_samples_per_hour"),
                       ("  with nonzero advantage", "signal_samples_per_hour"),
                       ("generation tokens/s", "gen_tok_s"), ("learner tokens/s", "learner_tok_s"),
                       ("whole tokens/s", "whole_tok_s"), ("mean completion tokens", "mean_completion_tokens"),
                       ("held-out accuracy", "heldout_accuracy"), ("peak PSS (MB)", "peak_pss_mb"),
                       ("training window (s)", "window_s"), ("start-up (s)", "startup_s"),
                       ("host GFLOP/s before", "host_gflops")):
        cells = [mean(side, key) for side in (ours, peer)]
        print(f"{label:28s}" + "".join(f"{'-':>12s}" if v is None else f"{v:12.3f}" if "accuracy" in key
                                       else f"{v:12.1f}" for v in cells))
    if tool:
        t = tool[0]
        print(f"tool task (toolrl only): {t['policy_samples_per_hour']:.0f} policy samples/h, held-out accuracy "
              f"{t['heldout_accuracy']:.3f}, peak PSS {t['peak_pss_mb']:.0f} MB, stale {t['stale_drop_fraction']}")
    print(json.dumps({k: v for k, v in res.items() if k not in ("runs", "eval")}))


if __name__ == "__main__":
    main()
