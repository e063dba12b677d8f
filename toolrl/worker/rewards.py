"""Rewards: plain callables registered by name, weighted by config.

A reward function takes a `Completion` (the model's text, what it wrote after its last tool output,
its tool calls, how its problem is graded and, for code tasks, its test results), the problem's
ground truth and the reward config, and returns a float. Users add their own with
`@register_reward("name")` and give it a weight in `rewards.weights`.

Correctness looks only at the last \\boxed{} inside the last <answer>...</answer> that the *model*
wrote after its final tool output, so a \\boxed in the reasoning or printed by a program never
counts. Where the ground truth is a plain number (arithmetic, GSM8K), the answer must be a number
as written (a decimal, or a fraction in lowest terms; units, currency and thousands separators
allowed) and is compared exactly: a calculation is not an answer. Anything else is checked with
math-verify in a separate process under a timeout, so a pathological expression can neither hang
nor crash the worker.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import multiprocessing as mp
import re
import threading
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Callable

from toolrl.config import Config, RewardConfig
from toolrl.format import (ANSWER_CLOSE, ANSWER_OPEN, THINK_ANSWER, THINK_ANSWER_STRICT, THINK_CLOSE, THINK_CODE,
                           THINK_OPEN, extract_answer, grade_plainly)
from toolrl.protocol import ToolCall
from toolrl.tasks import Grading, get_task
from toolrl.tasks.code.judge import TestResult


@dataclass
class Completion:
    text: str  # everything after the prompt, tool output included
    final_text: str  # what the model wrote after its last tool output
    tool_calls: list[ToolCall] = field(default_factory=list)
    tests: TestResult | None = None  # code tasks: the program's run against the task's tests
    grading: Grading = "answer"  # the problem's (Problem.grading): "tests" for code tasks


RewardFn = Callable[[Completion, str, "RewardConfig"], float]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str):
    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn
    return deco


# ---------------------------------------------------------------------------------------------
# Answer extraction and verification

def _verify(pred: str, gold: str, timeout_s: int) -> bool:
    from math_verify import parse, verify  # runs in the verifier's child process (and is slow to import)

    # already math (an unescaped $, or \boxed) as it is; anything else between $...$. An escaped
    # dollar (\$18, a currency) is text inside the math, not a delimiter
    wrap = lambda s: s if re.search(r"(?<!\\)\$", s) or "\\boxed" in s else f"${s}$"  # noqa: E731
    gold_p = parse(wrap(gold), parsing_timeout=timeout_s)
    pred_p = parse(wrap(pred), parsing_timeout=timeout_s)
    return bool(gold_p and pred_p and verify(gold_p, pred_p, timeout_seconds=timeout_s))


STARTUP_TIMEOUT_S = 300.0


def _warm() -> None:
    # the child's start-up: the slow import counts against no verification
    import math_verify  # noqa: F401  (warms the verifier child: its import is slow)


class VerifierUnavailable(RuntimeError):
    """The math-verify child could not start: no answer can be graded, which is the machine's doing,
    not the model's (its sample is left out and counted, never scored 0)."""


class Verifier:
    """math-verify in a spawned child process: its signal-based timeout needs a main thread, and
    a verification that still hangs gets the child killed and replaced. A child that cannot start
    raises VerifierUnavailable; one that crashes is replaced and the answer tried once more (a crash
    may be the machine's, say the OOM killer); an answer that crashes a fresh child too, hangs, or
    that math-verify cannot parse is not correct."""

    def __init__(self, timeout_s: float = 5.0):
        self.timeout_s = timeout_s
        self._pool: cf.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.timeouts = self.crashes = 0

    def _get_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
            # Start-up (spawn + importing math-verify and sympy: seconds, far more on a loaded
            # machine) must not count against a verification's timeout, or answers fail at random.
            self._pool = pool
            pool.submit(_warm).result(timeout=STARTUP_TIMEOUT_S)  # on failure the caller's _kill() cleans up
        return self._pool

    def __call__(self, pred: str, gold: str) -> bool:
        with self._lock:
            for attempt in range(2):
                try:
                    pool = self._get_pool()
                except Exception as exc:  # noqa: BLE001 - spawn, import or start-up timeout
                    self._kill()
                    raise VerifierUnavailable(f"the math-verify child process could not start: {exc!r}") from None
                try:
                    return pool.submit(_verify, pred, gold, max(1, int(self.timeout_s))).result(
                        timeout=self.timeout_s + 5)
                except cf.TimeoutError:
                    self.timeouts += 1
                    self._kill()
                    return False
                except BrokenProcessPool:
                    self.crashes += 1
                    self._kill()
                    if attempt:
                        return False  # a fresh child crashed on it too: the answer's doing
                except Exception:  # noqa: BLE001 - math-verify could not handle the answer: not correct
                    return False
            return False

    def _kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            for p in list(getattr(pool, "_processes", {}).values()):
                p.kill()
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        with self._lock:
            self._kill()


_verifier = Verifier()
atexit.register(_verifier.close)  # shut the child down before interpreter teardown, quietly


def verifier_counts() -> dict:
    """For the worker's /stats: answers whose verification hung (killed at its timeout, not correct)
    and math-verify children that crashed (the answer tried once more in a fresh one)."""
    return {"verifier_timeouts": _verifier.timeouts, "verifier_crashes": _verifier.crashes}


def is_correct(pred: str | None, gold: str, timeout_s: float = 5.0) -> bool:
    if (plain := grade_plainly(pred, gold)) is not None:  # no answer, the same text, or numbers
        return plain
    _verifier.timeout_s = timeout_s
    return _verifier(pred, gold)


# ---------------------------------------------------------------------------------------------
# Built-in rewards

def _tests(c: Completion) -> TestResult:
    if c.tests is None:
        raise ValueError("a code task's reward needs its test results (Completion.tests): the gen worker runs "
                         "them in the executor service; `evaluate.py score` does it for one program")
    return c.tests


@register_reward("correct")
def correct_reward(c: Completion, answer: str, cfg: RewardConfig) -> float:
    """Math: the boxed answer verifies against the ground truth. Code: every test passes."""
    if c.grading == "tests":
        return _tests(c).reward("all")
    return 1.0 if is_correct(extract_answer(c.final_text), answer, cfg.verify_timeout_s) else 0.0


@register_reward("tests")
def tests_reward(c: Completion, answer: str, cfg: RewardConfig) -> float:
    """Code: the fraction of the task's tests the program passes (or all-or-nothing, rewards.code_mode)."""
    return _tests(c).reward(cfg.code_mode) if c.grading == "tests" else 0.0


@register_reward("code_format")
def code_format_reward(c: Completion, answer: str, cfg: RewardConfig) -> float:
    """Thinking, then exactly one python block and nothing after it (what prompts/code.txt asks)."""
    return 1.0 if THINK_CODE.match(c.text) and c.text.count("```python") == 1 else 0.0


@register_reward("format")
def format_reward(c: Completion, answer: str, cfg: RewardConfig) -> float:
    """The think/answer structure around the whole completion, whitespace-tolerant."""
    return 1.0 if THINK_ANSWER.match(c.text) and extract_answer(c.final_text) is not None else 0.0


@register_reward("tool")
def tool_reward(c: Completion, answer: str, cfg: RewardConfig) -> float:
    """A bonus for programs that ran without error, capped (so spamming calls earns nothing more)."""
    ok = sum(1 for t in c.tool_calls if t.status == "ok")
    cap = cfg.tool_bonus_cap
    return min(ok, cap) / cap if cap else 0.0


@register_reward("digit")
def digit_reward(c: Completion, answer: str, cfg: RewardConfig) -> float:
    """The boxed answer is a plain integer (the 'int reward' of simple GRPO recipes)."""
    pred = extract_answer(c.final_text)
    return 1.0 if pred is not None and re.fullmatch(r"-?\d+", pred.replace(",", "")) else 0.0


@register_reward("mark")
def mark_reward(c: Completion, answer: str, cfg: RewardConfig) -> float:
    """A quarter point for each of the four tags appearing exactly once (xmlcount-style)."""
    return sum(0.25 for tag in (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE) if c.text.count(tag) == 1)


@register_reward("strict_format")
def strict_format_reward(c: Completion, answer: str, cfg: RewardConfig) -> float:
    return 1.0 if THINK_ANSWER_STRICT.match(c.text) else 0.0


# ---------------------------------------------------------------------------------------------
# Scoring with weights and a schedule

def weights_at(cfg: RewardConfig, version: int) -> dict[str, float]:
    """Reward weights at a policy version: linear schedules override the constant weights."""
    w = dict(cfg.weights)
    for name, s in cfg.schedule.items():
        frac = min(1.0, version / s.steps) if s.steps else 1.0
        w[name] = s.start + (s.end - s.start) * frac
    return w


def check_names(weights: dict[str, float]) -> None:
    unknown = sorted(set(weights) - set(REWARDS))
    if unknown:
        raise ValueError(f"unknown reward(s) {unknown}; registered: {sorted(REWARDS)}")


def check_reward_config(cfg: Config) -> None:
    """The rewards a config weighs fit its task (ValueError naming the field): every one registered,
    and a task graded by its tests paid by them, not by the think/answer layout it does not have
    (a shipped code recipe paid `correct` and `format`: its code_mode did nothing)."""
    r = cfg.rewards
    for key, names in (("rewards.weights", r.weights), ("rewards.schedule", r.schedule)):
        try:
            check_names(dict.fromkeys(names, 0.0))
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    paid = {k for k, v in r.weights.items() if v} | set(r.schedule)
    if get_task(cfg.data.source).grading == "tests":
        if not {"tests", "correct"} & paid:
            raise ValueError(f"rewards.weights {r.weights}: data.source {cfg.data.source} is graded by its tests; "
                             "weigh `tests` (the fraction passed, rewards.code_mode) or `correct` (all pass)")
        if "format" in paid:
            raise ValueError(f"rewards.weights: `format` pays for the <answer> layout, which data.source "
                             f"{cfg.data.source}'s answers do not have; weigh `code_format`")


def score(c: Completion, answer: str, cfg: RewardConfig, version: int = 0) -> tuple[dict[str, float], float]:
    """(components, weighted total) at a policy version. Components at weight 0 are still logged,
    and `correct` and the format always are: accuracy, pass@k, the curriculum and the teacher's
    decay read the one, the format rate the other (it read 0 where no weight named it)."""
    weights = weights_at(cfg, version)
    check_names(weights)
    always = {"correct": 0.0, ("code_format" if c.grading == "tests" else "format"): 0.0}
    comps = {name: float(REWARDS[name](c, answer, cfg)) for name in {**always, **weights}}
    return comps, sum(weights[n] * comps[n] for n in weights)
