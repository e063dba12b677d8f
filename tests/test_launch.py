"""End to end: launch.sh runs all five processes on the tiny model for 3 GRPO steps."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import ROOT, free_port  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("launch") / "run"
    ports = [f"executor.port={free_port()}", f"ref_server.port={free_port()}", f"rollout.port={free_port()}"]
    cmd = ["bash", "launch.sh", "--config", "configs/cpu_tiny.yaml", "--run-dir", str(run_dir), "--workers", "1"]
    for p in ports:
        cmd += ["--set", p]
    # Delta updates end to end (auto would send full weights on loopback). Here it costs nothing: the
    # tiny model's weights take milliseconds to encode and apply, and this run's fp32 probe (< 1e-3,
    # test_every_worker_holds_the_final_policy) sees any wrong byte the two delta syncs could leave.
    cmd += ["--set", "learner.sync_delta=on"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"launch.sh failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return run_dir, proc.stdout


def test_summary_reports_a_finished_run(run):
    run_dir, out = run
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 3 and s["policy_version"] == 3
    assert s["samples"] >= 12 and s["tool_calls"] >= s["samples"]  # every sample ran the prefill's program
    assert s["reward_first"] is not None and s["wall_s"] > 0
    assert (run_dir / "curves.png").stat().st_size > 10_000
    assert "step 3/3" in out and "all components up" in out
    for name in ("executor", "ref_server", "gen_worker_0", "learner"):
        assert (run_dir / "logs" / f"{name}.log").is_file()
    assert (run_dir / "logs" / "tensorboard").is_dir()
    assert any((run_dir / "logs" / "wandb").glob("offline-run-*"))


def test_held_out_evaluation_before_and_after(run):
    """The learner had the worker evaluate the base policy before step 1 and the final one after."""
    run_dir, out = run
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["heldout_policy_version_before"] == 0 and s["heldout_policy_version_after"] == 3
    assert s["heldout_problems"] == 4 and s["heldout_samples"] == 8
    # the prefill's program runs in every sample, so both evaluations saw one executed call per answer
    assert s["heldout_tool_calls_per_answer_before"] >= 1 and s["heldout_tool_calls_per_answer_after"] >= 1
    assert 0 <= s["heldout_accuracy_before"] <= 1 and 0 <= s["heldout_accuracy_after"] <= 1
    evals = [json.loads(line) for line in (run_dir / "logs" / "eval.jsonl").read_text().splitlines()]
    assert [(e["tag"], e["step"]) for e in evals] == [("before", 0), ("after", 3)]
    assert [p["id"] for p in evals[0]["per_problem"]] == [p["id"] for p in evals[1]["per_problem"]]  # same problems
    assert [p["id"][:8] for p in evals[0]["per_problem"]] == ["arith-L1", "arith-L2"] * 2
    assert "eval before step 0 v0" in out and "eval after step 3 v3" in out and "held-out accuracy" in out


def test_every_worker_holds_the_final_policy(run):
    run_dir, _ = run
    s = json.loads((run_dir / "summary.json").read_text())
    assert len(s["workers"]) == 1
    w = s["workers"][0]
    assert w["policy_version"] == 3
    assert w["probe_max_abs_diff_export"] < 1e-3  # the worker's logprobs are the learner's
    assert w["probe_max_abs_diff_base"] > 10 * w["probe_max_abs_diff_export"]  # and not the base model's
    # ...after deltas: the first sync is whole (the learner held no earlier version), the later ones
    # went out as deltas, under one copy (a delta refused or not applied is sent again whole)
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["sync_delta_bytes"] == 0 and rows[0]["sync_bytes"] >= rows[0]["sync_copy_bytes"] > 0
    for r in rows[1:]:
        assert 0 < r["sync_delta_bytes"] <= r["sync_bytes"] < r["sync_copy_bytes"], r
    assert "refused the delta" not in (run_dir / "logs" / "learner.log").read_text()


def test_samples_carry_masked_tool_output_and_advancing_versions(run):
    run_dir, _ = run
    rows = [json.loads(line) for line in (run_dir / "logs" / "samples.jsonl").read_text().splitlines()]
    assert rows
    for r in rows:
        assert r["tool_calls"][0] == {"code": "print(6 * 7)", "status": "ok", "output": "42\n"}
        first_tool = r["loss_mask"].index(0)
        assert first_tool == 0  # the prefill's program ran before the model wrote anything
        assert all(lp is None for lp, m in zip(r["logprobs"], r["loss_mask"]) if m == 0)
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r["policy_version"])
    assert sorted(by_step) == [1, 2, 3]
    assert min(by_step[3]) >= 2  # max_staleness 0: later steps train on samples from newer policies
    assert max(by_step[1]) == 0


def test_on_policy_steps_have_a_ratio_of_one(run):
    """fp32 and max_staleness 0: every step trains on samples of the policy it holds (staleness 0,
    counted against that policy, not the one it sends after the step), so the ratio of
    the learner's logprobs to the sampler's (vLLM's) is 1 up to float error at every trained token. A
    wrong temperature, a shifted token or a mask off by one moves it far more than 1e-4."""
    run_dir, _ = run
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert r["staleness_mean"] == 0 and r["staleness/0"] > 0, r  # against the policy the step held
        assert abs(r["ratio_mean"] - 1) < 1e-4, r
        assert abs(r["ratio_max"] - 1) < 1e-3 and abs(r["ratio_min"] - 1) < 1e-3, r


def test_every_sample_taken_in_is_trained_once_or_accounted_for(run):
    """Exactly once: no sample id in the learner's dump twice, the dump is every sample the learner
    counted, and the reference server's books balance (taken in = delivered + dropped + still held)
    with everything it delivered trained."""
    run_dir, _ = run
    s = json.loads((run_dir / "summary.json").read_text())
    ids = [json.loads(line)["sample_id"] for line in (run_dir / "logs" / "samples.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == s["samples"]
    q = s["ref_server_accounting"]
    assert q["samples_in"] == q["samples_out"] + q["dropped_stale"] + q["dropped_failed"] + q["samples"]
    assert q["samples_out"] == len(ids)


def test_checkpoints_and_export(run):
    run_dir, _ = run
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step000003"
    meta = json.loads((run_dir / "export" / "toolrl.json").read_text())
    assert meta == {"step": 3, "policy_version": 3}


def test_every_service_ran_with_a_per_run_token_kept_out_of_written_files(run):
    """launch.sh gave each service its own token (the run above worked through all of them), kept
    in a file only the user can read, and nowhere else it writes."""
    import stat

    run_dir, out = run
    env = dict(line.split("=", 1) for line in (run_dir / "tokens.env").read_text().splitlines())
    assert set(env) == {"TOOLRL_EXECUTOR_TOKEN", "TOOLRL_REF_SERVER_TOKEN", "TOOLRL_ROLLOUT_TOKEN"}
    assert len(set(env.values())) == 3 and all(len(v) >= 32 for v in env.values())
    assert stat.S_IMODE((run_dir / "tokens.env").stat().st_mode) == 0o600
    written = [out, (run_dir / "config.yaml").read_text()] + [p.read_text(errors="replace")
                                                            for p in (run_dir / "logs").glob("*.log")]
    assert not any(v in text for v in env.values() for text in written)
    assert "token: '***'" in (run_dir / "config.yaml").read_text()


def test_a_bf16_run_end_to_end(tmp_path):
    """The demo's dtype on hosts with native bf16, through the whole system: rollouts, the learner's
    mixed precision and the sync all in bf16. The worker's logprobs match the export only to bf16's
    arithmetic (docs/ARCHITECTURE.md, Precision), and still far better than the base model's."""
    run_dir = tmp_path / "run"
    ports = [f"executor.port={free_port()}", f"ref_server.port={free_port()}", f"rollout.port={free_port()}"]
    sets = ports + ["model.dtype=bfloat16", "learner.dtype=bfloat16", "learner.steps=2", "eval.before_after=false"]
    cmd = ["bash", "launch.sh", "--config", "configs/cpu_tiny.yaml", "--run-dir", str(run_dir), "--workers", "1"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"launch.sh failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 2 and s["policy_version"] == 2
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["step_applied"] == 1.0 and r["loss"] == r["loss"] and abs(r["loss"]) < 1e3 for r in rows)
    w = s["workers"][0]
    assert w["policy_version"] == 2
    assert w["probe_max_abs_diff_export"] < 0.5 and w["probe_max_abs_diff_base"] > 2 * w["probe_max_abs_diff_export"]
