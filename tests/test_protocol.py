"""The wire format: exact round trips, and a typed error for every malformed payload."""
import json
import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from toolrl.protocol import (
    COMPLETION_TOKEN_BYTES, PROMPT_TOKEN_BYTES, CorruptPayload, PayloadTooLarge, Sample, SampleTooLong,
    SchemaMismatch, ToolCall, WireFormatError, decode_samples, encode_samples, pack, samples_held_bytes,
)
from toolrl.weightsync.buckets import bucketize, decode_weight_bucket, encode_weight_bucket

finite = st.floats(min_value=-50, max_value=0, allow_nan=False, width=32)


@st.composite
def samples(draw):
    n = draw(st.integers(0, 40))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    logp = [draw(finite) if m else None for m in mask]
    with_ref = draw(st.booleans())
    version = draw(st.integers(0, 10**6))
    starts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3))) if n > 1 else []
    runs = [(0, version)] + [(a, version + k + 1) for k, a in enumerate(starts)] if draw(st.booleans()) else []
    return Sample(
        prompt_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=30)),
        completion_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        loss_mask=mask, logprobs=logp,
        rewards=draw(st.dictionaries(st.text(min_size=1, max_size=8), st.floats(-10, 10), max_size=3)),
        reward=draw(st.floats(-10, 10)), advantage=draw(st.floats(-10, 10)),
        group_id=draw(st.text(max_size=12)), policy_version=version, version_runs=runs,
        ref_logprobs=[draw(finite) for _ in range(n)] if with_ref else None,
        stop_reason=draw(st.sampled_from(["eos", "length", "max_tool_calls"])),
        tool_calls=[ToolCall(code=draw(st.text(max_size=20)), status="ok", output=draw(st.text(max_size=20)))],
        text=draw(st.text(max_size=50)),
    )


@st.composite
def groups(draw):
    first = draw(samples())
    rest = draw(st.lists(samples(), max_size=4))
    ref = first.ref_logprobs is not None
    fixed = [s.model_copy(update={"ref_logprobs": ([0.0] * len(s.completion_ids) if ref else None)}) for s in rest]
    return [first] + fixed


def _example() -> list[Sample]:
    return [Sample(prompt_ids=[1, 2, 3], completion_ids=[4, 5, 6, 7], loss_mask=[1, 0, 0, 1],
                   logprobs=[-0.5, None, None, -1.25], rewards={"correct": 1.0, "format": 0.1}, reward=1.1,
                   advantage=0.7, group_id="g0", policy_version=3, stop_reason="eos",
                   tool_calls=[ToolCall(code="print(2)", status="ok", output="2\n")], text="abc"),
            Sample(prompt_ids=[9], completion_ids=[], loss_mask=[], logprobs=[], group_id="g0", policy_version=3)]


@settings(max_examples=150, deadline=None)
@given(groups(), st.dictionaries(st.sampled_from(["worker", "note"]), st.text(max_size=10), max_size=2))
def test_samples_round_trip_exactly(group, extra):
    back, meta = decode_samples(encode_samples(group, **extra))
    assert back == group
    assert meta == extra


def test_version_runs_record_every_tokens_policy_and_cannot_hide_an_older_one():
    base = dict(prompt_ids=[1], completion_ids=[4, 5, 6, 7, 8], loss_mask=[1, 1, 0, 1, 1],
                logprobs=[-0.1, -0.1, None, -0.2, -0.2], group_id="g")
    s = Sample(**base, policy_version=2, version_runs=[(0, 2), (3, 4)])
    assert s.token_versions() == [2, 2, 2, 4, 4] and s.newest_version == 4
    assert Sample(**base, policy_version=2).token_versions() == [2] * 5
    bad = {"claims a newer version than its oldest token's": dict(policy_version=4, version_runs=[(0, 2), (3, 4)]),
           "runs that do not start at token 0": dict(policy_version=2, version_runs=[(1, 2)]),
           "a version going back": dict(policy_version=2, version_runs=[(0, 2), (3, 1)]),
           "a run past the completion": dict(policy_version=2, version_runs=[(0, 2), (5, 3)]),
           "a repeated start": dict(policy_version=2, version_runs=[(0, 2), (3, 3), (3, 4)])}
    for why, fields in bad.items():
        with pytest.raises(ValidationError, match="version_runs"):
            Sample(**base, **fields)
            pytest.fail(why)


def test_a_sample_whose_newest_token_is_ahead_of_the_learner_is_not_admitted():
    from toolrl.refserver.checks import AheadOfLearner, Refused, check_versions

    s = Sample(prompt_ids=[1], completion_ids=[4, 5], loss_mask=[1, 1], logprobs=[-0.1, -0.1], group_id="g",
               policy_version=2, version_runs=[(0, 2), (1, 9)])
    check_versions([s.model_copy(update={"version_runs": [(0, 2), (1, 3)]})], 3, True)
    with pytest.raises(Refused, match="v9"):
        check_versions([s], 3, True)
    with pytest.raises(AheadOfLearner):
        check_versions([s.model_copy(update={"version_runs": [(0, 2), (1, 4)]})], 3, True)


def test_masked_logprobs_stay_null_and_floats_exact():
    back, _ = decode_samples(encode_samples(_example()))
    assert back[0].logprobs == [-0.5, None, None, -1.25]
    assert back[0].loss_mask == [1, 0, 0, 1]
    assert back[0].advantage == 0.7 and back[1].completion_ids == []


def test_lengths_and_counts_are_refused_from_the_tensors_before_any_list_is_built(monkeypatch):
    """A 60 MB upload of 16M tokens is legal on the wire; as Python lists it took ~0.9 GB before the
    length check refused it. The bounds now apply to the offsets first."""
    payload = encode_samples(_example())  # 7 and 1 tokens
    assert len(decode_samples(payload, max_tokens=7, max_samples=2)[0]) == 2
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("tolist before the bounds"))
    with pytest.raises(SampleTooLong, match="sample 0: 7 tokens, over the model.s 6 positions"):
        decode_samples(payload, max_tokens=6)
    with pytest.raises(PayloadTooLarge, match="a group of 2 samples can never fit the limit of 1"):
        decode_samples(payload, max_samples=1)


def test_a_group_too_large_once_decoded_is_refused_before_its_lists_are_built(monkeypatch):
    """The receiver's memory bound counts decoded samples (~12x their wire size): a 64 MiB upload held
    ~790 MiB before the queue's 512 MiB bound refused it, four decoding at once."""
    payload = encode_samples(_example())
    held = sum(PROMPT_TOKEN_BYTES * len(s.prompt_ids) + COMPLETION_TOKEN_BYTES * len(s.completion_ids)
               for s in _example())
    assert len(decode_samples(payload, max_held_bytes=held)[0]) == 2  # the bound itself is allowed
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("tolist before the bound"))
    with pytest.raises(PayloadTooLarge, match=f"would hold ~{held} bytes once decoded, over the limit of {held - 1}"):
        decode_samples(payload, max_held_bytes=held - 1)
    # the same estimate from the header alone, for the receiver's budget; a forged shape estimates nothing
    assert samples_held_bytes(payload) == held
    n = struct.unpack("<Q", payload[:8])[0]
    header = json.loads(payload[8:8 + n])
    for shape in ([-10**9], [10**30], ["7"], 7):
        header["completion_ids"]["shape"] = shape
        raw = json.dumps(header).encode()
        assert samples_held_bytes(struct.pack("<Q", len(raw)) + raw + payload[8 + n:]) == 0, shape
    assert samples_held_bytes(b"short") == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_rejected(blob):
    with pytest.raises(WireFormatError):
        decode_samples(blob)


VALID = encode_samples(_example())


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(VALID) - 1))
def test_every_truncation_rejected(cut):
    with pytest.raises(WireFormatError):
        decode_samples(VALID[:cut])


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(VALID) - 1), st.integers(1, 255))
def test_any_flipped_byte_is_rejected_or_harmless(pos, xor):
    bad = bytearray(VALID)
    bad[pos] ^= xor
    try:
        back, _ = decode_samples(bytes(bad))
    except WireFormatError:
        return
    assert back == _example()  # only a flip that changes nothing (e.g. header whitespace) may pass


def test_wrong_schema_and_version():
    weights = encode_weight_bucket([("w", torch.zeros(2))], version=1, index=0, count=1)
    with pytest.raises(SchemaMismatch, match="toolrl.samples"):
        decode_samples(weights)
    from safetensors.torch import save
    old = save({"x": torch.zeros(1)}, metadata={"schema": "toolrl.samples", "version": "0", "meta": "{}",
                                                "xxh3_64": "0"})
    with pytest.raises(SchemaMismatch, match="version"):
        decode_samples(old)
    plain = save({"x": torch.zeros(1)})
    with pytest.raises(CorruptPayload, match="no toolrl metadata"):
        decode_samples(plain)


def test_oversized_rejected_before_parsing():
    with pytest.raises(PayloadTooLarge):
        decode_samples(VALID, max_bytes=len(VALID) - 1)


def _tensors_of(group):
    from safetensors.torch import load
    return load(encode_samples(group))


@pytest.mark.parametrize("mutate, needle", [
    (lambda t: t.__setitem__("loss_mask", torch.full_like(t["loss_mask"], 2)), "loss_mask"),
    (lambda t: t.__setitem__("prompt_offsets", torch.tensor([0, 5, 4])), "offsets"),
    (lambda t: t.__setitem__("completion_ids", t["completion_ids"].to(torch.int64)), "dtype"),
    (lambda t: t.pop("logprobs"), "missing tensor"),
    (lambda t: t.__setitem__("logprobs", torch.full_like(t["logprobs"], float("nan"))), "logprobs"),
    (lambda t: t.__setitem__("loss_mask", t["loss_mask"][:-1]), "loss_mask"),
])
def test_well_formed_but_inconsistent_payloads_rejected(mutate, needle):
    import json
    from safetensors.torch import load
    data = encode_samples(_example())
    header_len = struct.unpack("<Q", data[:8])[0]
    meta = json.loads(json.loads(data[8:8 + header_len])["__metadata__"]["meta"])
    tensors = load(data)
    mutate(tensors)
    forged = pack("toolrl.samples", meta, tensors)  # valid framing and checksum, bad contents
    with pytest.raises(CorruptPayload, match=needle):
        decode_samples(forged)


def test_bad_meta_rows_rejected():
    from safetensors.torch import load
    tensors = load(VALID)
    with pytest.raises(CorruptPayload, match="samples"):
        decode_samples(pack("toolrl.samples", {"samples": []}, tensors))
    with pytest.raises(CorruptPayload, match="offsets"):
        decode_samples(pack("toolrl.samples", {"samples": [{"group_id": "a"}]}, tensors))
    rows = [{"group_id": "a", "policy_version": -1}, {"group_id": "b"}]
    with pytest.raises(CorruptPayload, match="policy_version"):
        decode_samples(pack("toolrl.samples", {"samples": rows}, tensors))


def test_every_rollout_has_its_own_id_and_keeps_it_on_the_wire():
    """The id an audit counts deliveries by: fresh and distinct for each sample made, the same after a
    round trip, and only letters, digits and _.:- (at most 64) from a sender."""
    a, b = _example()
    assert a.sample_id != b.sample_id and len(a.sample_id) == 32
    back, _ = decode_samples(encode_samples([a, b]))
    assert [s.sample_id for s in back] == [a.sample_id, b.sample_id]
    from safetensors.torch import load
    tensors = load(VALID)
    for bad in ("", "x" * 65, "a/b", "a b"):
        rows = [{"group_id": "a", "sample_id": bad}, {"group_id": "b"}]
        with pytest.raises(CorruptPayload, match="sample_id"):
            decode_samples(pack("toolrl.samples", {"samples": rows}, tensors))


def test_sample_invariants():
    with pytest.raises(ValueError, match="null for tool output"):
        Sample(prompt_ids=[1], completion_ids=[2], loss_mask=[0], logprobs=[-1.0], group_id="g")
    with pytest.raises(ValueError, match="finite"):
        Sample(prompt_ids=[1], completion_ids=[2], loss_mask=[1], logprobs=[None], group_id="g")
    with pytest.raises(ValueError, match="loss_mask"):
        Sample(prompt_ids=[1], completion_ids=[2, 3], loss_mask=[1], logprobs=[-1.0], group_id="g")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.sampled_from([torch.float32, torch.bfloat16, torch.int64])),
                min_size=1, max_size=6), st.integers(0, 100))
def test_weight_buckets_round_trip_in_order(shapes, version):
    named = [(f"layer.{i}.w", torch.randn(n).to(dt) if dt != torch.int64 else torch.arange(n))
             for i, (n, dt) in enumerate(shapes)]
    buckets = bucketize(named, bucket_bytes=128)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    got = []
    for i, b in enumerate(buckets):
        wb = decode_weight_bucket(encode_weight_bucket(b, version, i, len(buckets)))
        assert (wb.version, wb.index, wb.count, wb.last) == (version, i, len(buckets), i == len(buckets) - 1)
        got.extend(wb.tensors)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, a), (_, b) in zip(got, named):
        assert a.dtype == b.dtype and torch.equal(a, b)


WEIGHTS = encode_weight_bucket([("a.weight", torch.randn(4, 4)), ("b.bias", torch.randn(3).bfloat16())], 3, 0, 1)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(WEIGHTS) - 1), st.integers(1, 255))
def test_any_flipped_byte_of_a_weight_bucket_is_rejected_or_harmless(pos, xor):
    """Through both readers (whole, and streamed as a worker reads it). Version 2's checksum left the
    tensor table out: `F32` flipped to `I32` loaded 1e9-sized garbage into the weights (found in review)."""
    from toolrl.weightsync.buckets import WeightBucketReader

    bad = bytearray(WEIGHTS)
    bad[pos] ^= xor
    want = decode_weight_bucket(WEIGHTS)
    try:
        got = decode_weight_bucket(bytes(bad))
    except WireFormatError:
        pass
    else:
        assert [(n, t.dtype, t.shape) for n, t in got.tensors] == [(n, t.dtype, t.shape) for n, t in want.tensors]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got.tensors, want.tensors))
    out = bytearray()
    reader = WeightBucketReader(out.extend)
    try:
        reader.feed(bytes(bad))
        reader.finish()
    except WireFormatError:
        return
    assert bytes(out) == bytes(bad) and decode_weight_bucket(bytes(out)) is not None  # what it wrote is whole


def test_a_flipped_dtype_in_the_tensor_table_is_refused():
    """The reviewer's case, pinned: one byte, F32 -> I32."""
    bad = bytearray(WEIGHTS)
    at = WEIGHTS.index(b'"F32"') + 1
    bad[at] = ord("I")
    with pytest.raises(CorruptPayload, match="checksum"):
        decode_weight_bucket(bytes(bad))


def test_weight_bucket_defects():
    good = encode_weight_bucket([("a", torch.ones(3)), ("b", torch.zeros(2))], version=2, index=1, count=2)
    with pytest.raises(WireFormatError):
        decode_weight_bucket(good[:-3])
    with pytest.raises(CorruptPayload, match="out of range"):
        decode_weight_bucket(pack("toolrl.weights", {"version": 1, "index": 3, "count": 2, "names": ["a"]},
                                  {"a": torch.ones(1)}))
    with pytest.raises(CorruptPayload, match="names"):
        decode_weight_bucket(pack("toolrl.weights", {"version": 1, "index": 0, "count": 1, "names": ["x"]},
                                  {"a": torch.ones(1)}))
    with pytest.raises(SchemaMismatch):
        decode_weight_bucket(VALID)
    with pytest.raises(ValueError, match="duplicate"):
        encode_weight_bucket([("a", torch.ones(1)), ("a", torch.ones(1))], 0, 0, 1)
    assert math.isfinite(decode_weight_bucket(good).tensors[0][1].sum().item())
