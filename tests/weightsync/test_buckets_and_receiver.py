"""Weight updates on the wire and on the worker's disk, without an engine: framing that streams
from the tensors' memory, the receiving side that streams into slot files and checks each
bucket's place from its header, and the loader's reader that takes each bucket as soon as it is
ready. (tests/test_gen_worker.py pushes real updates into a real vLLM worker.)"""
import asyncio
import json
import struct
import threading
import time

import pytest
import torch
from safetensors.torch import load, save

from toolrl.protocol import CorruptPayload, PayloadTooLarge, pack
from toolrl.weightsync.buckets import bucketize, encode_weight_bucket, frame_weight_bucket
from toolrl.weightsync.receiver import WeightAssembler, abort_file, bucket_file, ready_file
from toolrl.weightsync.transport import BucketOrderError, UpdateAborted
from toolrl.weightsync.vllm_ext import iter_bucket_files


def _named(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [("model.embed.weight", torch.randn(64, 16, generator=g)),
            ("model.layers.0.w", torch.randn(32, 16, generator=g).to(torch.bfloat16)),
            ("model.layers.0.b", torch.randn(16, generator=g)),
            ("model.norm.weight", torch.ones(16)),
            ("model.step", torch.arange(3))]


def test_framing_is_safetensors_own_layout():
    """The streamed framing lays tensors out exactly as safetensors does; only the order of the
    metadata keys in the header may differ (safetensors keeps them in a hash map)."""
    tensors = dict(_named())
    ours = pack("s", {"a": 1}, tensors)
    hl = struct.unpack("<Q", ours[:8])[0]
    header = json.loads(ours[8:8 + hl])
    theirs = save(tensors, metadata=header["__metadata__"])
    assert len(ours) == len(theirs)
    assert ours[8 + hl:] == theirs[8 + hl:]  # the data region, byte for byte
    assert json.loads(theirs[8:8 + hl]) == header
    back = load(ours)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())


def test_frame_does_not_copy_the_tensors():
    w = torch.zeros(1000)
    _, views = frame_weight_bucket([("w", w)], 1, 0, 1)
    w[0] = 7.0  # the view is the tensor's memory: what is streamed is what the tensor holds
    assert torch.frombuffer(views[0], dtype=torch.float32)[0].item() == 7.0


async def _chunks(data: bytes, size: int = 1000):
    for a in range(0, len(data), size):
        yield data[a:a + size]
        await asyncio.sleep(0)


def _bodies(named, version, bucket_bytes=1024):
    buckets = bucketize(named, bucket_bytes)
    return [encode_weight_bucket(b, version, i, len(buckets)) for i, b in enumerate(buckets)]


def test_buckets_stream_to_files_in_order_and_load_back(tmp_path):
    named = _named()
    bodies = _bodies(named, version=3)
    assert len(bodies) >= 3
    a = WeightAssembler(tmp_path / "w")
    started = []

    async def run():
        for body in bodies:
            bucket, update = await a.receive(_chunks(body), min_version=0, on_new=started.append)
        return update

    update = asyncio.run(run())
    assert len(started) == 1 and started[0] is update and update.next_index == update.count == len(bodies)
    slots = [update.dir / bucket_file(i) for i in range(len(bodies))]
    assert [f.read_bytes() for f in slots] == bodies  # streamed into the slots byte for byte
    assert all((update.dir / ready_file(update.id, i)).exists() for i in range(len(bodies)))
    got = list(iter_bucket_files(str(update.dir), update.id, update.count, timeout_s=5))
    assert sorted(n for n, _ in got) == sorted(n for n, _ in named) and len(got) == len(named)
    for name, t in named:
        assert torch.equal(dict(got)[name], t)
    a.discard(update)
    assert not list(update.dir.glob("ready-*")) and all(f.exists() for f in slots)  # slots stay for reuse

    newer = _bodies(_named(seed=1), version=4)
    update = asyncio.run(run_all(a, newer))
    assert [f.read_bytes() for f in slots] == newer  # the same slot files, overwritten in place
    got = dict(iter_bucket_files(str(update.dir), update.id, update.count, timeout_s=5))
    assert all(torch.equal(got[n], t) for n, t in _named(seed=1))
    a.close()
    assert not (tmp_path / "w").exists()


async def run_all(a, bodies):
    for body in bodies:
        _, update = await a.receive(_chunks(body), 0)
    return update


def test_a_new_update_waits_until_the_last_whole_one_is_loaded(tmp_path):
    """The loader of a whole update may still be reading the slots: the next update must not
    overwrite them until it is done, or the loaded weights would be a mix."""
    a = WeightAssembler(tmp_path / "w", wait_s=5)

    async def run():
        first = await run_all(a, _bodies(_named(), version=1))
        loaded = asyncio.Event()

        async def load():
            await asyncio.sleep(0.3)
            loaded.set()
        first.task = asyncio.create_task(load())
        await a.receive(_chunks(_bodies(_named(1), version=2)[0]), 0)
        assert loaded.is_set()
        assert not first.aborted

    asyncio.run(run())


def test_a_superseded_bucket_writes_nothing_more_into_the_slot_the_new_update_fills(tmp_path):
    """Two senders of bucket 0 at once (a relay replaced while it still sends): once the newer one
    starts, the older one's later chunks must not land in the slot the newer one is filling."""
    a = WeightAssembler(tmp_path / "w")
    old, new = _bodies(_named(), version=1)[0], _bodies(_named(seed=1), version=2)[0]
    assert len(old) == len(new)
    resume = asyncio.Event()

    async def stalled(body):
        yield body[:len(body) // 2]
        await resume.wait()
        yield body[len(body) // 2:]

    async def run():
        first = asyncio.create_task(a.receive(stalled(old), 0))
        await asyncio.sleep(0.05)
        _, update = await a.receive(_chunks(new), 0)
        resume.set()
        with pytest.raises(UpdateAborted):
            await first
        return update
    update = asyncio.run(run())
    assert (update.dir / bucket_file(0)).read_bytes() == new
    a.close()


def test_misplaced_buckets_are_refused_from_their_header(tmp_path):
    bodies = _bodies(_named(), version=5)
    a = WeightAssembler(tmp_path / "w")
    fed = []

    async def header_then_count(body):
        end = 8 + struct.unpack("<Q", body[:8])[0]
        yield body[:end]  # the header alone decides
        fed.append("body")
        yield body[end:]

    async def run():
        with pytest.raises(BucketOrderError, match="bucket 0 of a new update"):
            await a.receive(header_then_count(bodies[1]), 0)
        with pytest.raises(BucketOrderError, match="older than the loaded 6"):
            await a.receive(header_then_count(bodies[0]), min_version=6)
        await a.receive(_chunks(bodies[0]), 0)
        with pytest.raises(BucketOrderError, match="expected bucket 1/"):
            await a.receive(header_then_count(bodies[2]), 0)
        return a.update

    update = asyncio.run(run())
    assert fed == []  # no misplaced body was read past its header
    assert update.next_index == 1 and not update.aborted  # a stray bucket does not spoil the update


def test_a_bad_bucket_aborts_its_update_and_a_new_update_supersedes(tmp_path):
    bodies = _bodies(_named(), version=2)
    a = WeightAssembler(tmp_path / "w")

    async def run():
        _, first = await a.receive(_chunks(bodies[0]), 0)
        bad = bytearray(bodies[1])
        bad[-5] ^= 1
        with pytest.raises(CorruptPayload, match="checksum"):
            await a.receive(_chunks(bytes(bad)), 0)
        assert first.aborted and (first.dir / abort_file(first.id)).exists()
        assert not (first.dir / ready_file(first.id, 1)).exists()
        with pytest.raises(BucketOrderError):  # the rest of an aborted update has nowhere to go
            await a.receive(_chunks(bodies[1]), 0)
        _, second = await a.receive(_chunks(bodies[0]), 0)
        newer = _bodies(_named(1), version=3)
        _, third = await a.receive(_chunks(newer[0]), 0)  # version 3 starts before 2 is whole
        assert second.aborted and not third.aborted and a.update is third
        with pytest.raises(CorruptPayload, match="truncated"):
            await a.receive(_chunks(newer[1][:-10]), 0)
        assert third.aborted

    asyncio.run(run())


def test_oversized_bucket_stops_at_the_limit(tmp_path):
    """Both bounds hold: a whole update's, and one bucket's (a body sent without Content-Length
    must not grow past MAX_WEIGHTS_BYTES just because the update's limit is larger)."""
    body = _bodies(_named(), version=1, bucket_bytes=1 << 20)[0]
    by_update = WeightAssembler(tmp_path / "w", max_bytes=len(body) - 1)
    by_bucket = WeightAssembler(tmp_path / "b", max_bytes=1 << 30, max_bucket_bytes=len(body) - 1)

    async def run():
        for a in (by_update, by_bucket):
            with pytest.raises(PayloadTooLarge):
                await a.receive(_chunks(body), 0)
            assert a.update is None or a.update.aborted

    asyncio.run(run())


def test_loader_reads_each_bucket_as_it_is_ready_and_gives_up_on_abort_or_timeout(tmp_path):
    bodies = _bodies(_named(), version=1)
    d = tmp_path / "u"
    d.mkdir()
    arrived = []

    def deliver():
        for i, body in enumerate(bodies):
            time.sleep(0.2)
            (d / bucket_file(i)).write_bytes(body)
            (d / ready_file(7, i)).touch()
            arrived.append(time.monotonic())

    t = threading.Thread(target=deliver)
    t.start()
    got_at = []
    for _ in iter_bucket_files(str(d), 7, len(bodies), timeout_s=5):
        got_at.append(time.monotonic())
    t.join()
    assert got_at[0] < arrived[-1]  # the first tensors were read before the last bucket was there

    with pytest.raises(TimeoutError, match="did not arrive"):
        list(iter_bucket_files(str(d), 8, 1, timeout_s=0.2))  # another update's markers do not count
    (d / abort_file(7)).touch()
    with pytest.raises(RuntimeError, match="aborted"):
        list(iter_bucket_files(str(d), 7, 1, timeout_s=5))  # aborted: even a ready bucket is not read


def test_update_aborted_is_raised_for_a_bucket_that_finishes_after_being_superseded(tmp_path):
    bodies = _bodies(_named(), version=1)
    a = WeightAssembler(tmp_path / "w")

    async def run():
        await a.receive(_chunks(bodies[0]), 0)

        async def slow():
            async for c in _chunks(bodies[1]):
                yield c
                if a.update.version == 1:
                    a.update.abort()  # as a newer update's first bucket would

        with pytest.raises(UpdateAborted):
            await a.receive(slow(), 0)

    asyncio.run(run())


def test_every_bucket_of_an_update_comes_from_the_sender_of_its_first(tmp_path):
    """In a fan-out tree a worker's parent may give up on it and serve its children itself while it
    goes on sending: its buckets must not interleave with the new sender's (tag: each sender's)."""
    bodies = _bodies(_named(), version=2)
    a = WeightAssembler(tmp_path / "w")
    stopped = []

    async def run():
        _, old = await a.receive(_chunks(bodies[0]), 0, tag="parent-a")
        old.on_abort.append(lambda: stopped.append("relay"))
        await a.receive(_chunks(bodies[1]), 0, tag="parent-a")
        _, new = await a.receive(_chunks(bodies[0]), 0, tag="parent-b")  # bucket 0 from elsewhere supersedes
        assert old.aborted and stopped == ["relay"] and new.tag == "parent-b"
        with pytest.raises(BucketOrderError, match="another sender"):
            await a.receive(_chunks(bodies[1]), 0, tag="parent-a")
        with pytest.raises(BucketOrderError, match="another sender"):
            await a.receive(_chunks(bodies[1]), 0)  # nor a direct push's
        for body in bodies[1:]:
            await a.receive(_chunks(body), 0, tag="parent-b")
        return new

    new = asyncio.run(run())
    assert new.next_index == new.count and not new.aborted


@pytest.mark.parametrize("offset", ["Infinity", "1e400"])
def test_a_bucket_with_an_infinite_offset_is_corrupt_not_a_crash(offset):
    from toolrl.protocol import WIRE_VERSION
    from toolrl.weightsync.buckets import SCHEMA_WEIGHTS, WeightBucketReader
    from toolrl.weightsync.delta import DeltaMismatch, block_plan

    meta = json.dumps({"version": 1, "index": 0, "count": 1, "names": ["w"]})
    head = ('{"__metadata__":{"schema":"%s","version":"%d","meta":%s,"xxh3_64":"0"},'
            '"w":{"dtype":"F32","shape":[1],"data_offsets":[0,%s]}}' % (SCHEMA_WEIGHTS, WIRE_VERSION,
                                                                      json.dumps(meta), offset)).encode()
    head += b" " * (-len(head) % 8)
    with pytest.raises(CorruptPayload, match="data_offsets"):  # a 400 at the worker, not a 500
        WeightBucketReader(lambda _: None).feed(struct.pack("<Q", len(head)) + head)
    with pytest.raises(DeltaMismatch, match="data_offsets"):
        block_plan({"w": {"dtype": "F32", "data_offsets": [0, float("inf")]}})


def test_a_workers_version_never_goes_back_to_a_late_older_update(tmp_path):
    """A relay cut off from the learner may still send an older update while a newer one loads:
    its first bucket is refused, before and after waiting for the newer load, and the gate keeps
    the newer version (it went 4 -> 6 -> 5 before)."""
    from toolrl.weightsync.gate import WeightGate
    from toolrl.worker.standin import RecordingEngine

    class SlowEngine(RecordingEngine):
        async def load_buckets(self, d, uid, count, timeout_s):
            await asyncio.sleep(0.5)
            return await super().load_buckets(d, uid, count, timeout_s)

    async def push(gate, bodies):
        ans = None
        for b in bodies:
            ans = await gate.receive_bucket(_chunks(b))
        return ans

    async def run():
        gate = WeightGate(SlowEngine(), WeightAssembler(tmp_path / "w", wait_s=10), 5, 5)
        gate.version = 4
        newer = asyncio.create_task(push(gate, _bodies(_named(6), version=6)))
        await asyncio.sleep(0.2)  # version 6 is whole and loading
        with pytest.raises(BucketOrderError, match="older than version 6"):
            await push(gate, _bodies(_named(5), version=5))
        assert (await newer)["loaded"] and gate.version == 6
        with pytest.raises(BucketOrderError, match="older than the loaded 6"):
            await push(gate, _bodies(_named(5), version=5))
        assert gate.version == 6

    asyncio.run(run())


def test_a_huge_bucket_count_is_refused_and_the_largest_allowed_costs_no_stall(tmp_path):
    """A bucket 0 declaring a million buckets, then a loader that gives up: dropping the update
    unlinked a million marker files on the event loop, 13.5 s with HTTP, rollouts and heartbeats
    frozen (found in review). The count is bounded, and dropping costs what was received."""
    from toolrl.weightsync.buckets import MAX_BUCKETS

    a = WeightAssembler(tmp_path / "w")
    tensor = [("w", torch.zeros(4))]

    async def run():
        with pytest.raises(CorruptPayload, match="count"):
            await a.receive(_chunks(encode_weight_bucket(tensor, version=1, index=0, count=1_000_000)), 0)
        _, update = await a.receive(_chunks(encode_weight_bucket(tensor, version=2, index=0, count=MAX_BUCKETS)), 0)
        assert (update.dir / ready_file(update.id, 0)).exists()
        t = time.perf_counter()
        a.discard(update)
        took = time.perf_counter() - t
        assert not (update.dir / ready_file(update.id, 0)).exists()
        return took

    assert asyncio.run(run()) < 0.5


def test_a_slow_steady_link_loads_however_long_a_bucket_takes(tmp_path):
    """Each bucket had to be whole within sync_timeout_s of wall clock, though bytes kept flowing:
    a 1 GB bucket at 6 MiB/s against 120 s failed every load and closed the gate, so the worker
    stopped generating (found in review). Here 4 MiB buckets at 1.5 MiB/s (about 2.7 s each) against
    a 2 s wait: the wait counts from the last byte, and the update loads."""
    import httpx

    from toolrl.net import free_port
    from toolrl.weightsync.egress import Egress
    from toolrl.weightsync.http import push_weights
    from toolrl.worker.standin import standin_service

    named = [(f"layer{i}.weight", torch.randn(1024, 1024)) for i in range(3)]
    with standin_service("slow", free_port(), "tok", tmp_path / "standin.log", timeout_s=2.0) as svc:
        t = time.time()
        answer = push_weights(svc.url, named, 1, token="tok", bucket_mb=4, timeout_s=2.0, egress=Egress(1.5))
        took = time.time() - t
        state = httpx.get(svc.url + "/loaded", headers={"Authorization": "Bearer tok"}).json()
    assert answer["loaded"] and answer["version"] == 1 and took > 6, (answer, took)
    assert state["weights_ok"] and state["version"] == 1
