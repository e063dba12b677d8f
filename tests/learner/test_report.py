"""curves.png (toolrl/learner/report.py): a panel per question, held-out evaluations as points never
joined by a line, and rows of older runs (without the newer keys) plotted without failing."""
import pytest

from toolrl.learner.report import curves, plot

TITLES = ["reward (total)", "accuracy", "learning signal", "loss terms (unweighted)", "KL to reference",
          "tool use", "response length, truncation", "stale drops", "step time (s)"]


def rows(n=6, kl=0.01):
    """metrics.jsonl rows with every key the curves read; the reference server's stale count is
    cumulative and restarts from 0 at step 5 (a restarted server)."""
    dropped = [0, 2, 2, 5, 1, 1]
    return [{"step": t, "reward/total_mean": 0.1 * t, "reward_teacher/total_mean": 1.2, "accuracy": 0.1 * t,
             "groups": 4, "groups_with_signal": 0.25 * (t % 4), "nonzero_advantage_frac": 0.1 * t,
             "w_teacher": 1 - 0.1 * t, "loss_grpo": 0.01, "loss_sft_teacher": 1 / t, "loss_sft_self": 0.0, "kl": kl,
             "entropy": 0.9, "clip_frac": 0.05, "tool_calls_per_sample": 1.5, "tool_error_rate": 0.2,
             "response_len": 120.0, "stop/length_frac": 0.1, "queue/dropped_stale": dropped[t - 1],
             "queue/stale_drop_fraction": 0.01 * t, "time_wait_s": 1.0, "time_compute_s": 10.0, "time_sync_s": 0.5,
             "step_time_s": 11.5} for t in range(1, n + 1)]


EVALS = [{"step": 0, "tag": "before", "accuracy": 0.05, "n_samples": 64},
         {"step": 3, "tag": "every", "accuracy": 0.25, "n_samples": 64},
         {"step": 6, "tag": "after", "accuracy": 0.5, "n_samples": 64}]


def panels(fig) -> dict:
    """The figure's panels by title (a twin y axis has none)."""
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def labels(ax) -> set[str]:
    return {line.get_label() for line in ax.get_lines()}


def test_held_out_evaluations_are_points_each_labelled_never_a_line():
    fig = curves(rows(), EVALS)
    acc = panels(fig)["accuracy"]
    (held,) = [line for line in acc.get_lines() if line.get_gid() == "heldout"]
    assert held.get_linestyle() == "None" and held.get_marker() == "s"
    assert list(held.get_xdata()) == [0, 3, 6] and list(held.get_ydata()) == [0.05, 0.25, 0.5]
    # every other line of the panel is the training batches', at the training steps only
    others = [line for line in acc.get_lines() if line is not held]
    assert [list(line.get_xdata()) for line in others] == [[1, 2, 3, 4, 5, 6]]
    assert sorted(t.get_text() for t in acc.texts) == ["0.05", "0.25", "0.50"]


def test_every_panel_is_drawn_from_a_full_run():
    fig = curves(rows(), EVALS)
    by_title = panels(fig)
    assert list(by_title) == TITLES
    reward = {line.get_label(): line for line in by_title["reward (total)"].get_lines()}
    assert reward["teacher traces"].get_linestyle() == "--" and reward["policy samples"].get_linestyle() == "-"
    signal = by_title["learning signal"]
    assert labels(signal) == {"groups with reward variance", "samples with advantage != 0",
                              "teacher weight (w_teacher)"}
    assert signal.get_ylim()[0] <= 0 and signal.get_ylim()[1] >= 1
    assert labels(by_title["loss terms (unweighted)"]) == {"GRPO", "SFT teacher", "SFT self"}
    # per-step drops from the cumulative count, a restarted count taken as it stands
    bars = [p.get_height() for p in by_title["stale drops"].patches]
    assert bars == [0, 2, 0, 3, 1, 0]
    assert len(by_title["step time (s)"].patches) == 3 * 6  # wait, compute, sync stacked per step
    assert not [t for ax in fig.axes for t in ax.texts if t.get_text() == "not logged"]


def test_without_kl_the_panel_shows_entropy_and_the_clip_fraction():
    fig = curves(rows(kl=0.0), EVALS)
    by_title = panels(fig)
    assert "KL to reference" not in by_title
    ax = by_title["entropy, clip fraction"]
    twin = [a for a in fig.axes if a is not ax and a.bbox.bounds == ax.bbox.bounds]
    assert labels(ax) == {"entropy"} and [labels(a) for a in twin] == [{"clip fraction"}]


@pytest.mark.parametrize("keys", [
    # what the first curves read (runs before issue 25), and a row of nothing but its step
    ("step", "reward/total_mean", "accuracy", "tool_calls_per_sample", "loss", "kl", "step_time_s"), ("step",)])
def test_rows_without_the_newer_keys_still_plot(tmp_path, keys):
    old = [{k: r.get(k, 0.5) for k in keys} for r in rows()]
    fig = curves(old, [])
    not_logged = {ax.get_title() for ax in fig.axes for t in ax.texts if t.get_text() == "not logged"}
    assert {"learning signal", "loss terms (unweighted)", "stale drops"} <= not_logged
    assert ("reward (total)" in not_logged) == ("reward/total_mean" not in keys)
    plot(old, tmp_path / "curves.png", EVALS)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_summary_counts_each_step_once_and_the_policys_own_tool_calls(tmp_path, monkeypatch):
    """A resumed run logs again the steps after its checkpoint: they were summed twice. tool_calls
    multiplied the policy's calls per sample by every sample, teacher traces too (found in review)."""
    import json

    from toolrl.config import load_config
    from toolrl.learner import report
    from toolrl.metrics import batch_stats
    from toolrl.protocol import Sample, ToolCall

    def sample(source, calls):
        return Sample(prompt_ids=[1], completion_ids=[2, 3], loss_mask=[1, 1], logprobs=[-0.1, -0.1],
                      source=source, group_id=f"g-{source}", reward=1.0, policy_version=3,
                      tool_calls=[ToolCall(code="print(1)", output="1", status="ok")] * calls)
    stats = batch_stats([sample("policy", 1), sample("policy", 2), sample("teacher", 1), sample("teacher", 1)], 3)
    assert stats["tool_calls"] == 3 and stats["samples"] == 4

    class NoServer:  # the report lists workers from the reference server: none here
        def __init__(self, *a, **k):
            raise ConnectionError("no server")
    monkeypatch.setattr(report, "RefServerClient", NoServer)
    (tmp_path / "logs").mkdir()
    steps = [1, 2, 3, 2, 3, 4]  # checkpoint at 1; steps 2 and 3 taken, lost, taken again
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "samples": 16, "tool_calls": 3, "tool_calls_per_sample": 0.375, "policy_version": s,
                    "accuracy": 0.1 * i}) + "\n" for i, s in enumerate(steps)))
    out = report.summarize(load_config("configs/cpu_tiny.yaml"), tmp_path, 60.0)
    assert (out["steps"], out["samples"], out["tool_calls"]) == (4, 64, 12)
    assert out["accuracy_last"] == 0.5  # the last row logged for step 4
