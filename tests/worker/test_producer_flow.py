"""The producer under flow control: a group starts only under a grant, and every grant ends (by the
upload of its group, or given back when the group is left out). The real producer loop on the fake
agent of test_producer_state."""
import asyncio

import pytest
from test_producer_state import producer

from toolrl.refserver.client import RefServerError, RefServerUnavailable
from toolrl.worker.service import RefServerFlow


class Flow:
    """Grants `room` groups at a time, like the reference server's bound: a grant is held until its
    group is uploaded (take_grant) or given back."""

    def __init__(self, room):
        self.room, self.held, self.asked, self.peak, self.given_back = room, set(), 0, 0, []
        self._n = 0

    async def grant(self, wait_s):
        self.asked += 1
        if len(self.held) >= self.room:
            await asyncio.sleep(min(wait_s, 0.01))
            return False, None
        self._n += 1
        self.held.add(f"g{self._n}")
        self.peak = max(self.peak, len(self.held))
        return True, f"g{self._n}"

    async def give_back(self, grant_id):
        self.given_back.append(grant_id)
        self.held.discard(grant_id)


def run(p, n, upload_delay=0.0):
    """Produce n groups, 'uploading' each (which ends its grant) after upload_delay."""
    async def go():
        got = []
        async for group in p.produce(n_groups=n):
            await asyncio.sleep(upload_delay)
            p.flow.held.discard(p.take_grant(group))
            got.append(group)
        return got
    return asyncio.run(go())


def test_no_more_groups_in_flight_than_granted_and_every_grant_ends():
    p = producer("rollout.prompts_per_step=4")
    p.flow = Flow(room=2)
    groups = run(p, 7, upload_delay=0.02)
    assert len(groups) == 7 and p.flow.peak == 2  # width 4, but room for 2
    assert p.groups == p.flow._n == 7  # every group started under a grant of its own
    assert not p.flow.held and not p._grants and p.stats.flow_waits > 0


def test_groups_left_out_give_their_grant_back():
    p = producer("grpo.drop_zero_std_groups=true")  # every group scores 2 of 4 right, unless acc is 1
    p.agent.acc = 1.0  # all right: zero variance, every group dropped
    p.flow = Flow(room=3)
    assert run(p, 5) == []
    assert len(p.flow.given_back) == 5 and not p.flow.held and p.stats.dropped_groups == 5


def test_without_flow_control_the_producer_runs_as_before():
    p = producer("rollout.prompts_per_step=3")
    assert len(run_plain(p, 4)) == 4 and p.stats.flow_waits == 0


def run_plain(p, n):
    async def go():
        return [g async for g in p.produce(n_groups=n)]
    return asyncio.run(go())


def test_the_end_of_training_stops_the_groups_in_flight_and_starts_none_until_training_resumes():
    """The learner finished: the groups in flight are cancelled (their engine requests with them: vLLM
    aborts a cancelled request), counted apart from aborts, their grants given back, and no group
    starts, even where the flow grants one; when training resumes the producer goes on."""
    p = producer("rollout.prompts_per_step=3")
    p.flow = Flow(room=10)

    async def go():
        p.agent.hold = asyncio.Event()  # rollouts wait until told
        gen = p.produce()
        nxt = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        assert p.inflight == 3 and len(p.flow.held) == 3
        assert p.end_training() == 3 and p.end_training() == 0  # once
        await asyncio.sleep(0.05)
        assert p.inflight == 0 and not p.flow.held and len(p.flow.given_back) == 3
        asked = p.flow.asked
        await asyncio.sleep(0.05)  # there is room, yet nothing starts and nothing is asked
        assert p.inflight == 0 and p.groups == 3 and p.flow.asked == asked and not p.flow.held
        assert not nxt.done()
        p.end_training(False)  # a resumed learner: groups start again and finish
        p.agent.hold.set()
        group = await asyncio.wait_for(nxt, 5)
        await gen.aclose()
        return group

    assert len(asyncio.run(go())) == 4
    assert p.stats.stopped_at_end == 3 and p.stats.aborted_groups == 0


class FailingRef:
    """A reference server's client whose grants fail `fail` times (down, or answering 5xx through
    its retries), then grant everything; or refuse with `status` every time."""

    def __init__(self, fail, exc):
        self.fail, self.exc, self.asked, self.n = fail, exc, 0, 0

    async def grant(self, worker_id, n, wait_s):
        self.asked += 1
        if self.asked <= self.fail:
            raise self.exc
        self.n += 1
        return True, f"g{self.n}"

    async def give_back(self, grant_id):
        pass


def test_a_reference_server_outage_pauses_the_producer_instead_of_killing_it(monkeypatch):
    monkeypatch.setattr(RefServerFlow, "ERROR_PAUSE_S", 0.01)
    for exc in (RefServerUnavailable("POST /grants failed after 5 tries"), RefServerError(500, "boom")):
        p = producer("rollout.prompts_per_step=2")
        ref = FailingRef(3, exc)
        p.flow = RefServerFlow(ref, "w1", p.group_samples)
        groups = run_plain(p, 3)
        assert len(groups) == 3 and p.flow.errors == 3 and ref.n == 3  # every group under a grant


def test_a_refused_token_still_stops_the_producer():
    p = producer()
    p.flow = RefServerFlow(FailingRef(99, RefServerError(401, "bad token")), "w1", p.group_samples)
    with pytest.raises(RefServerError, match="401"):
        run_plain(p, 1)
