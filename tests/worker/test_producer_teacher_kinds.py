"""The teacher-free kinds through the real producer: a group of a kind the teacher does not
demonstrate gets no teacher sample, a taught group gets its traces (real tokenizer, real teacher
traces, the program run in-process by a fake tool; the rollouts are a fake agent's)."""
import asyncio
import contextlib
import io
from types import SimpleNamespace

from toolrl.config import load_config
from toolrl.models import load_tokenizer
from toolrl.protocol import ToolCall
from toolrl.worker.producer import Producer

TOK = load_tokenizer("smollm2-135m-instruct")


class RunsPython:
    """The executor as the teacher uses it: runs the teacher's own program (never model output)."""

    async def run(self, code, session_id, continues=False):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, {})
        return ToolCall(code=code, status="ok", output=out.getvalue())


class FakeAgent:
    def __init__(self):
        self.name, self.gate, self.tokenizer, self.tool, self.seen = "w1", None, TOK, RunsPython(), []

    def gated(self):
        return contextlib.nullcontext(0)

    def group_id(self, problem_id):
        return f"{self.name}:{problem_id}"

    def prompt_ids(self, question):
        return TOK.encode(question, add_special_tokens=False)

    async def rollouts(self, prompt, gid, n, versions=None, seed_key=None):
        return [SimpleNamespace(stop_reason="stop", generated=1, tool_calls=[], interruptions=0) for _ in range(n)]

    async def run_tests(self, problem, rolls):
        return None

    def score(self, problem, rolls, gid, version, tests):
        self.seen.append(problem)
        return [SimpleNamespace(rewards={"correct": float(i % 2)}, reward=float(i % 2), version_runs=[],
                                source="policy", group_id=gid) for i in range(len(rolls))]


def groups(*sets, n=10):
    """(problem, group) for the first n groups of the real producer loop, and the producer."""
    cfg = load_config("configs/cpu_demo.yaml", ["teacher.traces_per_group=2", "rollout.group_size=3",
                                                "grpo.drop_zero_std_groups=false", *sets])
    p = Producer(cfg, FakeAgent())

    async def go():
        return [g async for g in p.produce(n_groups=n)]
    out = asyncio.run(go())
    problem = {f"w1:{q.id}": q for q in p.agent.seen}
    return [(problem[g[0].group_id], g) for g in out], p


TAUGHT = ("product", "product_plus", "product_minus")


def test_a_teacher_free_group_gets_no_teacher_sample():
    got, p = groups("data.kinds=[taught,free]", n=14)
    assert [q.meta["kind"] for q, _ in sorted(got, key=lambda x: p.agent.seen.index(x[0]))] == [
        *TAUGHT, "gain", "loss", "product_plus_commas", "product_minus_commas"] * 2
    for q, g in got:
        teacher = [s for s in g if s.source == "teacher"]
        if q.meta["kind"] in TAUGHT:  # the rollouts and two teacher traces that run and conclude the answer
            assert len(g) == 5 and len(teacher) == 2
            assert all(s.group_id.startswith(f"w1:{q.id}:teacher") and f"\\boxed{{{q.answer}}}" in s.text
                       for s in teacher)
        else:  # gain, loss and the comma kinds: the rollouts alone
            assert len(g) == 3 and not teacher
    assert p.stats.teacher_traces == 2 * 6


def test_teacher_kinds_decides_which_groups_are_taught():
    got, p = groups("data.kinds=[taught,verbs]", "teacher.kinds=[loss]", n=10)
    taught = {q.meta["kind"] for q, g in got if any(s.source == "teacher" for s in g)}
    assert taught == {"loss"} and p.stats.teacher_traces == 2 * 2
    # the demo as it was: the taught kinds only, every group taught
    got, p = groups(n=6)
    assert {q.meta["kind"] for q, _ in got} == set(TAUGHT) and p.stats.teacher_traces == 2 * 6


class AllAlike(FakeAgent):
    def score(self, problem, rolls, gid, version, tests):
        self.seen.append(problem)
        return [SimpleNamespace(rewards={"correct": 0.0}, reward=0.0, version_runs=[], source="policy",
                                group_id=gid) for _ in rolls]


def test_dropping_zero_std_groups_judges_the_policy_samples_not_the_teacher_traces():
    got, p = groups("grpo.drop_zero_std_groups=true", n=4)  # policy rewards 0, 1, 0: signal, kept
    assert len(got) == 4 and p.stats.dropped_groups == 0
    assert all([s.source for s in g].count("teacher") == 2 for _, g in got)
    cfg = load_config("configs/cpu_demo.yaml", ["teacher.traces_per_group=2", "rollout.group_size=3",
                                                "grpo.drop_zero_std_groups=true"])
    p = Producer(cfg, AllAlike())  # every policy sample 0; the traces' 1.0 must not count as signal

    async def go():
        return [g async for g in p.produce(n_groups=4)]
    assert asyncio.run(go()) == [] and p.stats.dropped_groups == 4 == p.stats.zero_std_groups
