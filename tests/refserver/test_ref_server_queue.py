"""The reference server's parts on their own: queue bounds/order/staleness, batch planning, registry."""
import asyncio
import gc
import itertools
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from toolrl.protocol import Sample, ToolCall, decode_samples, encode_samples
from toolrl.refserver.app import Replay
from toolrl.refserver.queue import (FIXED_SIZE_FIELDS, SIZED_FIELDS, AsyncSampleQueue, GroupTooLarge, QueueFull,
                                   SampleQueue, sample_nbytes)
from toolrl.refserver.reference import plan_batches
from toolrl.refserver.registry import RegistryError, WorkerRegistry


def mk(tag: int, version: int = 0, n_comp: int = 4, source: str = "policy") -> Sample:
    return Sample(prompt_ids=[tag % 1000 + 1, 2], completion_ids=[3] * n_comp, loss_mask=[1] * n_comp,
                  logprobs=[-1.0] * n_comp, group_id=f"g{tag}", policy_version=version, source=source)


def tags(entries) -> list[str]:
    return [e.sample.group_id for e in entries]


def drain(q: SampleQueue, window_tokens: int = 10**9):
    """Run the reference step synchronously: every pending window completes."""
    while q.pending:
        q.complete(w := q.take_pending(window_tokens), None)
        assert w


def test_bounds_by_samples_and_bytes_and_group_atomicity():
    q = SampleQueue(max_samples=5, max_bytes=10**9)
    q.put([mk(0), mk(1), mk(2)])
    with pytest.raises(QueueFull):
        q.put([mk(3), mk(4), mk(5)])  # 3 more would make 6 > 5: nothing of the group is taken
    assert q.samples == 3 and q.counters.rejected_full == 1
    q.put([mk(3), mk(4)])
    with pytest.raises(GroupTooLarge):
        q.put([mk(i) for i in range(6)])  # can never fit
    one = sample_nbytes(mk(0, n_comp=100))
    qb = SampleQueue(max_samples=100, max_bytes=3 * one)
    for i in range(3):
        qb.put([mk(i, n_comp=100)])
    with pytest.raises(QueueFull):
        qb.put([mk(9, n_comp=100)])
    assert qb.nbytes == 3 * one and qb.counters.high_water_bytes == 3 * one
    drain(qb)
    assert tags(qb.take_ready(1, 10**9)) == ["g0"]
    qb.put([mk(9, n_comp=100)])  # the delivered sample's bytes were released
    assert qb.samples == 3


def test_fifo_delivers_in_upload_order_with_token_caps():
    q = SampleQueue(100, 10**9)
    for g in range(4):
        q.put([mk(10 * g), mk(10 * g + 1)])
    q.complete(q.take_pending(13), None)  # windows are whole groups: 2 groups of 12 tokens > 13 -> one
    assert q.ready == 2 and q.pending == 6
    drain(q)
    out = q.take_ready(3, 10**9)
    assert tags(out) == ["g0", "g1", "g10"]
    assert tags(q.take_ready(10, 12)) == ["g11", "g20"]  # 6 tokens each: the cap stops at 2
    big = SampleQueue(10, 10**9)
    big.put([mk(1, n_comp=50)])
    drain(big)
    assert tags(big.take_ready(5, 10)) == ["g1"]  # larger than max_tokens: delivered alone, not stuck


def test_newest_first_keeps_groups_whole():
    q = SampleQueue(100, 10**9, order="newest")
    for g in range(3):
        q.put([mk(10 * g), mk(10 * g + 1)])
    first = q.take_pending(12)  # newest group first
    assert tags(first) == ["g20", "g21"]
    q.complete(first, None)
    q.put([mk(30), mk(31)])
    drain(q)
    assert tags(q.take_ready(100, 10**9)) == ["g30", "g31", "g20", "g21", "g10", "g11", "g0", "g1"]


def test_stale_samples_dropped_and_counted_everywhere():
    q = SampleQueue(100, 10**9, max_staleness=2)
    q.set_version(5)
    adm = q.put([mk(1, version=2), mk(2, version=3), mk(3, version=0, source="teacher")])
    assert (adm.accepted, adm.dropped_stale) == (2, 1)
    q.put([mk(4, version=4)])
    q.complete(q.take_pending(6), None)  # g2 + teacher ready, g4 pending
    assert q.set_version(6) == 1  # g2 (v3 < 6-2) dropped from ready; g4 (v4) survives
    q.put([mk(5, version=5)])
    q.set_version(7)  # 4 < 5: g4 is now stale while pending
    drain(q)
    assert tags(q.take_ready(10, 10**9)) == ["g3", "g5"]
    assert q.counters.dropped_stale == 3 and q.samples == 0 and q.nbytes == 0
    c = q.counters
    assert c.samples_in == c.samples_out + c.dropped_stale + c.dropped_failed + q.samples == 5


def test_failed_samples_are_released_and_counted():
    q = SampleQueue(10, 10**9)
    q.put([mk(1), mk(2)])
    w = q.take_pending(100)
    q.fail(w[:1])
    q.complete(w[1:], [[-0.5] * 4])
    assert q.counters.dropped_failed == 1 and q.samples == 1
    assert q.take_ready(5, 100)[0].sample.ref_logprobs == [-0.5] * 4


@pytest.mark.parametrize("order", ["fifo", "newest"])
def test_a_window_put_back_is_taken_next_in_its_order(order):
    """A replica's lease that runs out puts its window back (requeue): its groups are taken next, in
    the order they would have been taken, ahead of what was uploaded meanwhile."""
    q = SampleQueue(max_samples=100, max_bytes=10**9, order=order)
    for g in range(4):
        q.put([mk(10 * g), mk(10 * g + 1)])
    out = q.take_pending(24)  # two groups of 2 samples x 6 tokens
    assert tags(out) == (["g0", "g1", "g10", "g11"] if order == "fifo" else ["g30", "g31", "g20", "g21"])
    q.put([mk(40), mk(41)])
    q.requeue(out[::-1])  # in any order
    assert q.pending == 10 and q.stats()["computing"] == 0
    assert tags(q.take_pending(24)) == tags(out)
    drain(q)
    assert q.samples == 10 and q.counters.dropped_failed == 0


def test_async_put_waits_its_turn_then_times_out():
    async def main():
        q = AsyncSampleQueue(SampleQueue(2, 10**9), max_upload_waiters=2)
        await q.put([mk(1), mk(2)])
        order = []

        async def producer(tag):
            await q.put([mk(tag)], wait_s=5)
            order.append(tag)

        t1 = asyncio.create_task(producer(3))
        await asyncio.sleep(0.01)
        t2 = asyncio.create_task(producer(4))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull, match="waiting"):  # waiters are bounded
            await q.put([mk(5)], wait_s=5)
        with pytest.raises(QueueFull):
            await q.put([mk(6)], wait_s=0)  # no jumping ahead of waiters
        for _ in range(2):
            q.complete(q.core.take_pending(100), None)
            q.core.take_ready(1, 100)
            q.notify()
            await asyncio.sleep(0.01)
        await asyncio.gather(t1, t2)
        assert order == [3, 4]
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(QueueFull, match="after waiting"):
            await q.put([mk(7)], wait_s=0.2)
        assert 0.15 < asyncio.get_running_loop().time() - t0 < 1.0
        # min_samples not reached within wait_s: what is ready comes back after the wait
        got = await q.take_batch(5, 100, min_samples=5, wait_s=0.1)
        assert tags(got) == ["g3"]
        q.complete(q.core.take_pending(100), None)
        assert tags(await q.take_batch(5, 100)) == ["g4"]
        assert await q.take_batch(5, 100, wait_s=0.05) == []  # nothing ready: empty after the wait, no hang
        small = AsyncSampleQueue(SampleQueue(1, 10**9), max_waiting_bytes=sample_nbytes(mk(1)))
        await small.put([mk(1)])
        waiter = asyncio.create_task(small.put([mk(2)], wait_s=5))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull):  # the waiting room is bounded in bytes as well
            await small.put([mk(3)], wait_s=5)
        waiter.cancel()

    asyncio.run(main())


def test_a_batch_wait_ends_when_the_queue_cannot_grow():
    """A learner asking for more than the queue can hold while an upload waits for space would wait
    out its whole window: space frees only by delivery. It gets what is ready at once instead."""
    async def main():
        q = AsyncSampleQueue(SampleQueue(6, 10**9))
        await q.put([mk(i) for i in range(4)])  # 4 of 6 held; the next group of 3 does not fit
        q.complete(q.core.take_pending(100), None)
        upload = asyncio.create_task(q.put([mk(10), mk(11), mk(12)], wait_s=30))
        await asyncio.sleep(0.01)
        assert q.upload_waiters == 1
        got = await asyncio.wait_for(q.take_batch(6, 10**6, min_samples=6, wait_s=30), 5)  # not 30 s
        assert tags(got) == ["g0", "g1", "g2", "g3"]
        await upload  # the group goes in as soon as the batch freed the space
        assert q.core.samples == 3
        # held samples that will become ready are worth waiting for: 3 pending + a waiter, need 3
        waiting = asyncio.create_task(q.put([mk(20), mk(21), mk(22), mk(23), mk(24)], wait_s=30))
        batch = asyncio.create_task(q.take_batch(6, 10**6, min_samples=3, wait_s=30))
        await asyncio.sleep(0.05)
        assert not batch.done()  # nothing ready yet, and what is held will make 3
        q.complete(q.core.take_pending(100), None)
        assert tags(await asyncio.wait_for(batch, 5)) == ["g10", "g11", "g12"]
        await waiting
        # the learner already waits when the upload that cannot fit arrives: it is woken
        q.complete(q.core.take_pending(100), None)  # 5 ready of 6
        batch = asyncio.create_task(q.take_batch(6, 10**6, min_samples=6, wait_s=30))
        await asyncio.sleep(0.05)
        assert not batch.done()
        upload = asyncio.create_task(q.put([mk(30), mk(31)], wait_s=30))
        assert len(await asyncio.wait_for(batch, 5)) == 5
        await upload

    asyncio.run(main())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=60), st.integers(64, 8192))
def test_plan_batches_partitions_and_respects_budget(lengths, budget):
    batches = plan_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) == 1 or len(b) * longest <= budget
    # Sorted by length: batches do not interleave, so padding is bounded by neighbouring lengths.
    spans = [(min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in batches]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_registry_expiry_and_reregistration():
    now = [100.0]
    expired = []
    reg = WorkerRegistry(ttl_s=10, max_workers=2, clock=lambda: now[0], on_expire=expired.append)
    reg.register("w1", "http://127.0.0.1:1", {"gpus": 1}, 3)
    reg.register("w2", "http://127.0.0.1:2")
    with pytest.raises(RegistryError) as e:
        reg.register("w3", "http://127.0.0.1:3")
    assert e.value.status == 409
    now[0] += 6
    assert reg.heartbeat("w1", 4).policy_version == 4
    now[0] += 6  # w2 silent for 12 s > 10
    assert [w["id"] for w in reg.live()] == ["w1"] and [w.id for w in expired] == ["w2"]
    assert reg.heartbeat("w2") is None
    reg.register("w2", "http://127.0.0.1:22")
    assert {w["id"]: w["url"] for w in reg.live()} == {"w1": "http://127.0.0.1:1", "w2": "http://127.0.0.1:22"}
    for bad in [("", "http://x"), ("a b", "http://x"), ("w", "ftp://x"), ("w", "not a url")]:
        with pytest.raises(RegistryError):
            reg.register(*bad)
    with pytest.raises(RegistryError, match="capabilities"):
        reg.register("w9", "http://x", {"blob": "x" * 20000})


def test_registry_keeps_heartbeat_states_and_hands_resume_states_back_until_applied():
    reg = WorkerRegistry(ttl_s=10, max_workers=2)
    reg.register("w1", "http://127.0.0.1:1")
    assert reg.live()[0]["state"] is None  # no heartbeat with a state yet
    state = {"source": "arithmetic", "level": 2, "drawn": 7, "recent_acc": [0.5], "groups": 9}
    reg.heartbeat("w1", 1, state)
    reg.heartbeat("w1", 2)  # a heartbeat without a state keeps the last one
    assert [(w["id"], w["policy_version"], w["state"]) for w in reg.live()] == [("w1", 2, state)]
    for bad, match in [([1], "state must be a JSON object"), ({"blob": "x" * 20000}, "over the limit"),
                       ({"x": float("nan")}, "not JSON-serialisable"), ({"x": object()}, "not JSON-serialisable")]:
        with pytest.raises(RegistryError, match=match) as e:
            reg.heartbeat("w1", 3, bad)
        assert e.value.status == 400
    assert reg.live()[0]["state"] == state and reg.live()[0]["policy_version"] == 2  # a refused one changes nothing

    assert reg.set_resume_states({"w1": {"level": 3}, "w2": {"level": 1}}) == 2
    assert reg.stats()["resume_states_pending"] == 2
    rid, got = reg.resume_state("w1")
    assert got == {"level": 3} and reg.resume_state("w1") == (rid, got)  # again: the first answer may be lost
    reg.applied_resume("w1", "another-id")
    assert reg.resume_state("w1") == (rid, got)  # an older resume's id changes nothing
    reg.applied_resume("w1", rid)
    assert reg.resume_state("w1") is None and reg.resume_state("w9") is None
    assert reg.stats()["resume_states_pending"] == 1
    for bad, match in [({"a": {}, "b": {}, "c": {}}, "more than max_workers"), ({"bad id": {}}, "worker id"),
                       ({"w1": [1]}, "state of w1 must be a JSON object"),
                       ({"w1": {"b": "x" * 20000}}, "over the limit"),
                       ([("w1", {})], "JSON object of worker id")]:
        with pytest.raises(RegistryError, match=match):
            reg.set_resume_states(bad)
    assert reg.resume_state("w2")[1] == {"level": 1}  # a refused set left the pending one alone
    reg.set_resume_states({"w1": {"level": 2}})
    assert reg.set_resume_states({"w2": {"level": 2}}) == 1 and reg.resume_state("w1") is None  # replaced


def test_replay_cache_is_bounded():
    r = Replay(max_entries=2, ttl_s=60)
    for k in "abc":
        r.put(k, k.upper())
    assert r.get("a") is None and r.get("c") == "C"


def test_plan_batches_keeps_a_long_sample_from_padding_short_ones():
    lengths = [10, 12, 11, 1000, 13]
    batches = plan_batches(lengths, 8192)
    assert sorted(map(sorted, batches)) == [[0, 1, 2, 4], [3]]


def test_a_live_worker_id_cannot_be_taken_by_another_url():
    now = [0.0]
    reg = WorkerRegistry(ttl_s=10, clock=lambda: now[0])
    reg.register("w1", "http://127.0.0.1:1", {"gpus": 1})
    now[0] = 9.0
    with pytest.raises(RegistryError, match="is live at http://127.0.0.1:1") as e:
        reg.register("w1", "http://evil:6666")
    assert e.value.status == 409
    assert reg.live()[0]["url"] == "http://127.0.0.1:1" and reg.heartbeat("w1", 2) is not None  # untouched
    reg.register("w1", "http://127.0.0.1:1")  # the same worker, restarted: allowed, a fresh entry
    assert reg.live()[0]["capabilities"] == {}
    now[0] = 25.0  # ... but one that stopped heartbeating can be replaced once it has expired
    reg.register("w1", "http://127.0.0.1:2")
    assert [w["url"] for w in reg.live()] == ["http://127.0.0.1:2"]


def test_kept_json_objects_are_bounded_in_depth():
    reg = WorkerRegistry(ttl_s=10)
    deep = ok = {}
    for _ in range(40):
        deep = {"a": deep}
    for _ in range(31):
        ok = {"a": ok}
    reg.register("w1", "http://x:1", ok)  # 32 levels: fine
    with pytest.raises(RegistryError, match="nested deeper than 32") as e:
        reg.register("w2", "http://x:2", deep)
    assert e.value.status == 400
    for bad in (deep, {"l": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}):
        with pytest.raises(RegistryError, match="nested deeper"):
            reg.heartbeat("w1", 0, bad)
        with pytest.raises(RegistryError, match="nested deeper"):
            reg.set_resume_states({"w1": bad})


def _held_bytes(body: bytes, with_ref: bool) -> tuple[list[Sample], int]:
    """What decoding `body` leaves allocated (tracemalloc), optionally after the reference's
    ref_logprobs are attached the way the queue attaches them."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        samples, _ = decode_samples(body, max_bytes=1 << 30)
        if with_ref:
            lp = torch.randn(len(samples), max(len(s.completion_ids) for s in samples) or 1)
            samples = [s.model_copy(update={"ref_logprobs": lp[i, :len(s.completion_ids)].tolist()})
                       for i, s in enumerate(samples)]
            del lp
        del _
        gc.collect()
        return samples, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def _big(**kw) -> Sample:
    fields = dict(prompt_ids=[1000, 1001, 1002], completion_ids=[2000, 2001, 2002, 2003], loss_mask=[1, 1, 0, 1],
                  logprobs=[-0.5, -1.0, None, -2.0], group_id="g", rewards={"correct": 1.0}, text="t")
    return Sample(**{**fields, **kw})


_TOKENS = ("prompt_ids", "completion_ids", "loss_mask", "logprobs", "ref_logprobs")
# (case, the Sample fields it makes large, the group): every sized field needs one (checked below).
_HELD_CASES = [
    ("huge group id", {"group_id"}, [_big(group_id="g" * (1 << 20))]),
    ("huge reward names", {"rewards"}, [_big(rewards={f"r{i:06d}" + "x" * 50: 1.0 for i in range(20000)})]),
    ("many small reward names", {"rewards"}, [_big(rewards={str(i): float(i) for i in range(50000)})]),
    ("wide reward names", {"rewards"}, [_big(rewards={"é" * 100000: 1.0, "😀" * 100000: 2.0})]),
    ("huge tool outputs", {"tool_calls"},
     [_big(tool_calls=[ToolCall(code="c" * 1000, status="ok", output="o" * 100000)] * 20)]),
    ("many tool calls", {"tool_calls"}, [_big(tool_calls=[ToolCall(code="", status="ok", output="")] * 10000)]),
    ("wide text", {"text"}, [_big(text="😀" * 200000)]),
    # Indices and versions above 256 (not the interpreter's cached small ints), as after a long run.
    ("many version runs", {"version_runs"},
     [_big(completion_ids=[5] * 2000, loss_mask=[1] * 2000, logprobs=[-0.5] * 2000, policy_version=1000,
           version_runs=[(i, 1000 + i) for i in range(2000)])]),
    ("longest ids and stop reasons", {"sample_id", "stop_reason"},
     [_big(sample_id=f"{i:064d}", stop_reason="max_total_tokens") for i in range(200)]),
    ("tokens", set(_TOKENS), [_big(prompt_ids=list(range(1000, 1200)), completion_ids=list(range(3000, 5000)),
                                   loss_mask=[1] * 2000, logprobs=[-0.25] * 2000) for _ in range(4)]),
]


def test_sample_nbytes_accounts_for_every_field():
    """A field added to Sample must be counted by sample_nbytes (or shown fixed-size) and get a case
    below that makes it large: otherwise a client could fill the server through it unbounded."""
    assert not FIXED_SIZE_FIELDS & SIZED_FIELDS
    assert FIXED_SIZE_FIELDS | SIZED_FIELDS == set(Sample.model_fields)
    assert set().union(*(fields for _, fields, _ in _HELD_CASES)) == SIZED_FIELDS


@pytest.mark.parametrize("name,group", [(name, group) for name, _, group in _HELD_CASES])
def test_sample_nbytes_bounds_what_a_decoded_sample_holds(name, group):
    """The queue's byte bound is only as good as this estimate: it must cover everything a sample
    makes the server hold (strings, dict keys, tool records, version runs, then ref_logprobs), and not overstate it
    much (the bound would waste memory). Checked against tracemalloc."""
    body = encode_samples(group)
    samples, held = _held_bytes(body, with_ref=False)
    est = sum(sample_nbytes(s) for s in samples)
    _, held_with_ref = _held_bytes(body, with_ref=True)
    assert est >= held_with_ref, (name, est, held_with_ref)
    assert est <= 3 * held, (name, est, held)
