"""Delta weight updates, in process: the codec."""
import struct

import numpy as np
import pytest
import torch

from toolrl.protocol import hasher
from toolrl.weightsync.delta import BLOCK, DeltaApplier, DeltaMismatch, block_plan, encode


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
    h = hasher("m")
    ap = DeltaApplier(region, 0, blocks, h)
    for a in range(0, len(body), 999):  # in pieces, as they arrive
        ap.feed(body[a:a + 999])
        while ap.step():
            pass
    want = hasher("m")
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
    want = hasher("m")
    want.update(b"".join(bytes(v) for v in new_views))
    bad_bodies = []
    for at in range(0, len(body), max(1, len(body) // 50)):  # a bit flipped anywhere
        bad = bytearray(body)
        bad[at] ^= 0x10
        bad_bodies.append(bad)
    bad_bodies += [body[:-1], body + b"\0\0\0\0"]
    for bad in bad_bodies:
        region = bytearray(old)
        ap = DeltaApplier(region, 0, blocks, hasher("m"))
        with pytest.raises(DeltaMismatch):
            ap.feed(bytes(bad))
            while ap.step():
                pass
            ap.finish(want.hexdigest())
    # a delta applied to another base than its own: the result's checksum catches it
    other = bytearray(old)
    other[5] ^= 1
    ap = DeltaApplier(other, 0, blocks, hasher("m"))
    ap.feed(bytes(body))
    while ap.step():
        pass
    with pytest.raises(DeltaMismatch, match="does not match its checksum"):
        ap.finish(want.hexdigest())
