"""Delta weight updates, in process: the codec, the worker's assembler applying deltas onto its slot
files (real WeightAssembler, real loader reader, the learner's real Outgoing), and whom the learner
sends deltas to. The same through real worker processes and the real learner:
tests/weightsync/test_delta_sync.py."""
import asyncio
import struct
import threading

import numpy as np
import pytest
import torch

from toolrl.config import ConfigError, load_config
from toolrl.protocol import hasher
from toolrl.weightsync.buckets import WeightBucketReader
from toolrl.weightsync.delta import BLOCK, DeltaApplier, DeltaMismatch, block_plan, encode
from toolrl.weightsync.http import HttpTransport
from toolrl.weightsync.outgoing import LastSent, Outgoing
from toolrl.weightsync.pusher import WeightSync
from toolrl.worker.standin import FixedRegistry
from toolrl.weightsync.receiver import WeightAssembler, bucket_file
from toolrl.weightsync.transport import BaseMissing, WeightSyncError
from toolrl.weightsync.vllm_ext import iter_bucket_files


def _named(changed=(), seed=0):
    """A small model: bf16 matrices (one over a block), fp32, int64 and bool tensors. `changed`:
    the tensors moved by a small step, as a training step moves them."""
    g = torch.Generator().manual_seed(seed)
    named = [("embed", torch.randn(1200, 512, generator=g).to(torch.bfloat16)),  # 1.2 MB: two blocks
             *[(f"layers.{i}.w", torch.randn(128, 256, generator=g).to(torch.bfloat16)) for i in range(4)],
             ("norm", torch.randn(300, generator=g)), ("step", torch.arange(7)),
             ("mask", torch.rand(33, generator=g) > 0.5)]
    out = []
    for n, t in named:
        if n in changed:
            if t.dtype == torch.bool:
                t = ~t
            elif t.is_floating_point():
                t = (t.float() + 2e-2 * torch.randn(t.shape, generator=g)).to(t.dtype)
            else:
                t = t + 1
        out.append((n, t))
    return out


def _region(named):
    """A data region as frame lays it out, with its safetensors table."""
    from toolrl.protocol import frame
    header, views = frame("toolrl.weights", {}, dict(named))
    table = read_table(header)
    return header, views, table


def read_table(header: bytes) -> dict:
    import json
    (hl,) = struct.unpack("<Q", header[:8])
    return {k: v for k, v in json.loads(header[8:8 + hl]).items() if k != "__metadata__"}


def test_the_codec_gives_back_the_new_bytes_exactly_for_every_dtype():
    old_h, old_views, table = _region(_named())
    _, new_views, new_table = _region(_named(changed={"embed", "norm", "step", "mask"}))
    assert table == new_table
    blocks, n = block_plan(table)
    assert any(b - a == BLOCK for a, b, _ in blocks)  # the embedding spans blocks
    base = np.frombuffer(b"".join(bytes(v) for v in old_views), dtype=np.uint8).copy()
    body = encode(new_views, base, blocks)
    new = b"".join(bytes(v) for v in new_views)
    assert base.tobytes() == new  # the learner's copy is now the new version
    region = bytearray(b"".join(bytes(v) for v in old_views))
    h = hasher("m", {})
    ap = DeltaApplier(region, 0, blocks, h)
    for a in range(0, len(body), 999):  # in pieces, as they arrive
        ap.feed(body[a:a + 999])
        while ap.step():
            pass
    want = hasher("m", {})
    want.update(new)
    ap.finish(want.hexdigest())
    assert bytes(region) == new
    # the unchanged layers cost four bytes a block
    assert len(body) < 0.6 * len(new)


def test_a_corrupted_delta_is_an_error_never_a_wrong_weight():
    _, old_views, table = _region(_named())
    _, new_views, _ = _region(_named(changed={"layers.1.w"}))
    blocks, _ = block_plan(table)
    old = b"".join(bytes(v) for v in old_views)
    body = encode(new_views, np.frombuffer(old, dtype=np.uint8).copy(), blocks)
    want = hasher("m", {})
    want.update(b"".join(bytes(v) for v in new_views))
    bad_bodies = []
    for at in range(0, len(body), max(1, len(body) // 50)):  # a bit flipped anywhere
        bad = bytearray(body)
        bad[at] ^= 0x10
        bad_bodies.append(bad)
    bad_bodies += [body[:-1], body + b"\0\0\0\0"]
    for bad in bad_bodies:
        region = bytearray(old)
        ap = DeltaApplier(region, 0, blocks, hasher("m", {}))
        with pytest.raises(DeltaMismatch):
            ap.feed(bytes(bad))
            while ap.step():
                pass
            ap.finish(want.hexdigest())
    # a delta applied to another base than its own: the result's checksum catches it
    other = bytearray(old)
    other[5] ^= 1
    ap = DeltaApplier(other, 0, blocks, hasher("m", {}))
    ap.feed(bytes(body))
    while ap.step():
        pass
    with pytest.raises(DeltaMismatch, match="does not match its checksum"):
        ap.finish(want.hexdigest())


# -- the worker's assembler, in process ------------------------------------------------------------

async def _chunks(data: bytes, size: int = 65536):
    for a in range(0, len(data), size):
        yield data[a:a + size]
        await asyncio.sleep(0)


def _bytes(framed) -> bytes:
    header, views = framed
    return b"".join([header, *(bytes(v) for v in views)])


def _push(assembler: WeightAssembler, out: Outgoing, delta: bool):
    async def run():
        for i in range(out.count):
            framed = (out.delta(i) if delta else None) or out.full(i)
            _, u = await assembler.receive(_chunks(_bytes(framed)))
        return u
    u = asyncio.run(run())
    loaded = {n: t.clone() for n, t in iter_bucket_files(str(u.dir), u.id, u.count, 5)}
    assembler.discard(u)
    return u, loaded


def _equal(loaded: dict, named) -> bool:
    return set(loaded) == {n for n, _ in named} and all(
        loaded[n].dtype == t.dtype and loaded[n].shape == t.shape and torch.equal(loaded[n], t) for n, t in named)


@pytest.mark.parametrize("versions", [(1, 2, 3), (9, 10, 10**15)])  # 10**15: every bucket's header grows
def test_deltas_onto_the_slots_give_what_a_full_push_gives(tmp_path, versions):
    last = LastSent()
    a, b = WeightAssembler(tmp_path / "a"), WeightAssembler(tmp_path / "b")
    steps = [(), ("embed", "layers.2.w"), ("norm", "step", "mask")]
    prev, data_at = None, {}
    for version, changed in zip(versions, steps):
        named = _named(changed=changed)
        out = Outgoing(named, version, 256 << 10, last)  # several buckets
        _, via_delta = _push(a, out, delta=True)
        last.encoder.join(10)
        _, via_full = _push(b, Outgoing(named, version, 256 << 10), delta=False)
        assert out.base == prev and out.count > 2
        prev = version
        assert _equal(via_delta, named) and _equal(via_full, named)
        assert a.holds() == version
        if out.base is not None:  # the buckets went as deltas (but a tiny one, whole), the slots as a full push's
            assert all(out.delta(i) is not None or len(_bytes(out.full(i))) < 4096 for i in range(out.count))
            for i in range(out.count):
                sa = (tmp_path / "a" / bucket_file(i)).read_bytes()
                sb = (tmp_path / "b" / bucket_file(i)).read_bytes()
                ra, rb = _reader(sa), _reader(sb)
                assert ra.expected_hash == rb.expected_hash and sa[ra.data_at:] == sb[rb.data_at:]
                if version == 10**15:  # the data region was moved down in place, behind the longer header
                    assert ra.data_at > data_at[i]
                data_at[i] = ra.data_at
    a.close()
    b.close()


def _reader(data: bytes) -> WeightBucketReader:
    r = WeightBucketReader(lambda _: None)
    r.feed(data)
    r.finish()
    return r


def test_a_delta_for_a_base_the_worker_does_not_hold_is_refused_before_anything_starts(tmp_path):
    last = LastSent()
    Outgoing(_named(), 1, 256 << 10, last).delta(0)
    last.encoder.join(10)
    out = Outgoing(_named(changed={"embed"}), 6, 256 << 10, last)  # newer than the half update below
    assert out.base == 1
    fresh = WeightAssembler(tmp_path / "fresh")
    started = []

    async def first(a):
        return await a.receive(_chunks(_bytes(out.delta(0))), on_new=started.append)
    with pytest.raises(BaseMissing) as err:
        asyncio.run(first(fresh))
    assert err.value.holds is None and not started and fresh.update is None

    # a worker whose last update broke off half-way holds no whole version
    held = WeightAssembler(tmp_path / "held")
    _push(held, Outgoing(_named(), 1, 256 << 10), delta=False)
    assert held.holds() == 1
    half = Outgoing(_named(changed={"norm"}), 5, 256 << 10)

    async def part():
        await held.receive(_chunks(_bytes(half.full(0))))
    asyncio.run(part())
    assert held.holds() is None
    with pytest.raises(BaseMissing, match="slot 0 holds bucket 0/3 of version 5") as err:
        asyncio.run(first(held))
    assert err.value.holds is None
    fresh.close()
    held.close()


def test_a_delta_that_does_not_apply_leaves_the_slot_holding_nothing(tmp_path, monkeypatch):
    last = LastSent()
    Outgoing(_named(), 1, 1 << 30, last).delta(0)  # one bucket
    last.encoder.join(10)
    a = WeightAssembler(tmp_path / "a")
    _push(a, Outgoing(_named(), 1, 1 << 30), delta=False)
    import toolrl.weightsync.outgoing as og
    real = og.encode

    def corrupt(*args, **kw):
        body = real(*args, **kw)
        body[len(body) // 2] ^= 0x40  # made wrong before it is framed: the payload checksum holds
        return body
    monkeypatch.setattr(og, "encode", corrupt)
    out = Outgoing(_named(changed={"embed", "norm"}), 2, 1 << 30, last)
    with pytest.raises(DeltaMismatch):
        _push(a, out, delta=True)
    assert a.holds() is None  # the next delta is refused; a full update is needed
    _, loaded = _push(a, Outgoing(_named(changed={"embed", "norm"}), 2, 1 << 30), delta=False)
    assert _equal(loaded, _named(changed={"embed", "norm"})) and a.holds() == 2
    a.close()


# -- who the learner sends deltas to ---------------------------------------------------------------

class DeltaRecorder:
    """A transport that frames (prepare) and records each push as delta or full: the base is the
    last version prepared, as the HTTP transport's is when the layout holds."""
    name = "record"

    def __init__(self, fail=()):
        self.kept, self.sent, self.fail = None, [], set(fail)

    def prepare(self, named, version, keep):
        base = self.kept if keep else None
        self.kept = version if keep else None
        return base

    def release(self):
        return None

    def push(self, worker, named, version, delta=False):
        self.sent.append((worker["id"], "delta" if delta else "full"))
        if worker["id"] in self.fail:
            raise WeightSyncError(f"{worker['id']}: unreachable")
        return {"version": version, "loaded": True}

    def forget(self, live):
        pass


WORKERS = [{"id": "local", "url": "http://127.0.0.1:8300"}, {"id": "remote", "url": "http://10.0.0.7:8300"}]


@pytest.mark.parametrize("mode, second", [("auto", {"local": "full", "remote": "delta"}),
                                          ("on", {"local": "delta", "remote": "delta"}),
                                          ("off", {"local": "full", "remote": "full"})])
def test_deltas_go_to_the_workers_that_confirmed_the_last_version_as_sync_delta_says(mode, second):
    cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled", "ref_server.token=t",
                                                f"learner.sync_delta={mode}", "learner.sync_retries=0"])
    t = DeltaRecorder()
    s = WeightSync(cfg, FixedRegistry(WORKERS), transport=t)
    s.push([], 1)
    assert dict(t.sent) == {"local": "full", "remote": "full"}  # nothing kept yet
    t.sent.clear()
    s.push([], 2)
    assert dict(t.sent) == second
    t.sent.clear()
    t.fail = {"remote"}
    s.push([], 3)  # a failed push: the worker may hold anything
    t.fail = set()
    t.sent.clear()
    s.push([], 4)
    assert dict(t.sent)["remote"] == "full"
    assert (t.kept is None) == (mode == "off")  # off keeps no copy of the weights


def test_sync_delta_reads_yaml_on_and_off_and_is_an_http_option():
    for given, want in [("on", "on"), ("off", "off"), ("auto", "auto"), ("true", "on"), ("false", "off")]:
        assert load_config("configs/cpu_tiny.yaml", [f"learner.sync_delta={given}"]).learner.sync_delta == want
    assert load_config("configs/cpu_tiny.yaml").learner.sync_delta == "auto"
    with pytest.raises(ConfigError, match="http only"):
        load_config("configs/cpu_tiny.yaml", ["learner.sync_transport=process_group", "learner.sync_delta=on"])


def test_a_stuck_encoder_or_a_failing_prepare_costs_the_deltas_never_the_sync():
    t = HttpTransport(None, 1, timeout_s=0.2)
    assert t.prepare(_named(), 1, keep=True) is None  # the first version: kept, no base
    t.last.encoder.join(10)
    stuck = threading.Event()
    t.last.encoder = threading.Thread(target=stuck.wait, args=(10,), daemon=True)
    t.last.encoder.start()
    old = t.last
    assert t.prepare(_named(changed={"embed"}), 2, keep=True) is None  # not a base while it is written
    t.release()
    stuck.set()
    assert t.last is not old
    t.last.encoder.join(10)
    assert t.last.version == 2  # kept afresh: the next sync has its base

    class Broken(DeltaRecorder):
        def prepare(self, named, version, keep):
            raise RuntimeError("out of memory")
    cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled", "ref_server.token=t",
                                                "learner.sync_delta=on"])
    b = Broken()
    assert WeightSync(cfg, FixedRegistry(WORKERS), transport=b).push([], 1)["workers_ok"] == 2
    assert dict(b.sent) == {"local": "full", "remote": "full"}
