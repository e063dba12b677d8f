"""The figures the system reports, defined once: pass@k, an evaluation's rates and summary, and the
statistics of a training batch."""
from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from fractions import Fraction

from toolrl.format import extract_answer
from toolrl.grpo import zero_variance
from toolrl.protocol import TRUNCATED, Sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), for n samples with c correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def decoding(temperature: float | None) -> str:
    """How an evaluation drew its answers, as reports name it: "greedy" or "T=0.8"."""
    if temperature is None:
        return "sampled"
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def summarize(problems: list, groups: dict[str, list[Sample]], ks: list[int]) -> dict:
    """An evaluation's figures: rates over all samples, unbiased pass@k, per problem, per level and per
    kind. `problems` are toolrl.tasks.Problem; `groups` their samples by problem id."""
    samples = [s for g in groups.values() for s in g]
    n = len(samples)
    per_problem = []
    for p in problems:
        g = groups.get(p.id, [])
        answer = p.answer if len(p.answer) < 200 else p.answer[:200] + "…"  # code tasks: tests, cut
        per_problem.append({"id": p.id, "answer": answer, "n": len(g),
                            "correct": int(sum(s.rewards.get("correct", 0.0) >= 1.0 for s in g))})
    fmt = "code_format" if problems and all(p.grading == "tests" for p in problems) else "format"
    pak = {}
    for k in ks:
        vals = [pass_at_k(r["n"], r["correct"], k) for r in per_problem if r["n"] >= k]
        if vals:
            pak[str(k)] = statistics.fmean(vals)
    out = {"n_problems": len(problems), "n_samples": n, **rates(samples, fmt), "pass_at_k": pak,
           "per_problem": per_problem}
    levels = sorted({p.level for p in problems if p.level is not None})
    if len(levels) > 1:  # e.g. arithmetic:1-3: the same figures per curriculum level
        out["by_level"] = {str(lv): {"n_samples": len(g), **rates(g, fmt)} for lv in levels
                           for g in [[s for p in problems if p.level == lv for s in groups.get(p.id, [])]]}
    # Arithmetic problems have a kind (toolrl.tasks.arithmetic): the same figures per kind, in the
    # order the kinds first appear, and over the taught and the teacher-free kinds together
    kinds = list(dict.fromkeys(p.meta["kind"] for p in problems if "kind" in p.meta))
    if kinds:
        def of(keep) -> list[Sample]:
            return [s for p in problems if "kind" in p.meta and keep(p) for s in groups.get(p.id, [])]
        out["by_kind"] = {k: {"n_samples": len(g), **rates(g, fmt)} for k in kinds
                          for g in [of(lambda p, k=k: p.meta["kind"] == k)]}
        out["by_kind_set"] = {name: {"n_samples": len(g), **rates(g, fmt)}
                              for name, taught in (("taught", True), ("free", False))
                              for g in [of(lambda p, t=taught: bool(p.meta.get("taught")) is t)] if g}
        # a·b ± c kinds: which sign each answer applied, and whether the free kinds' verb decided it
        signs = {}
        for k in kinds:
            got = [applied_sign(p, extract_answer(s.text), s.rewards.get("correct", 0.0) >= 1.0)
                   for p in problems if p.meta.get("kind") == k for s in groups.get(p.id, [])]
            if got and None not in got:
                signs[k] = {x: got.count(x) / len(got) for x in ("plus", "minus", "other")}
                out["by_kind"][k]["applied"] = signs[k]
        if (v := verb_reading(signs)) is not None and "free" in out["by_kind_set"]:
            out["by_kind_set"]["free"]["verb_reading"] = v
        # kinds that write numbers "1,250": how often a program copied one (a tuple in Python)
        copied = {k: [copies_commas(s) for s in of(lambda p, k=k: p.meta["kind"] == k and p.meta.get("commas"))]
                  for k in kinds}
        for k, got in copied.items():
            if got:
                out["by_kind"][k]["commas_copied"] = sum(got) / len(got)
        if (every := [x for got in copied.values() for x in got]) and "free" in out["by_kind_set"]:
            out["by_kind_set"]["free"]["commas_copied"] = sum(every) / len(every)
    return out


def rates(samples: list[Sample], fmt: str = "format") -> dict:
    """Accuracy, format, tool use and length over samples."""
    n = len(samples)
    if not n:
        return {k: 0.0 for k in ("accuracy", "format_rate", "tool_calls_per_answer", "tool_error_rate",
                                 "code_written_rate", "code_executed_rate", "mean_completion_tokens")}
    calls = [t for s in samples for t in s.tool_calls]
    return {
        "accuracy": statistics.fmean([s.rewards.get("correct", 0.0) for s in samples]),
        "format_rate": statistics.fmean([s.rewards.get(fmt, 0.0) for s in samples]),
        "tool_calls_per_answer": len(calls) / n,
        "tool_error_rate": sum(t.status != "ok" for t in calls) / len(calls) if calls else 0.0,
        "code_written_rate": statistics.fmean([bool(s.tool_calls) for s in samples]),
        "code_executed_rate": statistics.fmean([any(t.status == "ok" for t in s.tool_calls) for s in samples]),
        "mean_completion_tokens": statistics.fmean([len(s.completion_ids) for s in samples]),
    }


def batch_stats(samples: list[Sample], version: int) -> dict[str, float]:
    """Reward per component and source, GRPO's signal, accuracy, lengths, tool use and staleness of
    one training batch. Every figure but `samples` and `reward_teacher/*` is over the policy samples."""
    own = [s for s in samples if s.source == "policy"]
    policy = own or samples
    out: dict[str, float] = {"samples": len(samples)}
    comps = sorted({k for s in policy for k in s.rewards})
    for k in comps:
        vals = [s.rewards.get(k, 0.0) for s in policy]
        out[f"reward/{k}_mean"] = statistics.fmean(vals)
        out[f"reward/{k}_std"] = statistics.pstdev(vals)
    totals = [s.reward for s in policy]
    out["reward/total_mean"] = statistics.fmean(totals)
    out["reward/total_std"] = statistics.pstdev(totals)
    # The teacher's traces score apart: mixed in, they would read as the policy doing better
    teacher = [s for s in samples if s.source == "teacher"]
    for k in sorted({k for s in teacher for k in s.rewards}):
        out[f"reward_teacher/{k}_mean"] = statistics.fmean([s.rewards.get(k, 0.0) for s in teacher])
    if teacher:
        out["reward_teacher/total_mean"] = statistics.fmean([s.reward for s in teacher])
    out.update(signal(samples))
    r = rates(policy)
    out["accuracy"] = r["accuracy"]
    out["response_len"] = statistics.fmean([sum(s.loss_mask) for s in policy])
    out["completion_len"] = r["mean_completion_tokens"]
    out["tool_calls_per_sample"] = r["tool_calls_per_answer"]
    out["tool_calls"] = sum(len(s.tool_calls) for s in own)  # the policy's own, counted
    out["tool_error_rate"] = r["tool_error_rate"]
    stale = Counter(version - s.policy_version for s in policy)  # by each sample's oldest token
    out["staleness_mean"] = sum(k * v for k, v in stale.items()) / len(policy)
    for k, v in sorted(stale.items()):
        out[f"staleness/{k}"] = v
    # by token, over the tokens the policy generated: a rollout interrupted by an update holds several versions
    lags = [version - v for s in policy for v, m in zip(s.token_versions(), s.loss_mask) if m]
    out["staleness_token_mean"] = statistics.fmean(lags) if lags else 0.0
    out["mixed_version_samples"] = sum(len(s.version_runs) > 1 for s in policy)
    out["stop/length_frac"] = sum(1 for s in policy if s.stop_reason in TRUNCATED) / len(policy)
    return out


def signal(samples: list[Sample]) -> dict[str, float]:
    """Whether GRPO has anything to learn from in a batch: a group whose rewards are all equal has
    zero advantages and so no gradient. Over the policy samples only (teacher traces have their own
    group ids and no advantage); a batch without any reads 0 groups, no signal."""
    rewards: dict[str, list[float]] = {}
    for s in samples:
        if s.source == "policy":
            rewards.setdefault(s.group_id, []).append(s.reward)
    n = sum(len(r) for r in rewards.values())
    return {"groups": len(rewards),
            "groups_with_signal": sum(not zero_variance(r) for r in rewards.values()) / max(1, len(rewards)),
            "nonzero_advantage_frac": sum(s.advantage != 0 for s in samples if s.source == "policy") / max(1, n)}


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def applied_sign(problem, answer: str | None, correct: bool = False) -> str | None:
    """Which sign an answer applied to c, for a problem a·b ± c (taught levels 2 and 3, gain, loss):
    "plus", "minus", or "other" (no number, or neither value). A `correct` answer (the grader's
    verdict, which reads more notations than this) applied the problem's own sign; any other is read
    by its last number. None for a problem of another shape."""
    nums = problem.meta.get("numbers") or {}
    if set(nums) != {"a", "b", "c"}:
        return None
    ab, c = nums["a"] * nums["b"], nums["c"]
    if correct:
        return "plus" if int(problem.answer) == ab + c else "minus"
    found = _NUMBER.findall(answer or "")
    if not found:
        return "other"
    value = Fraction(found[-1].replace(",", ""))  # exact: no float overflow or rounding
    return "plus" if value == ab + c else "minus" if value == ab - c else "other"


_SEPARATED = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?![\d.])")  # 1,250 or 12,345,678


def copies_commas(sample: Sample) -> bool:
    """A program the sample ran writes a number with thousands separators, as a question of the comma
    kinds does: `print(1,250 * 48)` prints a tuple, so the answer built on it is wrong."""
    return any(_SEPARATED.search(t.code) for t in sample.tool_calls)


def verb_reading(signs: dict[str, dict[str, float]]) -> float | None:
    """P(minus | loss) - P(minus | gain), from applied_sign's rates per kind: 1 when the policy reads
    the verb, 0 for any fixed lean toward one sign (which still solves half the teacher-free problems),
    whatever the accuracy says. None unless both kinds were evaluated."""
    if "gain" not in signs or "loss" not in signs:
        return None
    return signs["loss"]["minus"] - signs["gain"]["minus"]
