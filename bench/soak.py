"""Soak: the whole system on the tiny model for a long run, with gen workers joining and leaving.

    python bench/soak.py [--minutes 30] [--churn-every 180] [--config configs/cpu_tiny.yaml]

launch.sh runs the executor, the reference server, one gen worker and the learner (every service
with its per-run token) for `--minutes`; every `--churn-every` seconds a second gen worker joins
from outside launch.sh (as a worker on another node would) and is killed half a period later.
Every 20 s the resident memory (RSS) and open file descriptors of each long-lived process are
sampled. At the end:

- growth: for each process, its median reading over the last quarter of the run over its median
  over the quarter after the warm-up (the first quarter), for RSS and for fds; the goal is under 10%
  (1.10);
- nothing lost: the reference server's `samples_in == samples_out + dropped_stale + dropped_failed +
  queued`, and the learner trained exactly `samples_out` samples;
- nothing duplicated: in the learner's dump of every trained sample, every sample id appears once
  (`duplicated`), and no group has more policy samples than `group_size` or more teacher traces
  than `traces_per_group` (`overfull_groups`: a group rolled out twice under fresh ids).

Last line: JSON with `rss_growth_max`, `fd_growth_max`, per-process growth, `lost`, `duplicated`,
`overfull_groups`, `steps`, `workers_joined`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from toolrl.config import load_config  # noqa: E402
from toolrl.net import free_port  # noqa: E402


def cmdline(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def role_of(cmd: list[str], ports: dict) -> str | None:
    """Which long-lived process of the run this is (None: a launcher, a runner, or not ours). The
    fork server is the first of the sandbox's processes (its zygotes and runners come and go)."""
    text = " ".join(cmd)
    if any(a.endswith("/deepspeed") or a.startswith("deepspeed.") for a in cmd):
        return None  # the DeepSpeed launchers (bin/deepspeed, -m deepspeed.launcher.launch), not the rank
    for script, role in (("executor_service.py", "executor"), ("ref_server.py", "ref_server")):
        if script in text and str(ports[role]) in text:
            return role
    if "gen_worker.py" in text and "worker-0" in cmd:  # launch.sh's worker (the churning ones are churn-N)
        return "gen_worker"
    if "learner.py" in text:
        return "learner"
    if "toolrl.executor.forkserver" in text:
        return "forkserver"
    return None


def readings(ports: dict) -> dict[str, dict]:
    """RSS (MB) and open fds of each long-lived process of the run, by role."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        role = role_of(cmdline(int(pid)), ports)
        if role is None or role in out:
            continue
        try:
            rss = next(int(x.split()[1]) for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if x.startswith("VmRSS:")) / 1024
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            continue
        out[role] = {"pid": int(pid), "rss_mb": round(rss, 1), "fds": fds}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--churn-every", type=float, default=180.0, help="seconds between workers joining")
    ap.add_argument("--config", default="configs/cpu_tiny.yaml")
    ap.add_argument("--run-dir", default=None)
    args = ap.parse_args()
    run_dir = Path(args.run_dir or f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    ports = {"executor": free_port(), "ref_server": free_port(), "gen_worker": free_port()}
    budget = args.minutes * 60
    sets = [f"executor.port={ports['executor']}", f"ref_server.port={ports['ref_server']}",
            f"rollout.port={ports['gen_worker']}", "learner.steps=1000000", f"learner.time_budget_s={budget:.0f}",
            "learner.checkpoint_every=0", "logging.dump_samples=true", "eval.before_after=false"]
    cfg = load_config(args.config, sets)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLRL_")}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.launch.log", "w")
    flags = [x for s in sets for x in ("--set", s)]
    launch = subprocess.Popen(["bash", "launch.sh", "--config", args.config, "--run-dir", str(run_dir),
                               "--workers", "1", *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env=env, start_new_session=True)
    print(f"soak: {args.minutes:g} min in {run_dir}; a worker joins every {args.churn_every:g}s", flush=True)
    t0, samples, joined, churn, churn_until = time.time(), [], 0, None, 0.0
    next_join = t0 + 120 + args.churn_every / 2  # after start-up
    try:
        while launch.poll() is None:
            now = time.time()
            tokens = run_dir / "tokens.env"
            if churn is None and now >= next_join and tokens.is_file():
                wenv = {**env, **dict(line.split("=", 1) for line in tokens.read_text().splitlines())}
                port = free_port()
                churn = subprocess.Popen(
                    [sys.executable, "gen_worker.py", "--config", args.config, *flags,
                     "--set", f"ref_server.url=http://127.0.0.1:{ports['ref_server']}",
                     "--set", f"executor.url=http://127.0.0.1:{ports['executor']}",
                     "--set", "rollout.cpu_threads_bind=1",
                     "--port", str(port), "--worker-id", f"churn-{joined}"], cwd=ROOT, env=wenv,
                    stdout=open(run_dir / "logs" / f"churn-{joined}.log", "w"), stderr=subprocess.STDOUT,
                    start_new_session=True)
                joined += 1
                churn_until = now + args.churn_every / 2
                print(f"  {now - t0:5.0f}s worker churn-{joined - 1} joins", flush=True)
            if churn is not None and now >= churn_until:
                os.killpg(churn.pid, signal.SIGKILL)
                churn.wait()
                churn = None
                next_join = now + args.churn_every / 2
                print(f"  {now - t0:5.0f}s worker churn-{joined - 1} killed", flush=True)
            r = readings(ports)
            if r:
                samples.append({"t": round(now - t0, 1), **r})
                print(f"  {now - t0:5.0f}s " + "  ".join(f"{k} {v['rss_mb']:.0f}MB/{v['fds']}fd"
                                                         for k, v in sorted(r.items())), flush=True)
            time.sleep(20)
    finally:
        if churn is not None:
            os.killpg(churn.pid, signal.SIGKILL)
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGINT)
            launch.wait(120)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    res = {"minutes": args.minutes, "launch_exit": launch.returncode, "steps": summary.get("steps"),
           "workers_joined": joined, **growth(samples, budget), **accounting(run_dir, cfg, summary)}
    (run_dir / "soak.json").write_text(json.dumps({**res, "readings": samples}, indent=1))
    print(json.dumps(res))


def growth(samples: list[dict], budget: float) -> dict:
    """Each process's median reading over the last quarter of the run against its median over the
    quarter after the warm-up (the first quarter). Medians, because a learner's RSS swings with the
    batch it is on (activations): one reading against another would measure where in a step each fell.
    `rss_last_over_first` keeps that single-reading ratio too."""
    out: dict = {"rss_growth": {}, "fd_growth": {}, "rss_last_over_first": {}}
    for role in ("executor", "forkserver", "ref_server", "gen_worker", "learner"):
        seen = [s for s in samples if role in s]
        early = [s[role] for s in seen if budget / 4 <= s["t"] < budget / 2]
        late = [s[role] for s in seen if s["t"] >= 3 * budget / 4]
        if not early or not late or len({s[role]["pid"] for s in seen}) != 1:
            continue  # not seen in both windows, or restarted (then growth is not one process's)
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        out["rss_growth"][role] = round(med(late, "rss_mb") / med(early, "rss_mb"), 3)
        out["fd_growth"][role] = round(med(late, "fds") / med(early, "fds"), 3)
        out["rss_last_over_first"][role] = round(late[-1]["rss_mb"] / early[0]["rss_mb"], 3)
    out["rss_growth_max"] = max(out["rss_growth"].values(), default=None)
    out["fd_growth_max"] = max(out["fd_growth"].values(), default=None)
    return out


def accounting(run_dir: Path, cfg, summary: dict) -> dict:
    """Lost: samples the reference server took in that are in no account. Duplicated: sample ids
    trained more than once. Overfull: groups with more samples trained than one rollout of them holds."""
    dump = run_dir / "logs" / "samples.jsonl"
    rows = [json.loads(line) for line in dump.read_text().splitlines()] if dump.is_file() else []
    per = Counter((r["group_id"], r["source"]) for r in rows)
    cap = {"policy": cfg.rollout.group_size, "teacher": cfg.teacher.traces_per_group}
    ids = Counter(r["sample_id"] for r in rows)
    q = summary.get("ref_server_accounting") or {}
    return {"trained_samples": len(rows), "learner_samples": summary.get("samples"),
            "groups": len({g for g, _ in per}), "distinct_ids": len(ids),
            "duplicated": sum(1 for n in ids.values() if n > 1),
            "overfull_groups": sum(1 for (_, src), n in per.items() if n > cap.get(src, 1)),
            "samples_received": summary.get("policy_samples_received"),
            "dropped_stale": summary.get("dropped_stale"), "stale_drop_fraction": summary.get("stale_drop_fraction"),
            # in the reference server's books: every sample taken in is delivered, dropped (counted) or held
            "lost": None if not q else q["samples_in"] - q["samples_out"] - q["dropped_stale"] - q["dropped_failed"]
            - q["samples"],
            "delivered_not_trained": None if not q else q["samples_out"] - len(rows)}


if __name__ == "__main__":
    main()
