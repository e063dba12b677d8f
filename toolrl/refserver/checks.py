"""What an uploaded sample must satisfy before it is queued, with or without a reference model.

`toolrl.protocol.Sample` already checks the shape (lengths of loss_mask/logprobs/ref_logprobs against
the completion, mask values, logprobs null exactly under mask 0 and finite under mask 1, rewards and
advantage finite, policy_version >= 0). This adds what the learner needs so that no sample can crash
it or dominate a step, and caps on strings so that nothing a client sends is out of proportion to a
real rollout. Every refusal names the sample and the field (HTTP 400); `Refused.field` is the stats key.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from toolrl.protocol import Sample

# Strings: far above any real rollout, far below what would matter for memory (which sample_nbytes
# counts in full anyway).
MAX_GROUP_ID_CHARS = 256
MAX_REWARDS = 64
MAX_REWARD_NAME_CHARS = 64
MAX_TOOL_CALLS = 256
MAX_TOOL_STATUS_CHARS = 32
MAX_TOOL_TEXT_CHARS = 1 << 20  # a tool call's code, and its output, each
MAX_TEXT_CHARS = 4 << 20
# Numbers: GRPO advantages are normalised (|a| <= sqrt(group size) with std scaling); rewards are
# weighted sums of small terms. Far outside these, a sample can only be a bug or an attack.
MAX_ABS_ADVANTAGE = 1e3
MAX_ABS_REWARD = 1e6
# Logprobs are <= 0; a little above 0 is numerics (bf16 engines). Below the floor a token had
# probability e^-10000: no sampler produces it, and the importance ratio would overflow.
LOGPROB_MAX = 1e-3
LOGPROB_MIN = -1e4
# How far ahead of the learner's announced version a sample may claim to be and still be waited
# for (503) rather than refused: the learner announces each version before pushing it, but a
# restarted server hears of it only at the learner's next request, and a resumed learner starts
# one above the newest worker.
MAX_VERSION_LEAD = 2


class Refused(ValueError):
    """A sample the server will not queue (HTTP 400)."""

    def __init__(self, index: int, field: str, msg: str):
        super().__init__(f"sample {index}: {field}: {msg}")
        self.index, self.field = index, field


class AheadOfLearner(Exception):
    """A sample claims a policy version the learner has not announced yet, but may be about to
    (HTTP 503: retry)."""


def _check_str(i: int, field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise Refused(i, field, f"{len(value)} characters, over the limit of {limit}")


def check_logprobs(i: int, field: str, values: Sequence[float | None]) -> None:
    vals = [x for x in values if x is not None]
    if not vals:
        return
    if not all(map(math.isfinite, vals)):  # ref_logprobs: the protocol does not check these
        raise Refused(i, field, "not finite")
    lo, hi = min(vals), max(vals)
    if lo < LOGPROB_MIN or hi > LOGPROB_MAX:
        raise Refused(i, field, f"values in [{lo:.6g}, {hi:.6g}], outside [{LOGPROB_MIN:g}, {LOGPROB_MAX:g}]")


def check_sample(i: int, s: Sample, vocab_size: int, max_len: int) -> None:
    """Raise Refused for a sample the learner must not see."""
    _check_str(i, "group_id", s.group_id, MAX_GROUP_ID_CHARS)
    _check_str(i, "text", s.text, MAX_TEXT_CHARS)
    if len(s.rewards) > MAX_REWARDS:
        raise Refused(i, "rewards", f"{len(s.rewards)} entries, over the limit of {MAX_REWARDS}")
    for name, v in s.rewards.items():
        _check_str(i, "rewards", name, MAX_REWARD_NAME_CHARS)
        if abs(v) > MAX_ABS_REWARD:
            raise Refused(i, "rewards", f"{name!r} = {v:g}, outside +-{MAX_ABS_REWARD:g}")
    if abs(s.reward) > MAX_ABS_REWARD:
        raise Refused(i, "reward", f"{s.reward:g}, outside +-{MAX_ABS_REWARD:g}")
    if abs(s.advantage) > MAX_ABS_ADVANTAGE:
        raise Refused(i, "advantage", f"{s.advantage:g}, outside +-{MAX_ABS_ADVANTAGE:g}")
    if len(s.tool_calls) > MAX_TOOL_CALLS:
        raise Refused(i, "tool_calls", f"{len(s.tool_calls)} calls, over the limit of {MAX_TOOL_CALLS}")
    for t in s.tool_calls:
        _check_str(i, "tool_calls", t.status, MAX_TOOL_STATUS_CHARS)
        _check_str(i, "tool_calls", t.code, MAX_TOOL_TEXT_CHARS)
        _check_str(i, "tool_calls", t.output, MAX_TOOL_TEXT_CHARS)
    check_logprobs(i, "logprobs", s.logprobs)
    if s.ref_logprobs is not None:
        check_logprobs(i, "ref_logprobs", s.ref_logprobs)
    if s.num_tokens > max_len:
        raise Refused(i, "length", f"{s.num_tokens} tokens, over the model's {max_len} positions")
    lo = min(min(s.prompt_ids), min(s.completion_ids, default=0))
    hi = max(max(s.prompt_ids), max(s.completion_ids, default=0))
    if lo < 0 or hi >= vocab_size:
        raise Refused(i, "token_ids", f"token ids in [{lo}, {hi}], outside the vocabulary [0, {vocab_size})")


def check_samples(samples: Sequence[Sample], vocab_size: int, max_len: int) -> None:
    seen: dict[str, int] = {}
    for i, s in enumerate(samples):
        check_sample(i, s, vocab_size, max_len)
        if (first := seen.setdefault(s.sample_id, i)) != i:  # one rollout sent twice in one upload
            raise Refused(i, "sample_id", f"{s.sample_id!r} is also sample {first}'s")


def check_versions(samples: Sequence[Sample], learner_version: int, known: bool) -> None:
    """A sample may not claim a policy newer than the learner's: it would never go stale. Refused
    when it is further ahead than a push in progress explains; AheadOfLearner (retry) when the
    learner may be about to announce that version, or has not announced any since this server
    started (a restarted server learns it from the learner's next request). A sample's newest
    token counts (toolrl.protocol.Sample.version_runs)."""
    for i, s in enumerate(samples):
        newest = s.newest_version
        lead = newest - learner_version
        if lead <= 0:
            continue
        if known and lead > MAX_VERSION_LEAD:
            raise Refused(i, "version_runs" if s.version_runs else "policy_version",
                          f"v{newest} is ahead of the learner's v{learner_version}")
        raise AheadOfLearner(f"sample {i} is from policy v{newest}, which the learner "
                             f"(v{learner_version}{'' if known else ', not announced yet'}) has not announced; retry")

