"""gen_worker.py --rollout-only: scored samples to JSONL, no reference server (the tiny model; alone,
not beside test_gen_worker.py's worker, whose rollouts would share the two cores)."""
import json

import pytest

from procs import Proc  # tests/ is on sys.path (conftest)
from toolrl.config import load_config

pytestmark = pytest.mark.slow


def test_rollout_only_writes_scored_jsonl(executor, tmp_path):
    out = tmp_path / "roll.jsonl"
    p = Proc("rollout_only", ["gen_worker.py", "--config", "configs/cpu_tiny.yaml", "--set",
                              f"executor.url={executor}", "--rollout-only", "--num-prompts", "2",
                              "--out", str(out)], tmp_path)
    try:
        assert p.p.wait(timeout=600) == 0, p.tail()
    finally:
        p.stop()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cfg = load_config("configs/cpu_tiny.yaml")
    assert len(rows) == 2 * cfg.rollout.group_size
    for r in rows:
        assert {"prompt_ids", "completion_ids", "loss_mask", "logprobs", "rewards", "advantage", "tool_calls",
                "text", "policy_version", "stop_reason"} <= set(r)
        assert len(r["logprobs"]) == len(r["completion_ids"]) == len(r["loss_mask"])
        assert all((lp is None) == (m == 0) for lp, m in zip(r["logprobs"], r["loss_mask"]))
        assert set(r["rewards"]) == {"correct", "format", "tool"}
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r["advantage"])
    assert all(abs(sum(a)) < 1e-6 for a in groups.values())  # group-relative
    summary = json.loads([ln for ln in p.log.read_text().splitlines() if ln.startswith("{")][-1])
    assert summary["written"] == len(rows)
