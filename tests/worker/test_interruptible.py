"""Interruptible rollouts: a weight update cuts the generation requests in flight short, loads, and
the rollouts go on under the new policy with every token's version recorded. Real gate, real tool
loop, real tokenizer and executor; the engine streams scripted text token by token and answers an
abort as vLLM does (the tokens so far, finish_reason "abort")."""
import asyncio

import pytest

from toolrl.config import RolloutConfig
from toolrl.format import STOP_MARKER
from toolrl.models import load_tokenizer
from toolrl.protocol import Sample
from toolrl.weightsync.gate import WeightGate
from toolrl.worker.engine import GenOut
from toolrl.worker.rollout import ExecutorTool, run_rollout

TOK = load_tokenizer("smollm2-135m-instruct")
PROMPT = [1, 2, 3]
PROGRAM = f"Let me compute.\n<program>\n```python\nprint(6 * 7)\n```\n</program>\n{STOP_MARKER}"
ANSWER = "So it is 42.\n</think>\n<answer>\\boxed{42}</answer>"


def lp(version: int) -> float:
    """The logprob the engine gives every token under weights `version`: tells tokens' policies apart."""
    return -0.1 * (1 + version)


class Streaming:
    """Model segments generated one token per `tick`, under whatever weights are loaded when each
    token is made. A request continues its segment from wherever its prompt ends (a resumed request
    after an abort); stop strings are looked for in the request's own output only, as vLLM does."""

    def __init__(self, segments, stops, tick=0.01):
        self.targets = [TOK.encode(t, add_special_tokens=False) for t in segments]
        self.stops, self.tick = stops, tick
        self.weights = 0
        self.seg, self.seg_start = 0, None
        self.active: dict[str, asyncio.Event] = {}
        self.requests: list[tuple[str, int]] = []  # (request id, tokens already in place)
        self.on_token = lambda emitted: None

    async def generate(self, ids, max_tokens, request_id, seed=None, temperature=None):
        if self.seg_start is None:
            self.seg_start = len(ids)
        target, done = self.targets[self.seg], len(ids) - self.seg_start
        assert ids[self.seg_start:] == target[:done], "a resumed request must carry exactly the tokens kept"
        self.requests.append((request_id, done))
        aborted = self.active[request_id] = asyncio.Event()
        toks, lps = [], []
        try:
            for t in target[done:done + max_tokens]:
                await asyncio.sleep(self.tick)
                if aborted.is_set():
                    return GenOut(toks, lps, TOK.decode(toks), "abort", None)
                toks.append(t)
                lps.append(lp(self.weights))
                self.on_token(done + len(toks))
                text = TOK.decode(toks)
                stop = next((s for s in self.stops if s in text), None)
                if stop:
                    self.seg, self.seg_start = self.seg + 1, None
                    return GenOut(toks, lps, text, "stop", stop)
            self.seg, self.seg_start = self.seg + 1, None
            return GenOut(toks, lps, TOK.decode(toks), "stop", None)  # EOS
        finally:
            del self.active[request_id]

    async def abort(self, request_ids):
        for rid in request_ids:
            if rid in self.active:
                self.active[rid].set()

    async def abort_all(self):
        await self.abort(list(self.active))
        return len(self.active)


@pytest.fixture(scope="module")
def tool(executor):
    from toolrl.executor.client import AsyncExecutorClient

    return lambda: ExecutorTool(AsyncExecutorClient(executor), timeout_s=5)


def interrupted_rollout(tool, at_token: int, segments=(PROGRAM, ANSWER), updates=1):
    """A rollout whose first segment is cut short by `updates` weight updates, the first when it has
    made `at_token` tokens. -> (rollout, the swaps' answers, events)"""
    cfg = RolloutConfig()
    engine = Streaming(list(segments), [cfg.stop_marker])
    gate = WeightGate(engine, None, drain_timeout_s=30, sync_timeout_s=30)
    events, swaps, started = [], [], []

    async def load():
        events.append(("load", len(gate.segments)))
        await asyncio.sleep(0.05)
        engine.weights += 1
        return 0.05

    def on_token(emitted):
        if emitted >= at_token and len(started) < updates:
            started.append(asyncio.ensure_future(gate.swap(len(started) + 1, load)))
    engine.on_token = on_token

    async def go():
        r = await run_rollout(engine, tool(), TOK, PROMPT, cfg, "t.0", versions=gate)
        swaps.extend([await s for s in started])
        return r
    return asyncio.run(go()), swaps, engine


def check_versions_match_tokens(r):
    """Every model token's logprob is the one its recorded version's weights gave it."""
    s = Sample(prompt_ids=r.prompt_ids, completion_ids=r.completion_ids, loss_mask=r.loss_mask,
               logprobs=r.logprobs, group_id="g", policy_version=r.version_runs[0][1], version_runs=r.version_runs)
    versions = s.token_versions()
    assert len(versions) == len(r.completion_ids)
    for i, (m, x) in enumerate(zip(r.loss_mask, r.logprobs)):
        if m:
            assert x == pytest.approx(lp(versions[i])), f"token {i} is recorded as v{versions[i]}"
    return versions


def test_an_update_interrupts_a_rollout_which_goes_on_under_the_new_weights(tool):
    r, swaps, engine = interrupted_rollout(tool, at_token=5)
    # the update did not wait for the segment (about 30 tokens of 10 ms): it loaded at once
    assert swaps[0]["loaded"] and swaps[0]["interrupted"] == 1 and swaps[0]["drain_s"] < 0.15
    assert r.interruptions == 1 and r.stop_reason == "eos"
    # the sample is whole: the program ran once and the answer follows, every token in its place
    assert [c.output for c in r.tool_calls] == ["42\n"]
    model = [t for k, a, b in r.segments if k == "model" for t in r.completion_ids[a:b]]
    assert model == engine.targets[0] + engine.targets[1]
    versions = check_versions_match_tokens(r)
    cut = r.version_runs[1][0]
    assert r.version_runs == [(0, 0), (cut, 1)] and 5 <= cut <= 7 and versions[cut - 1] == 0
    # the resumed request carried exactly the tokens kept, under a new request id
    assert [(rid, done) for rid, done in engine.requests][:2] == [("t.0.0", 0), ("t.0.1.r1", cut)]


def test_no_token_is_made_while_an_update_loads_and_each_is_recorded(tool):
    """Two updates in a row: tokens of three versions, and the record says which is which."""
    r, swaps, _ = interrupted_rollout(tool, at_token=3, updates=2)
    assert [s["version"] for s in swaps] == [1, 2]
    versions = check_versions_match_tokens(r)
    assert versions == sorted(versions) and set(versions) <= {0, 1, 2} and versions[0] == 0
    assert r.version_runs[-1][1] == 2


def test_a_cut_inside_the_stop_marker_still_stops_there(tool):
    """Cut when the text ends with half the marker: the resumed request (which only sees its own
    output) must still find the whole marker, so the kept tokens stop before it begins."""
    ids = TOK.encode(PROGRAM, add_special_tokens=False)
    at = next(k for k in range(len(ids)) if TOK.decode(ids[:k]).endswith("The result of"))
    r, swaps, engine = interrupted_rollout(tool, at_token=at)
    assert r.interruptions == 1 and [c.output for c in r.tool_calls] == ["42\n"] and r.stop_reason == "eos"
    cut = r.version_runs[1][0]
    assert not TOK.decode(r.completion_ids[:cut]).rstrip().endswith("The result of")
    assert STOP_MARKER not in TOK.decode(r.completion_ids[:cut])
    check_versions_match_tokens(r)


def test_a_rollout_without_an_update_has_one_version_and_evaluation_drains(tool):
    """No update: one run, nothing interrupted. A whole rollout (gate.rollout, as evaluation runs)
    is drained instead: the update waits for it and its tokens are all the old version's."""
    r, swaps, _ = interrupted_rollout(tool, at_token=10**6)
    assert swaps == [] and r.interruptions == 0 and r.version_runs == [(0, 0)]
    from toolrl.worker.rollout import FixedVersion

    cfg = RolloutConfig()
    engine = Streaming([PROGRAM, ANSWER], [cfg.stop_marker])
    gate = WeightGate(engine, None, drain_timeout_s=30, sync_timeout_s=30)

    async def load():
        engine.weights += 1
        return 0.0

    async def go():
        async def whole():
            async with gate.rollout() as v:
                return await run_rollout(engine, tool(), TOK, PROMPT, cfg, "e.0", versions=FixedVersion(v))
        task = asyncio.create_task(whole())
        await asyncio.sleep(0.1)
        swap = await gate.swap(1, load)
        return await task, swap
    r, swap = asyncio.run(go())
    assert r.interruptions == 0 and set(x for x, m in zip(r.logprobs, r.loss_mask) if m) == {lp(0)}
    assert swap["interrupted"] == 0 and swap["drain_s"] > 0.2  # it waited for the whole rollout


def test_samples_take_their_oldest_tokens_version_and_keep_the_runs(tool):
    """The agent's scoring turns a rollout's runs into the sample's record: policy_version is the
    oldest token's (what the staleness rule uses), the runs go along when there are several."""
    from toolrl.config import load_config
    from toolrl.tasks.arithmetic import arithmetic_problems
    from toolrl.worker.rollout import Rollout
    from toolrl.worker.service import GenWorker

    cfg = load_config("configs/cpu_demo.yaml", [f"executor.url={tool().client.url}"])
    worker = GenWorker(cfg, worker_id="t", engine=Streaming([], []))
    try:
        problem = arithmetic_problems(1, seed=3, level=1)[0]
        rolls = []
        for runs in ([(0, 3)], [(0, 2), (4, 3)], []):
            r = Rollout(prompt_ids=[1, 2])
            for _, v in runs:  # 4 tokens a run
                r.add("model", [5] * 4, [-0.1] * 4, v)
            rolls.append(r)
        samples = worker.agent.score(problem, rolls, "g", 3)
        assert [s.policy_version for s in samples] == [3, 2, 3]
        assert [s.version_runs for s in samples] == [[], [(0, 2), (4, 3)], []]
        assert samples[1].token_versions() == [2] * 4 + [3] * 4
    finally:
        worker.gate.assembler.close()
        asyncio.run(worker.agent.executor.aclose())


def test_an_empty_segment_under_a_new_version_records_no_run():
    """An engine answer with no tokens (an abort before the first) must not open a run: a run
    starting at the end of the completion would make the sample invalid."""
    from toolrl.worker.rollout import Rollout

    r = Rollout(prompt_ids=[1])
    r.add("model", [5, 6], [-0.1, -0.1], 0)
    r.add("model", [], [], 1)
    assert r.version_runs == [(0, 0)]
    Sample(prompt_ids=[1], completion_ids=r.completion_ids, loss_mask=r.loss_mask, logprobs=r.logprobs,
           group_id="g", policy_version=0, version_runs=r.version_runs)


def test_an_evaluation_started_during_an_update_reports_the_version_it_ran_on():
    """Agent.evaluate read the policy version before any problem passed the gate: an evaluation
    started while an update loaded ran wholly on the new weights and reported the old version
    (found in review). Real gate; the agent's acting is scripted."""
    from types import SimpleNamespace

    from toolrl.config import Config, DataConfig
    from toolrl.tasks import load_task
    from toolrl.worker.agent import Agent

    problems = load_task("arithmetic:1", 3, 0, DataConfig())
    engine = Streaming([PROGRAM], [RolloutConfig().stop_marker])
    gate = WeightGate(engine, None, drain_timeout_s=30, sync_timeout_s=30)

    async def rollouts(prompt, gid, n, versions, temperature=None):
        return [SimpleNamespace(stop_reason="stop")] * n

    def score(problem, rolls, gid, v, tests):
        return [Sample(prompt_ids=[1], completion_ids=[2], loss_mask=[1], logprobs=[-1.0], group_id=gid,
                       policy_version=v, rewards={"correct": 1.0}, reward=1.0) for _ in rolls]

    agent = SimpleNamespace(gate=gate, gated=gate.rollout, group_id=lambda pid, kind: kind + pid, rollouts=rollouts,
                            prompt_ids=lambda q: [1], run_tests=lambda p, k: asyncio.sleep(0), score=score,
                            cfg=Config())

    async def go():
        async def load():
            await asyncio.sleep(0.3)
            return 0.3
        update = asyncio.create_task(gate.swap(1, load))
        await asyncio.sleep(0.05)  # the update is loading: the gate still says version 0
        assert gate.version == 0
        res = await Agent.evaluate(agent, problems, samples=2, ks=[1])
        await update
        return res
    res = asyncio.run(go())
    assert (res["policy_version"], res["policy_version_end"]) == (1, 1)


def test_a_bounded_wait_at_the_gate_gives_up_while_an_update_loads():
    """/probe enters the gate like a whole rollout (it generated across an update's load, reporting
    the new version for mixed weights: found in review), with a bounded wait: a 503, never a hang."""
    engine = Streaming([PROGRAM], [RolloutConfig().stop_marker])
    gate = WeightGate(engine, None, drain_timeout_s=30, sync_timeout_s=30)

    async def go():
        async def load():
            await asyncio.sleep(0.5)
            return 0.5
        update = asyncio.create_task(gate.swap(1, load))
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            async with gate.rollout(wait_s=0.1):
                pass
        async with gate.rollout(wait_s=5) as v:  # waits for the load, then runs on the new weights
            assert v == 1
        await update
    asyncio.run(go())
