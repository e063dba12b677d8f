"""The figures the system reports: unbiased pass@k, an evaluation's rates by level, batch statistics."""
import itertools

import pytest

from toolrl.config import DataConfig
from toolrl.metrics import applied_sign, batch_stats, decoding, pass_at_k, summarize
from toolrl.protocol import Sample, ToolCall
from toolrl.tasks import Problem, load_task


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (5, 2), (10, 3), (10, 10), (7, 0)])
def test_pass_at_k_is_the_unbiased_estimator(n, c):
    # brute force: the fraction of k-subsets of the n samples that contain a correct one
    outcomes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="at least"):
        pass_at_k(n, c, n + 1)


def test_summary_breaks_mixed_levels_down():
    problems = load_task("arithmetic:1-2", 4, 3, DataConfig())

    def s(correct, fmt, call):
        calls = [ToolCall(code="print(1)", status=call, output="1")] if call else []
        return Sample(prompt_ids=[1], completion_ids=[2, 3], loss_mask=[1, 1], logprobs=[-1.0, -1.0],
                      rewards={"correct": correct, "format": fmt}, group_id="g", tool_calls=calls)

    groups = {problems[0].id: [s(1.0, 1.0, "ok")], problems[2].id: [s(0.0, 1.0, "error")],
              problems[1].id: [s(0.0, 0.0, None)], problems[3].id: [s(0.0, 1.0, None)]}
    out = summarize(problems, groups, [1])
    assert out["accuracy"] == 0.25 and out["format_rate"] == 0.75
    l1, l2 = out["by_level"]["1"], out["by_level"]["2"]
    assert (l1["accuracy"], l1["code_written_rate"], l1["code_executed_rate"]) == (0.5, 1, 0.5)
    assert l1["tool_error_rate"] == 0.5
    assert (l2["accuracy"], l2["format_rate"], l2["code_written_rate"]) == (0.0, 0.5, 0.0)


def test_batch_stats_count_the_policy_samples_their_staleness_and_truncation():
    def s(correct, version, stop, source="policy", calls=(), runs=()):
        return Sample(prompt_ids=[1], completion_ids=[2, 3, 4], loss_mask=[1, 0, 1], logprobs=[-1.0, None, -1.0],
                      rewards={"correct": correct}, reward=correct, group_id="g", policy_version=version,
                      version_runs=list(runs), stop_reason=stop, source=source,
                      tool_calls=[ToolCall(code="x", status=c, output="") for c in calls])

    # the second sample was interrupted by an update after its tool output: tokens of v2, then v3
    batch = [s(1.0, 3, "eos", calls=["ok"]), s(0.0, 2, "length", calls=["error", "ok"], runs=[(0, 2), (2, 3)]),
             s(0.0, 3, "max_tool_calls"), s(1.0, 3, "eos", source="teacher")]
    out = batch_stats(batch, version=3)
    assert out["samples"] == 4 and out["accuracy"] == pytest.approx(1 / 3)  # the teacher trace is not counted
    assert out["tool_calls_per_sample"] == 1.0 and out["tool_error_rate"] == pytest.approx(1 / 3)
    assert out["staleness/0"] == 2 and out["staleness/1"] == 1 and out["staleness_mean"] == pytest.approx(1 / 3)
    # by generated token: 6 tokens, of which only the interrupted sample's first is a version behind
    assert out["staleness_token_mean"] == pytest.approx(1 / 6) and out["mixed_version_samples"] == 1
    assert out["stop/length_frac"] == pytest.approx(1 / 3)
    assert out["response_len"] == 2 and out["completion_len"] == 3


def signal_batch() -> list[Sample]:
    """Three groups of policy samples, two with reward variance (one of whose samples sits at its
    group's mean: advantage 0) and one flat, and two teacher traces."""
    def s(gid, correct, fmt, adv, source="policy"):
        return Sample(prompt_ids=[1], completion_ids=[2], loss_mask=[1], logprobs=[-1.0], group_id=gid,
                      rewards={"correct": correct, "format": fmt}, reward=correct + 0.2 * fmt, advantage=adv,
                      source=source)

    return [s("a", 1.0, 1.0, 1.0), s("a", 0.0, 1.0, -1.0),
            s("b", 1.0, 0.0, 0.5), s("b", 0.0, 0.0, -1.0), s("b", 0.5, 0.0, 0.0),
            s("c", 0.0, 1.0, 0.0), s("c", 0.0, 1.0, 0.0),
            # teacher traces: group ids of their own, as the producer names them (an advantage, were one
            # set, is still not GRPO's)
            s("c:teacher0", 1.0, 1.0, 0.0, "teacher"), s("a:teacher0", 1.0, 0.0, 1.0, "teacher")]


def test_batch_stats_say_how_much_signal_grpo_has_and_score_the_teacher_apart():
    batch = signal_batch()
    out = batch_stats(batch, version=0)
    assert out["groups"] == 3 and out["groups_with_signal"] == pytest.approx(2 / 3)
    assert out["nonzero_advantage_frac"] == pytest.approx(4 / 7)
    # policy rewards are the policy's only; the teacher's are under their own prefix
    assert out["reward/correct_mean"] == pytest.approx(2.5 / 7) and out["accuracy"] == pytest.approx(2.5 / 7)
    assert out["reward_teacher/correct_mean"] == 1.0 and out["reward_teacher/format_mean"] == 0.5
    assert out["reward_teacher/total_mean"] == pytest.approx(1.1)
    assert not [k for k in out if k.startswith("reward_teacher/") and k.endswith("_std")]

    # without teacher traces there is no teacher figure at all (a 0 would read as a teacher scoring 0)
    plain = batch_stats(batch[:7], version=0)
    assert not [k for k in plain if k.startswith("reward_teacher/")]
    assert plain["groups_with_signal"] == out["groups_with_signal"]
    # a batch of one flat group: no signal at all
    flat = batch_stats(batch[5:7], version=0)
    assert (flat["groups"], flat["groups_with_signal"], flat["nonzero_advantage_frac"]) == (1, 0.0, 0.0)


def test_summary_breaks_kinds_down_and_the_teacher_free_ones_together():
    problems = load_task("arithmetic:1-3@taught,verbs", 10, 3, DataConfig())  # product .. loss, twice

    def s(correct):
        return Sample(prompt_ids=[1], completion_ids=[2], loss_mask=[1], logprobs=[-1.0],
                      rewards={"correct": correct, "format": 1.0}, group_id="g")

    right = {"product": 1.0, "product_plus": 0.0, "product_minus": 1.0, "gain": 1.0, "loss": 0.0}
    groups = {p.id: [s(right[p.meta["kind"]]), s(0.0 if i >= 5 else right[p.meta["kind"]])]
              for i, p in enumerate(problems)}
    out = summarize(problems, groups, [1])
    assert list(out["by_kind"]) == ["product", "product_plus", "product_minus", "gain", "loss"]
    assert {k: v["accuracy"] for k, v in out["by_kind"].items()} == {
        "product": 0.75, "product_plus": 0.0, "product_minus": 0.75, "gain": 0.75, "loss": 0.0}
    assert all(v["n_samples"] == 4 for v in out["by_kind"].values())
    sets = out["by_kind_set"]
    assert (sets["taught"]["n_samples"], sets["free"]["n_samples"]) == (12, 8)
    assert (sets["taught"]["accuracy"], sets["free"]["accuracy"]) == (0.5, 0.375)
    # only taught kinds: no free set; problems without kinds (other families): no breakdown at all
    taught_only = summarize(problems[:3], {p.id: groups[p.id] for p in problems[:3]}, [1])
    assert list(taught_only["by_kind_set"]) == ["taught"]
    plain = [Problem(id=p.id, question=p.question, answer=p.answer) for p in problems[:2]]
    assert "by_kind" not in summarize(plain, {p.id: groups[p.id] for p in plain}, [1])


def test_summary_says_which_sign_the_answers_applied_and_whether_the_verb_decided_it():
    """For a·b ± c kinds, by_kind[k]["applied"] counts plus / minus / other from each boxed answer,
    and by_kind_set.free.verb_reading is P(minus | loss) - P(minus | gain): a lean toward one sign
    reads 0 however many it solves."""
    problems = load_task("arithmetic:1-3@taught,verbs", 10, 3, DataConfig())  # product .. loss, twice

    def s(p, sign):
        n = p.meta["numbers"]
        value = 7 if sign == "other" else n["a"] * n["b"] + (n["c"] if sign == "plus" else -n["c"])
        text = f"<think>\nok\n</think>\n<answer>\n\\boxed{{{value:,}}}\n</answer>"  # a comma still reads
        return Sample(prompt_ids=[1], completion_ids=[2], loss_mask=[1], logprobs=[-1.0],
                      rewards={"correct": 0.0, "format": 1.0}, group_id="g", text=text)

    def run(signs):  # kind -> the signs its 4 samples (2 problems x 2) applied
        groups = {}
        for p in problems:
            k = p.meta["kind"]
            i = sum(q.meta["kind"] == k for q in problems[:problems.index(p)])
            groups[p.id] = [s(p, x) for x in signs.get(k, ["other"] * 4)[2 * i:2 * i + 2]]
        return summarize(problems, groups, [1])

    leaning = run({"gain": ["minus"] * 4, "loss": ["minus"] * 4})  # solves every loss, no gain
    assert leaning["by_kind"]["gain"]["applied"] == {"plus": 0.0, "minus": 1.0, "other": 0.0}
    assert leaning["by_kind_set"]["free"]["verb_reading"] == 0.0
    reading = run({"gain": ["plus", "plus", "plus", "minus"], "loss": ["minus", "minus", "other", "plus"],
                   "product_plus": ["plus", "other", "minus", "plus"]})
    assert reading["by_kind"]["loss"]["applied"] == {"plus": 0.25, "minus": 0.5, "other": 0.25}
    assert reading["by_kind"]["product_plus"]["applied"] == {"plus": 0.5, "minus": 0.25, "other": 0.25}
    assert reading["by_kind_set"]["free"]["verb_reading"] == 0.25  # 0.5 - 0.25
    assert "applied" not in reading["by_kind"]["product"]  # a·b: no c, no sign
    # the grader's verdict decides a correct answer's sign (it reads notations this parser does not);
    # a wrong one is read by its last number, exactly: huge, infinite or fractional ones are "other"
    gain = next(p for p in problems if p.meta["kind"] == "gain")
    n = gain.meta["numbers"]
    v = str(n["a"] * n["b"] + n["c"])
    latex = f"\\${v[:-3]}{{,}}{v[-3:]} bees"  # e.g. \$14{,}624 bees: math-verify reads it, this parser not
    assert applied_sign(gain, latex, True) == "plus" and applied_sign(gain, latex) == "other"
    assert applied_sign(gain, f"{n['a'] * n['b'] - n['c']:,} bees") == "minus"
    for odd in ("inf", "1e999", "9" * 400, f"{n['a'] * n['b'] + n['c']}.5", None, "many"):
        assert applied_sign(gain, odd) == "other", odd
    # without both free kinds there is no verb to read
    taught_only = summarize(problems[:3], {p.id: [s(p, "plus" if "c" in p.meta["numbers"] else "other")]
                                          for p in problems[:3]}, [1])
    assert "verb_reading" not in str(taught_only)


def test_the_run_summary_carries_held_out_accuracy_of_the_taught_and_teacher_free_kinds():
    from toolrl.learner.report import heldout

    def row(tag, acc, free):
        sets = {"taught": {"accuracy": acc}, "free": {"accuracy": free}} if free is not None else None
        return {"tag": tag, "accuracy": acc, "tool_calls_per_answer": 1.0, "format_rate": 1.0, "policy_version": 3,
                "n_problems": 10, "n_samples": 10, **({"by_kind_set": sets} if sets else {})}
    out = heldout([row("before", 0.2, 0.1), row("every", 0.5, 0.3), row("after", 0.6, 0.4)])
    assert (out["heldout_free_accuracy_before"], out["heldout_free_accuracy_after"]) == (0.1, 0.4)
    read = row("after", 0.6, 0.4)
    read["by_kind_set"]["free"]["verb_reading"] = 0.25
    assert heldout([read])["heldout_free_verb_reading_after"] == 0.25
    assert "heldout_free_verb_reading_after" not in out
    read["by_kind_set"]["free"]["commas_copied"] = 0.125
    assert heldout([read])["heldout_free_commas_copied_after"] == 0.125
    assert not [k for k in out if "commas_copied" in k]
    assert out["heldout_taught_accuracy_after"] == 0.6 and out["heldout_accuracy_after"] == 0.6
    assert out["heldout_temperature"] is None  # rows from before eval.temperature
    assert heldout([{**read, "temperature": 0.0}])["heldout_temperature"] == 0.0
    assert [decoding(t) for t in (0, 0.0, 0.8, 1, None)] == ["greedy", "greedy", "T=0.8", "T=1", "sampled"]
    assert "heldout_free_accuracy_after" not in heldout([row("after", 0.6, None)])


def test_summary_counts_programs_that_copied_numbers_with_separators():
    """The comma kinds write numbers "1,250": by_kind[k]["commas_copied"] and by_kind_set.free say how
    often a program the sample ran wrote one that way (a tuple in Python); other kinds carry no such figure."""
    problems = load_task("arithmetic:1-3@taught,commas", 10, 3, DataConfig())

    def s(code):
        calls = [ToolCall(code=code, status="ok", output="")] if code else []
        return Sample(prompt_ids=[1], completion_ids=[2], loss_mask=[1], logprobs=[-1.0],
                      rewards={"correct": 0.0, "format": 1.0}, group_id="g", tool_calls=calls)

    codes = {"product_plus_commas": ["print(4,452 * 62 + 5,842)", "print(4452 * 62 + 5842)"],
             "product_minus_commas": ["x = 4452\nprint(x * 62 - 12,345,678)", None]}
    groups = {p.id: [s(c) for c in codes.get(p.meta["kind"], ["print(1,250 * 4)", None])] for p in problems}
    out = summarize(problems, groups, [1])
    assert out["by_kind"]["product_plus_commas"]["commas_copied"] == 0.5
    assert out["by_kind"]["product_minus_commas"]["commas_copied"] == 0.5
    assert out["by_kind_set"]["free"]["commas_copied"] == 0.5
    assert all("commas_copied" not in out["by_kind"][k] for k in ("product", "product_plus", "product_minus"))
    assert "commas_copied" not in out["by_kind_set"]["taught"]
    groups = {p.id: [s("print(4452 * 62)")] * 2 for p in problems}
    assert summarize(problems, groups, [1])["by_kind_set"]["free"]["commas_copied"] == 0.0
