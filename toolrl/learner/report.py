"""End-of-run report for launch.sh: summary.json, a sync check of every worker, and a PNG of the curves.

    python -m toolrl.learner.report RUN_DIR --config CFG [--set ...] --wall-s S

The sync check asks each live worker for a probe (`POST /probe`) and scores the same tokens
with the learner's exported weights in transformers: a worker that really holds the final policy
matches to a small tolerance, and differs from the base model.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx

from toolrl.config import add_config_args, config_from_args
from toolrl.logprobs import sample_logprobs
from toolrl.metrics import decoding
from toolrl.models import resolve_model
from toolrl.net import auth_headers
from toolrl.protocol import Sample
from toolrl.refserver.client import RefServerClient

PROBE_TEXT = "Question: A box holds 12 rows of 7 eggs. How many eggs?\n"


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a run's jsonl log (logs/metrics.jsonl, logs/eval.jsonl); none if it is missing."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_per_step(rows: list[dict]) -> list[dict]:
    """One row a step, the last logged, in step order: a resumed run logs again the steps taken
    after its checkpoint (the log is appended to), which summed twice and drew the curves back."""
    return sorted({r["step"]: r for r in rows if "step" in r}.values(), key=lambda r: r["step"])


def heldout(evals: list[dict]) -> dict:
    """Before/after figures of the learner's held-out evaluations (eval.before_after)."""
    out = {}
    for when, rows in (("before", [e for e in evals if e["tag"] == "before"]),
                       ("after", [e for e in evals if e["tag"] == "after"])):
        if rows:
            e = rows[-1]
            out.update({f"heldout_accuracy_{when}": e["accuracy"],
                        f"heldout_tool_calls_per_answer_{when}": e["tool_calls_per_answer"],
                        f"heldout_code_executed_rate_{when}": e.get("code_executed_rate"),
                        f"heldout_format_rate_{when}": e["format_rate"],
                        f"heldout_policy_version_{when}": e["policy_version"]})
            for name, sub in (e.get("by_kind_set") or {}).items():  # taught / teacher-free kinds
                out[f"heldout_{name}_accuracy_{when}"] = sub["accuracy"]
                if "verb_reading" in sub:  # gain and loss: does the verb decide the sign (metrics.summarize)
                    out[f"heldout_{name}_verb_reading_{when}"] = sub["verb_reading"]
                if "commas_copied" in sub:  # comma kinds: programs that copied "1,250" (a tuple)
                    out[f"heldout_{name}_commas_copied_{when}"] = sub["commas_copied"]
    if evals:
        out["heldout_problems"] = evals[-1]["n_problems"]
        out["heldout_samples"] = evals[-1]["n_samples"]
        out["heldout_temperature"] = evals[-1].get("temperature")  # 0: greedy (eval.temperature)
    return out


def probe_workers(cfg, workers: list[dict], export_dir: Path) -> list[dict]:
    """Each worker's probe logprobs vs the exported policy (and vs the base model). The probe
    carries the rollout token, so only workers the learner trusts with its weights are asked
    (toolrl.weightsync.pusher.trusted_workers); the others are listed with `probe_skipped`."""
    import torch  # lazy, as transformers and the pusher below: the report's other parts need none
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolrl.weightsync.pusher import trusted_workers

    workers, refused = trusted_workers(cfg, workers)
    skipped = [{"id": w["id"], "policy_version": int(w.get("policy_version", 0)), "url": w["url"],
                "probe_skipped": "untrusted host: the reference server takes registrations without a token "
                                 "and the host is not in rollout.trusted_hosts"} for w in refused]
    if not workers:
        return skipped
    tok = AutoTokenizer.from_pretrained(export_dir)
    prompt = tok.encode(PROBE_TEXT)
    models = {"export": AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval(),
              "base": AutoModelForCausalLM.from_pretrained(resolve_model(cfg.model.name), dtype=torch.float32).eval()}
    out = []
    for w in workers:
        row = {"id": w["id"], "policy_version": int(w.get("policy_version", 0)), "url": w["url"]}
        try:
            r = httpx.post(f"{w['url']}/probe", json={"prompt_ids": prompt, "max_tokens": 16, "seed": 7},
                           headers=auth_headers(cfg.rollout.token), timeout=300)
            r.raise_for_status()
            p = r.json()
            row["policy_version"] = p["policy_version"]
            s = Sample(prompt_ids=prompt, completion_ids=p["token_ids"], loss_mask=[1] * len(p["token_ids"]),
                       logprobs=[0.0] * len(p["token_ids"]), group_id="probe")
            for name, model in models.items():
                ref = sample_logprobs(model, [s], temperature=p["temperature"])[0]
                row[f"probe_max_abs_diff_{name}"] = max((abs(a - b) for a, b in zip(p["logprobs"], ref)), default=0.0)
        except Exception as exc:  # a dead worker is reported, not fatal to the report
            row["probe_error"] = f"{type(exc).__name__}: {exc}"
        out.append(row)
    return out + skipped


def plot(metrics: list[dict], path: Path, evals: list[dict] = ()) -> None:
    """curves.png: the run's curves (`curves`)."""
    curves(metrics, evals).savefig(path, dpi=100)


def curves(metrics: list[dict], evals: list[dict] = ()):
    """The run's curves as a matplotlib Figure, a panel each, from metrics.jsonl and eval.jsonl rows.
    Whether GRPO has signal and what the teacher weighs sit next to reward and accuracy, so a run that
    learns only from its teacher reads as one. A key an older run (or another task) did not log leaves
    its series out, and a panel with none says "not logged": nothing here fails for want of a key."""
    from matplotlib.figure import Figure  # lazy: only the curves need matplotlib (no pyplot: no backend state)

    fig = Figure(figsize=(16, 11.5))
    panels = (_reward, _accuracy, _signal, _losses, _kl_or_entropy, _tools, _lengths, _stale, _step_time)
    for ax, panel in zip(fig.subplots(3, 3).flat, panels):
        twin = panel(ax, metrics, evals)  # a second y axis, for a panel that has one
        if twin is not None and not twin.get_legend_handles_labels()[0]:
            twin.set_visible(False)  # nothing logged for it
        handles = [h for a in (ax, twin) if a is not None for h in a.get_legend_handles_labels()[0]]
        if twin is not None:  # the legend (on ax) above the twin's lines, which matplotlib draws later
            ax.set_zorder(twin.get_zorder() + 1)
            ax.patch.set_visible(False)
        if handles:
            ax.legend(handles, [h.get_label() for h in handles], fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# Each panel draws on its axes from the rows and returns its twin y axis, if it made one.
# A series is the steps at which its key was logged, with the values there.

def _series(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return ([x for x, _ in pts], [y for _, y in pts])


def _line(ax, rows: list[dict], key: str, label: str, **kw) -> None:
    xs, ys = _series(rows, key)
    if xs:
        ax.plot(xs, ys, marker="o", ms=3, label=label, **kw)


def _reward(ax, rows, evals):
    ax.set_title("reward (total)")
    _line(ax, rows, "reward/total_mean", "policy samples")
    _line(ax, rows, "reward_teacher/total_mean", "teacher traces", linestyle="--", color="tab:grey")


def _accuracy(ax, rows, evals):
    """Training batches as a line, held-out evaluations as markers only: a line between two evaluations
    would read as progress measured in between, and none was."""
    ax.set_title("accuracy")
    _line(ax, rows, "accuracy", "policy samples (training batch)")
    pts = [(e["step"], e["accuracy"]) for e in evals if isinstance(e.get("accuracy"), (int, float))]
    if pts:
        n, how = evals[-1].get("n_samples"), decoding(evals[-1].get("temperature"))
        ax.plot(*zip(*pts), linestyle="none", marker="s", ms=7, color="tab:red", gid="heldout",
                label="held-out" + (f" ({n} samples, {how})" if n else ""))
        for x, y in pts:
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8,
                        color="tab:red", bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})
    ax.set_ylim(-0.05, 1.1)


def _signal(ax, rows, evals):
    """GRPO learns only from groups whose rewards differ; the teacher weight is on the same 0-1 axis."""
    ax.set_title("learning signal")
    _line(ax, rows, "groups_with_signal", "groups with reward variance")
    _line(ax, rows, "nonzero_advantage_frac", "samples with advantage != 0")
    _line(ax, rows, "w_teacher", "teacher weight (w_teacher)", linestyle="--")
    top = max([1.0] + _series(rows, "w_teacher")[1])  # grpo.w_teacher may be set above 1
    ax.set_ylim(-0.05, top + 0.05)


def _losses(ax, rows, evals):
    ax.set_title("loss terms (unweighted)")
    for key, label in (("loss_grpo", "GRPO"), ("loss_sft_teacher", "SFT teacher"), ("loss_sft_self", "SFT self")):
        _line(ax, rows, key, label)


def _kl_or_entropy(ax, rows, evals):
    """The KL is 0 by construction with beta 0: then entropy and the clip fraction say more."""
    if any((r.get("kl") or 0) > 0 for r in rows):  # NaN: the GRPO term did not run that step
        ax.set_title("KL to reference")
        _line(ax, rows, "kl", "KL")
        return None
    ax.set_title("entropy, clip fraction")
    _line(ax, rows, "entropy", "entropy")
    twin = ax.twinx()
    _line(twin, rows, "clip_frac", "clip fraction", color="tab:orange")
    return twin


def _with_rate(ax, rows, title: str, key: str, label: str, rate_key: str, rate_label: str):
    """A panel of one figure, with a rate (0-1, dashed) on its own axis."""
    ax.set_title(title)
    _line(ax, rows, key, label)
    twin = ax.twinx()
    _line(twin, rows, rate_key, rate_label, color="tab:red", linestyle="--")
    twin.set_ylim(-0.05, 1.05)
    return twin


def _tools(ax, rows, evals):
    return _with_rate(ax, rows, "tool use", "tool_calls_per_sample", "tool calls / sample",
                      "tool_error_rate", "tool error rate")


def _lengths(ax, rows, evals):
    return _with_rate(ax, rows, "response length, truncation", "response_len", "response tokens (policy-made)",
                      "stop/length_frac", "truncated")


def _stale(ax, rows, evals):
    """The reference server's count is cumulative: a step's drops are its increase (a restarted server
    counts from 0 again)."""
    ax.set_title("stale drops")
    xs, total = _series(rows, "queue/dropped_stale")
    if xs:
        per_step = [t - p if t >= p else t for p, t in zip([0.0] + total, total)]
        ax.bar(xs, per_step, color="tab:grey", alpha=0.5, label="dropped stale this step")
        ax.set_ylim(0, max([1.0] + per_step) * 1.1)  # counts: from 0, and a visible axis when all are 0
    twin = ax.twinx()
    _line(twin, rows, "queue/stale_drop_fraction", "fraction of policy samples (run)", color="tab:red")
    twin.set_ylim(-0.05, 1.05)
    return twin


def _step_time(ax, rows, evals):
    ax.set_title("step time (s)")
    parts = [("time_wait_s", "wait for batch"), ("time_compute_s", "compute"), ("time_sync_s", "weight sync")]
    logged = [r for r in rows if all(isinstance(r.get(k), (int, float)) for k, _ in parts)]
    if not logged:
        _line(ax, rows, "step_time_s", "step")
        return None
    xs, bottom = [r["step"] for r in logged], [0.0] * len(logged)
    for key, label in parts:
        ys = [r[key] for r in logged]
        ax.bar(xs, ys, bottom=bottom, label=label)
        bottom = [b + y for b, y in zip(bottom, ys)]
    return None


def summarize(cfg, run_dir: Path, wall_s: float) -> dict:
    metrics = last_per_step(read_jsonl(run_dir / "logs" / "metrics.jsonl"))
    workers: list[dict] = []
    queue: dict = {}
    try:
        with RefServerClient(cfg.ref_server.url, token=cfg.ref_server.token, timeout_s=10) as ref:
            workers = ref.workers()
            queue = ref.stats()["queue"]
    except Exception as exc:
        print(f"[report] could not list workers: {exc}")
    export = run_dir / "export"
    if workers and (export / "config.json").is_file():
        workers = probe_workers(cfg, workers, export)
    else:
        workers = [{"id": w["id"], "policy_version": int(w.get("policy_version", 0))} for w in workers]
    first, last = (metrics[0], metrics[-1]) if metrics else ({}, {})
    summary = {
        "steps": int(last.get("step", 0)),
        "policy_version": int(last.get("policy_version", 0)),
        "workers": workers,
        "samples": int(sum(m.get("samples", 0) for m in metrics)),
        "tool_calls": int(sum(m.get("tool_calls", 0) for m in metrics)),  # the policy samples' calls
        "reward_first": first.get("reward/total_mean"),
        "reward_last": last.get("reward/total_mean"),
        "accuracy_first": first.get("accuracy"),
        "accuracy_last": last.get("accuracy"),
        "wall_s": wall_s,
        # policy samples generated and then dropped because the learner had moved past them
        "policy_samples_received": queue.get("policy_in"),
        "dropped_stale": queue.get("dropped_stale"),
        "stale_drop_fraction": queue.get("stale_drop_fraction", last.get("queue/stale_drop_fraction")),
        # every sample the reference server took in is delivered, dropped (counted) or still held
        "ref_server_accounting": {k: queue.get(k) for k in ("samples_in", "samples_out", "dropped_stale",
                                                            "dropped_failed", "samples")} if queue else None,
    }
    evals = read_jsonl(run_dir / "logs" / "eval.jsonl")
    summary.update(heldout(evals))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if metrics:
        plot(metrics, run_dir / "curves.png", evals)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--wall-s", type=float, default=0.0)
    add_config_args(parser)
    args = parser.parse_args()
    cfg = config_from_args(args)
    s = summarize(cfg, Path(args.run_dir), args.wall_s)
    print(f"steps {s['steps']}  policy v{s['policy_version']}  samples {s['samples']}  tool calls {s['tool_calls']}  "
          f"reward {s['reward_first']} -> {s['reward_last']}  wall {s['wall_s']:.0f}s")
    if "heldout_accuracy_after" in s:
        before = s.get("heldout_accuracy_before")
        print(f"held-out accuracy ({s['heldout_samples']} samples, {decoding(s.get('heldout_temperature'))}): "
              + (f"{before:.3f} before -> " if before is not None else "")
              + f"{s['heldout_accuracy_after']:.3f} after;  tool calls per answer "
              + (f"{s['heldout_tool_calls_per_answer_before']:.2f} -> " if before is not None else "")
              + f"{s['heldout_tool_calls_per_answer_after']:.2f}")
    for w in s["workers"]:
        print(f"  worker {w['id']}: v{w['policy_version']}  "
              + ("probe error " + w["probe_error"] if "probe_error" in w else
                 "not probed: " + w["probe_skipped"] if "probe_skipped" in w else
                 f"probe |Δ| vs policy {w.get('probe_max_abs_diff_export', float('nan')):.2e}, "
                 f"vs base {w.get('probe_max_abs_diff_base', float('nan')):.2e}"))


if __name__ == "__main__":
    main()
