"""The weight-update wire format: ordered buckets of named tensors with the policy version.

A bucket is a payload of the system's one wire format (toolrl.protocol: safetensors with a JSON
meta and an xxh3-64 checksum) under the schema `toolrl.weights`, with meta {version, index, count,
names}. The learner frames each bucket from the tensors' own memory; a worker decodes it while it
streams (`WeightBucketReader`), never holding a bucket in memory. See docs/WIRE_FORMAT.md.

A delta bucket (meta `delta`) carries instead what changed since a base version the worker holds:
one tensor `delta` (uint8, the codec's output, toolrl.weightsync.delta) and, in `meta.delta`, the
base it applies to and the header of the full bucket it makes, whose checksum the worker checks
after applying it.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors.torch import load as st_load

from toolrl.protocol import (MAX_HEADER_BYTES, CorruptPayload, PayloadTooLarge, frame, hasher, parse_meta,
                             read_header)
from toolrl.weightsync.delta import CODEC

SCHEMA_WEIGHTS = "toolrl.weights"
MAX_WEIGHTS_BYTES = 4 << 30  # one bucket
MAX_BUCKETS = 1 << 17  # buckets of one update: a bucket holds at least one tensor, and no model has this many


class DeltaInfo(BaseModel):
    """`meta.delta` of a delta bucket: what it applies to, and the full bucket it makes."""
    model_config = ConfigDict(extra="forbid")
    base: int = Field(ge=0)  # the version whose bucket (same index, same tensors) it applies to
    base_xxh3: str = Field(pattern=r"^[0-9a-f]{16}$")  # that bucket's checksum: the worker's must be the same
    codec: Literal["xor-shuffle-zstd"]
    header: str = Field(max_length=MAX_HEADER_BYTES)  # the full bucket's safetensors header (JSON)


class WeightBucket(BaseModel):
    """One bucket's metadata (and, when decoded from bytes, its tensors)."""
    model_config = ConfigDict(arbitrary_types_allowed=True)
    version: int = Field(ge=0)
    index: int = Field(ge=0)
    count: int = Field(ge=1, le=MAX_BUCKETS)
    names: list[str]
    delta: DeltaInfo | None = None
    tensors: list[tuple[str, torch.Tensor]] | None = None

    @model_validator(mode="after")
    def _check(self) -> "WeightBucket":
        if self.index >= self.count:
            raise ValueError(f"bucket index {self.index} out of range for {self.count} buckets")
        if len(set(self.names)) != len(self.names):
            raise ValueError("duplicate tensor names")
        if self.delta is not None and self.delta.base >= self.version:
            raise ValueError(f"a delta to version {self.version} from base {self.delta.base}, which is not older")
        return self

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def frame_weight_bucket(tensors: list[tuple[str, torch.Tensor]], version: int, index: int,
                        count: int) -> tuple[bytes, list[memoryview]]:
    """One bucket as (header, the tensors' own memory): what the learner streams."""
    names = [n for n, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in a weight bucket")
    if not 0 <= index < count:
        raise ValueError(f"bucket index {index} out of range for {count} buckets")
    meta = {"version": version, "index": index, "count": count, "names": names}
    return frame(SCHEMA_WEIGHTS, meta, dict(tensors))


def frame_delta_bucket(full_header: bytes, body: bytearray, names: list[str], version: int, index: int, count: int,
                       base: int, base_xxh3: str) -> tuple[bytes, list[memoryview]]:
    """A delta bucket: `body` (toolrl.weightsync.delta.encode) makes, from bucket `index` of version
    `base` (checksum `base_xxh3`), the full bucket whose header (as framed) is `full_header`."""
    _, full, _ = read_header(full_header, len(full_header), SCHEMA_WEIGHTS)
    text = full_header[8:8 + struct.unpack("<Q", full_header[:8])[0]].rstrip(b" ").decode()
    meta = {"version": version, "index": index, "count": count, "names": names,
            "delta": {"base": base, "base_xxh3": base_xxh3, "codec": CODEC, "header": text}}
    if sorted(names) != sorted(k for k in full if k != "__metadata__"):
        raise ValueError("a delta bucket's names must be its full bucket's tensors")
    return frame(SCHEMA_WEIGHTS, meta, {"delta": torch.frombuffer(body, dtype=torch.uint8)  # no copy
                                        if body else torch.zeros(0, dtype=torch.uint8)})


@dataclass
class Target:
    """The full bucket a delta bucket makes: its header as framed (JSON), tensor table, meta JSON
    (what its checksum starts with), checksum and data region length."""
    header: bytes
    table: dict
    meta_json: str
    xxh3: str
    data_len: int


def _target(b: WeightBucket) -> Target:
    """The full bucket named by delta bucket `b`, checked against `b`: the same version, place and tensors."""
    text = b.delta.header.encode()
    _, header, mh = read_header(struct.pack("<Q", len(text)) + text, None, SCHEMA_WEIGHTS)
    meta = parse_meta(mh["meta"])
    table = {k: v for k, v in header.items() if k != "__metadata__"}
    if [meta.get(k) for k in ("version", "index", "count", "names")] != [b.version, b.index, b.count, b.names] \
            or sorted(table) != sorted(b.names):
        raise CorruptPayload("a delta bucket's full header names another bucket than the delta's own meta")
    try:
        data_len = max((int(v["data_offsets"][1]) for v in table.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError, OverflowError):  # int(1e400): OverflowError
        raise CorruptPayload("tensor table entries need data_offsets") from None
    if not isinstance(mh.get("xxh3_64"), str):
        raise CorruptPayload("a delta bucket's full header has no checksum")
    return Target(text, table, mh["meta"], mh["xxh3_64"], data_len)


def encode_weight_bucket(tensors: list[tuple[str, torch.Tensor]], version: int, index: int, count: int) -> bytes:
    header, views = frame_weight_bucket(tensors, version, index, count)
    return b"".join([header, *views])


class WeightBucketReader:
    """Decodes one weight bucket as its bytes arrive, passing every byte on to `sink` (a file), so a
    worker never holds a bucket in memory. It checks the header (schema, version, names) as soon
    as it is complete, refuses bytes past the declared end or the size limit at once, and checks
    the length and the checksum at `finish`. The sink's result is safetensors; a reader of it (vLLM's
    loader) still validates the tensor table itself."""

    def __init__(self, sink: Callable[[bytes], Any], max_bytes: int = MAX_WEIGHTS_BYTES):
        self.sink, self.max_bytes = sink, max_bytes
        self.head = bytearray()
        self.bucket: WeightBucket | None = None  # set once the header is in
        self.size = 0  # bytes seen
        self.total: int | None = None  # declared by the header
        self.target: Target | None = None  # for a delta bucket: the full bucket it makes
        self._hash = None
        self._held: list[bytes] = []

    def feed(self, chunk: bytes, hold: bool = False) -> None:
        """Take the next bytes. With `hold`, the bytes up to and just past the header are kept
        until `release()`, so the caller can look at `bucket` before anything reaches the sink."""
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise PayloadTooLarge(f"payload is over the limit of {self.max_bytes} bytes")
        if self.total is not None and self.size > self.total:
            raise CorruptPayload(f"payload runs past its declared {self.total} bytes")
        if self.bucket is None:
            self.head += chunk
            if len(self.head) >= 8:
                (hl,) = struct.unpack("<Q", bytes(self.head[:8]))
                if hl > MAX_HEADER_BYTES:
                    raise CorruptPayload(f"header claims {hl} bytes, over the limit of {MAX_HEADER_BYTES}")
                if len(self.head) >= 8 + hl:
                    self._start(hl)
                    if not hold:
                        self.release()
            return
        self._hash.update(chunk)
        self.sink(chunk)

    def release(self) -> None:
        for part in self._held:
            self.sink(part)
        self._held = []

    def _start(self, hl: int) -> None:
        _, header, mh = read_header(self.head, None, SCHEMA_WEIGHTS)
        meta = parse_meta(mh["meta"])
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        try:
            ends = [int(v["data_offsets"][1]) for v in tensors.values()]
        except (TypeError, KeyError, IndexError, ValueError, OverflowError):  # int(1e400): OverflowError
            raise CorruptPayload("tensor table entries need data_offsets") from None
        names = meta.get("names")
        carried = ["delta"] if "delta" in meta else names  # a delta bucket carries one tensor, its body
        if not isinstance(names, list) or sorted(carried) != sorted(tensors):
            raise CorruptPayload("weight bucket names do not match its tensors")
        if "delta" in meta and tensors["delta"].get("dtype") != "U8":
            raise CorruptPayload("a delta bucket's body must be a U8 tensor")
        try:
            self.bucket = WeightBucket(version=meta.get("version"), index=meta.get("index"),
                                       count=meta.get("count"), names=names, delta=meta.get("delta"))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise CorruptPayload(f"weight bucket {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        if self.bucket.delta is not None:
            self.target = _target(self.bucket)
        self.data_at = 8 + hl  # where the data region starts
        self.total = 8 + hl + max(ends, default=0)
        if self.total > self.max_bytes:
            raise PayloadTooLarge(f"payload declares {self.total} bytes, over the limit of {self.max_bytes}")
        if self.size > self.total:
            raise CorruptPayload(f"payload runs past its declared {self.total} bytes")
        self.expected_hash = mh.get("xxh3_64")
        self._hash = hasher(mh["meta"], tensors)
        head, rest = bytes(self.head[:8 + hl]), bytes(self.head[8 + hl:])
        self.head = bytearray()
        self._hash.update(rest)
        self._held = [head, rest] if rest else [head]

    def finish(self) -> WeightBucket:
        if self.bucket is None or self.size != self.total:
            raise CorruptPayload(f"payload ends after {self.size} bytes, before its declared end (truncated?)")
        if self.expected_hash != self._hash.hexdigest():
            raise CorruptPayload("checksum mismatch: the payload was altered or truncated in transit")
        return self.bucket


def decode_weight_bucket(data: bytes, max_bytes: int = MAX_WEIGHTS_BYTES) -> WeightBucket:
    """A whole bucket from bytes, tensors included (the worker streams instead: WeightBucketReader)."""
    if len(data) < 8:
        raise CorruptPayload(f"payload of {len(data)} bytes is too short to be safetensors")
    reader = WeightBucketReader(lambda _: None, max_bytes)
    reader.feed(bytes(data))
    bucket = reader.finish()
    if bucket.delta is not None:
        raise CorruptPayload("a delta bucket has no tensors of its own: a worker applies it to its base")
    try:
        t = st_load(bytes(data))
    except Exception as exc:  # safetensors raises its own error types for every parse failure
        raise CorruptPayload(f"malformed safetensors body: {exc}") from None
    return bucket.model_copy(update={"tensors": [(n, t[n]) for n in bucket.names]})


def bucketize(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Split named tensors, in order, into buckets of about `bucket_bytes` (a large tensor gets its own)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += nbytes
    return [b for b in buckets if b]
