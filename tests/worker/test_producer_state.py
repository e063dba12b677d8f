"""The producer's state for a restart from a checkpoint: a restored producer draws exactly the problems,
and moves the curriculum exactly as, the uninterrupted one would. The real producer loop runs on a
fake agent (no engine, no executor): what is tested is the bookkeeping, not the rollouts."""
import asyncio
import contextlib
import json
from types import SimpleNamespace

import pytest

from toolrl.config import load_config
from toolrl.worker.producer import Producer


class FakeAgent:
    """What Producer.rollout_group asks of an agent: every group scores accuracy `acc`; `hold`, when
    set, keeps the rollouts waiting until it is set."""

    def __init__(self, name="w1"):
        self.name, self.gate, self.acc, self.hold, self.seen = name, None, 0.5, None, []

    def gated(self):
        return contextlib.nullcontext(0)

    def group_id(self, problem_id):
        return f"{self.name}:{problem_id}"

    def prompt_ids(self, question):
        return [1]

    async def rollouts(self, prompt, gid, n, versions=None, seed_key=None):
        if self.hold is not None:
            await self.hold.wait()
        return [SimpleNamespace(stop_reason="stop", generated=1, tool_calls=[], interruptions=0) for _ in range(n)]

    async def run_tests(self, problem, rolls):
        return None

    def score(self, problem, rolls, gid, version, tests):
        self.seen.append(problem.id)
        right = round(self.acc * len(rolls))
        return [SimpleNamespace(rewards={"correct": float(i < right)}, reward=float(i < right), version_runs=[],
                                source="policy")
                for i in range(len(rolls))]


def producer(*sets, name="w1"):
    cfg = load_config("configs/cpu_demo.yaml", ["data.level=1", "data.max_level=3", "data.promote_window=2",
                                                "data.promote_at_accuracy=0.8", "teacher.traces_per_group=0",
                                                "rollout.prompts_per_step=3", "rollout.group_size=4",
                                                "grpo.drop_zero_std_groups=false", *sets])
    return Producer(cfg, FakeAgent(name))


def produce(p, n):
    """The ids of the problems of `n` groups through the real producer loop."""
    async def go():
        return [g async for g in p.produce(n_groups=n)]
    before = len(p.agent.seen)
    asyncio.run(go())
    return sorted(p.agent.seen[before:])


@pytest.mark.parametrize("mix", ["false", "true"])
def test_a_restored_producer_continues_the_stream_and_curriculum(mix):
    a = producer(f"data.mix_levels={mix}")
    produce(a, 5)  # level 1, accuracy 0.5: no promotion
    assert a.level == 1 and a.state()["drawn"] == 5 and a.state()["groups"] == 5
    a.agent.acc = 1.0
    produce(a, 2)  # windows (0.5, 1.0), then (1.0, 1.0): promoted
    assert a.level == 2 and a.state()["drawn"] == 0  # the curriculum started the level-2 stream afresh
    a.agent.acc = 0.5
    produce(a, 4)
    state = json.loads(json.dumps(a.state()))  # what travels through the reference server
    assert state == {"source": "arithmetic", "level": 2, "drawn": 4, "recent_acc": [0.5, 0.5], "groups": 11}

    b = producer(f"data.mix_levels={mix}")
    b.restore(state)
    assert b.state() == state
    ahead = [a.next_problem() for _ in range(6)]
    assert [b.next_problem() for _ in range(6)] == ahead
    assert ahead[0][1].level == 2 or mix == "true"
    # The teacher's randomness is the group's: the same traces after a restart.
    assert b.teacher_rng(ahead[0][0]).random() == a.teacher_rng(ahead[0][0]).random() != a.teacher_rng(0).random()
    # ... and the curriculum moves on both alike: one more right group promotes neither (0.5, 1.0)
    # with the restored window, a second promotes both.
    a.agent.acc = b.agent.acc = 1.0
    assert produce(a, 1) == produce(b, 1) and a.level == b.level == 2
    assert produce(a, 1) == produce(b, 1) and a.level == b.level == 3


def test_another_worker_s_stream_is_its_own():
    a, b = producer(name="w1"), producer(name="w2")
    produce(a, 3)
    b.restore(a.state())  # a state is per worker: w2 skips 3 of its own stream, not w1's
    assert b.next_problem()[1] != a.next_problem()[1]


def test_groups_in_flight_at_a_restore_leave_the_restored_curriculum_alone():
    p = producer()
    state = {**p.state(), "recent_acc": [1.0]}

    async def go():
        p.agent.hold = asyncio.Event()
        gen = p.produce(n_groups=3)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)  # all three groups drawn and waiting in their rollouts
        p.restore(state)
        p.agent.hold.set()
        await first
        async for _ in gen:
            pass
    p.agent.acc = 0.0
    asyncio.run(go())
    assert len(p.agent.seen) == 3 and list(p._recent_acc) == [1.0] and p.level == 1


@pytest.mark.parametrize("bad, match", [
    ([], "object with keys"),
    ({"level": 1, "drawn": 0, "recent_acc": [], "groups": 0}, "object with keys"),  # no source
    ({"source": "arithmetic", "level": 1, "drawn": 0, "recent_acc": [], "groups": 0, "x": 1}, "object with keys"),
    ({"source": "gsm8k", "level": 1, "drawn": 0, "recent_acc": [], "groups": 0}, "data.source"),
    ({"source": "arithmetic", "level": 4, "drawn": 0, "recent_acc": [], "groups": 0}, "level 4 is outside"),
    ({"source": "arithmetic", "level": 1, "drawn": -1, "recent_acc": [], "groups": 0}, "drawn must be"),
    ({"source": "arithmetic", "level": 1, "drawn": 1.5, "recent_acc": [], "groups": 3}, "drawn must be"),
    ({"source": "arithmetic", "level": True, "drawn": 0, "recent_acc": [], "groups": 0}, "level must be"),
    ({"source": "arithmetic", "level": 1, "drawn": 0, "recent_acc": [], "groups": "2"}, "groups must be"),
    ({"source": "arithmetic", "level": 1, "drawn": 5, "recent_acc": [], "groups": 2}, "more than groups"),
    ({"source": "arithmetic", "level": 1, "drawn": 0, "recent_acc": [1.5], "groups": 0}, "recent_acc"),
    ({"source": "arithmetic", "level": 1, "drawn": 0, "recent_acc": "0.5", "groups": 0}, "recent_acc"),
])
def test_a_state_that_does_not_fit_is_refused_and_changes_nothing(bad, match):
    p = producer()
    produce(p, 2)
    before, upcoming = p.state(), producer()
    produce(upcoming, 2)
    with pytest.raises(ValueError, match=match):
        p.restore(bad)
    assert p.state() == before and p.next_problem() == upcoming.next_problem()


def test_the_worker_applies_a_resume_state_and_survives_one_that_does_not_fit(caplog):
    """GenWorker.resume, what the heartbeats call with a handed-back state: logged when applied; a state
    that does not fit is logged as an error and the worker goes on from where it is."""
    from toolrl.worker.service import GenWorker

    cfg = load_config("configs/cpu_demo.yaml", ["data.level=1", "data.max_level=3"])
    worker = GenWorker(cfg, worker_id="t", engine=object())
    try:
        before = worker.producer.state()
        with caplog.at_level("INFO", logger="gen_worker"):
            worker.resume({**before, "level": 9})
            assert worker.producer.state() == before
            assert "ignored the resume state" in caplog.text and "level 9 is outside" in caplog.text
            worker.resume({**before, "level": 2, "drawn": 3, "groups": 10})
        assert worker.producer.level == 2 and worker.stats_dict()["level"] == 2
        assert "resumed problem stream at level 2, problem 3" in caplog.text
    finally:
        worker.gate.assembler.close()


def test_groups_started_before_a_promotion_do_not_count_toward_the_new_levels_window(monkeypatch):
    """Groups still in flight from the easier level finished after a promotion and counted toward the
    new level's window (found in review). Three in flight, every group right, windows of two."""
    p = producer("rollout.prompts_per_step=3")
    p.agent.acc = 1.0
    starts, counted = [], []
    draw, curriculum = p.next_problem, p._curriculum
    p.next_problem = lambda: (starts.append(p.level), draw())[1]
    p._curriculum = lambda group: (counted.append(p.level), curriculum(group))[1]
    async def inline(fn, *a, **k):  # scoring in a thread let groups that end together under load (CI) end
        await asyncio.sleep(0)      # apart, and the order changed: here the three in flight end together
        return fn(*a, **k)
    monkeypatch.setattr(asyncio, "to_thread", inline)
    produce(p, 8)
    assert starts == [1, 1, 1, 2, 2, 2, 3, 3]
    # the third group (begun at level 1, done at 2) and the sixth (begun at 2, done at 3) count nowhere
    assert counted == [1, 1, 2, 2, 3, 3]


def test_a_verifier_that_cannot_start_leaves_groups_out_and_keeps_the_worker(caplog):
    """math-verify's child process failing to start (out of memory, a full /tmp) raised out of the
    producer: each group was a `failed_groups` traceback and the fifth in a row stopped the worker,
    where ARCHITECTURE says such a group is left out and counted (found in review)."""
    from toolrl.worker.rewards import VerifierUnavailable

    p = producer()
    p.agent.score = lambda *a: (_ for _ in ()).throw(VerifierUnavailable("the math-verify child could not start"))

    async def go():
        return [g async for g in p.produce(n_groups=8)]
    with caplog.at_level("WARNING"):
        assert asyncio.run(go()) == []
    stats = p.stats.as_dict()
    assert (stats["unscored_groups"], stats["failed_groups"]) == (8, 0)
    assert "could not grade the answers" in caplog.text


def test_a_refused_executor_token_stops_the_producer_at_once():
    """A wrong executor token (401/403) refuses every program: each group was a `failed_groups`
    traceback, and a group that called no tool in between reset the count of failures in a row,
    so the worker never stopped (found in review). It stops at the first."""
    from toolrl.executor.client import ExecutorRequestError

    p = producer()

    async def refused(*a, **k):
        raise ExecutorRequestError("executor refused /execute: 401 invalid or missing bearer token", 401)
    p.agent.rollouts = refused

    async def go():
        return [g async for g in p.produce(n_groups=8)]
    with pytest.raises(ExecutorRequestError, match="401"):
        asyncio.run(go())
    assert p.stats.as_dict()["failed_groups"] == 0
