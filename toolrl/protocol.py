"""The sample record and the wire format, defined once for every service.

The weight-update buckets are framed the same way; their schema lives with weight sync
(toolrl.weightsync.buckets).

A payload is one safetensors blob. Tensors travel as tensors; everything else travels as JSON
in the safetensors metadata, beside the schema name, the schema version and a checksum (xxh3-64) over the
JSON and every tensor's bytes. Decoding never unpickles anything, checks the size before it
parses, and turns every defect (garbage, truncation, a flipped byte, a wrong schema or version,
inconsistent lengths) into a `WireFormatError` subclass that says what is wrong.
"""
from __future__ import annotations

import json
import math
import struct
import uuid
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors.torch import load as st_load

WIRE_VERSION = 3  # 2: an xxh3-64 checksum over the data region as laid out, checkable while streaming;
# 3: the checksum covers the tensor table too (a flipped dtype byte in it loaded as garbage)
SCHEMA_SAMPLES = "toolrl.samples"
SCHEMA_REF_LOGPROBS = "toolrl.ref_logprobs"
CONTENT_TYPE = "application/vnd.toolrl.safetensors"

MAX_SAMPLES_BYTES = 64 << 20
MAX_HEADER_BYTES = 16 << 20
# Resident bytes of one token of a decoded Sample, held in Python lists: a prompt id ~40 B (int object
# and pointer); a completion token ~120 B (its id, mask entry, logprob and reference logprob). Through
# held_bytes: the queue counts held samples (refserver.queue.sample_nbytes), decode_samples refuses a
# payload that could never be held before building its lists (~12x the wire size), and the reference
# server budgets the uploads decoding at once (samples_held_bytes, from their headers).
PROMPT_TOKEN_BYTES = 40
COMPLETION_TOKEN_BYTES = 120


class WireFormatError(ValueError):
    """A payload that cannot be decoded. Subclasses say why."""


class SampleTooLong(WireFormatError):
    """A sample with more tokens than the receiver takes (decode_samples' max_tokens)."""

    def __init__(self, index: int, tokens: int, limit: int):
        super().__init__(f"sample {index}: {tokens} tokens, over the model's {limit} positions")
        self.index, self.tokens, self.limit = index, tokens, limit


class PayloadTooLarge(WireFormatError):
    pass


class SchemaMismatch(WireFormatError):
    """A well-formed payload of another schema or another version."""


class CorruptPayload(WireFormatError):
    """Garbage, truncation, a checksum mismatch or contents that break the schema's invariants."""


# ---------------------------------------------------------------------------------------------
# The sample record

# Why a rollout ended. eos: the model finished its turn; length: max_new_tokens; max_total_tokens: the
# context (prompt + completion + tool output) is full; max_tool_calls: the tool budget is spent;
# abort: the engine stopped it (a drain timeout, an engine error); tool_unavailable: the executor could
# not run a program (down, unreachable, refusing): neither is the model's doing, and neither is trained.
StopReason = Literal["eos", "length", "max_total_tokens", "max_tool_calls", "abort", "tool_unavailable", ""]
INFRA_FAILED: tuple[StopReason, ...] = ("abort", "tool_unavailable")
TRUNCATED: tuple[StopReason, ...] = ("length", "max_total_tokens")  # the model was cut off


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    status: str  # the executor's status: ok | error | timeout | oom | output_limit | killed | unavailable
    output: str


class Sample(BaseModel):
    """One scored rollout: the unit every service passes around.

    `loss_mask` is 1 where the policy generated the token and 0 for inserted tool output;
    `logprobs` holds the sampler's logprob of each generated token and None under mask 0.

    `version_runs` records which policy version generated each completion token, as runs
    [(first token index, version), ...]: a rollout interrupted by a weight update continues under
    the new policy (toolrl.weightsync.gate), so one sample can hold tokens of several versions.
    Empty means every token is `policy_version`'s. Versions only move forward along a sample, and
    `policy_version` is always the oldest token's (the first run's): the staleness rule and every
    per-sample figure use that, the learner's per-token staleness uses the runs.
    """

    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    rewards: dict[str, float] = Field(default_factory=dict)
    reward: float = 0.0  # the weighted total the advantage was computed from
    advantage: float = 0.0
    group_id: str
    # Unique per rollout, kept end to end (upload, queue, batch, the learner's dump): how a soak or
    # an audit checks that every sample was trained at most once.
    sample_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=64,
                           pattern=r"^[A-Za-z0-9_.:-]+$")
    policy_version: int = Field(0, ge=0)
    version_runs: list[tuple[int, int]] = Field(default_factory=list)
    source: Literal["policy", "teacher"] = "policy"
    ref_logprobs: list[float] | None = None
    stop_reason: StopReason = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    text: str = ""

    @model_validator(mode="after")
    def _check(self) -> "Sample":
        n = len(self.completion_ids)
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty")
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"completion has {n} tokens but loss_mask has {len(self.loss_mask)} "
                             f"and logprobs {len(self.logprobs)}")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"ref_logprobs has {len(self.ref_logprobs)} entries for {n} tokens")
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.logprobs)):
            if m not in (0, 1):
                raise ValueError(f"loss_mask[{i}]={m} is not 0 or 1")
            if m == 1 and (lp is None or not math.isfinite(lp)):
                raise ValueError(f"logprobs[{i}]={lp} must be finite where the model generated the token")
            if m == 0 and lp is not None:
                raise ValueError(f"logprobs[{i}] must be null for tool output (loss_mask 0)")
        self._check_runs(n)
        for k, v in self.rewards.items():
            if not math.isfinite(v):
                raise ValueError(f"reward {k!r} is not finite")
        if not (math.isfinite(self.advantage) and math.isfinite(self.reward)):
            raise ValueError("reward and advantage must be finite")
        return self

    def _check_runs(self, n: int) -> None:
        runs = self.version_runs
        if not runs:
            return
        if runs[0] != (0, self.policy_version):
            raise ValueError(f"version_runs must start at token 0 with policy_version {self.policy_version} "
                             f"(the oldest token's), got {list(runs[0])}")
        for (a, va), (b, vb) in zip(runs, runs[1:]):
            if not (a < b < n and va < vb):
                raise ValueError(f"version_runs must move forward inside the completion's {n} tokens: "
                                 f"{[a, va]} then {[b, vb]}")

    def token_versions(self) -> list[int]:
        """The policy version that generated each completion token."""
        runs = self.version_runs or [(0, self.policy_version)]
        n, out = len(self.completion_ids), []
        for (start, v), (end, _) in zip(runs, [*runs[1:], (n, 0)]):
            out += [v] * (end - start)
        return out

    @property
    def newest_version(self) -> int:
        return self.version_runs[-1][1] if self.version_runs else self.policy_version

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def sample_record(s: Sample, **extra: Any) -> dict:
    """A sample as one JSONL line (gen_worker --rollout-only, the learner's sample dump)."""
    return {"prompt_ids": s.prompt_ids, "completion_ids": s.completion_ids, "loss_mask": s.loss_mask,
            "logprobs": s.logprobs, "rewards": s.rewards, "reward": s.reward, "advantage": s.advantage,
            "group_id": s.group_id, "sample_id": s.sample_id, "text": s.text,
            "tool_calls": [t.model_dump() for t in s.tool_calls], "policy_version": s.policy_version,
            "version_runs": s.version_runs, "stop_reason": s.stop_reason, "source": s.source, **extra}


_TOKEN_FIELDS = ("prompt_ids", "completion_ids", "loss_mask", "logprobs", "ref_logprobs")


# ---------------------------------------------------------------------------------------------
# Generic framing

# torch dtype -> safetensors dtype name (the ones a policy or a sample payload can hold)
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def _byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (it must be contiguous and on the CPU)."""
    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def hasher(meta_json: str, table: dict):
    """The checksum so far of a payload with meta `meta_json` and tensor table `table` (name ->
    dtype, shape, offsets): both, then the data region is fed to it. The table is hashed in one
    canonical form, so the reader needs only what it parsed."""
    import xxhash  # lazy: clients that never frame a payload need not load it

    h = xxhash.xxh3_64()
    h.update(meta_json.encode())
    h.update(json.dumps(table, separators=(",", ":"), sort_keys=True).encode())
    return h


def frame(schema: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[memoryview]]:
    """A payload as (header, data buffers): a safetensors file whose body is the tensors' own
    memory, so a large payload (a weight bucket) can be streamed without being copied into one blob.

    Layout: tensors by element size, largest first, then by name, which keeps every offset aligned;
    `safetensors.torch.load` reads it like any safetensors file (tested). The checksum (xxh3-64,
    about 7x faster than CRC32 here) covers the meta JSON, the tensor table and then the whole data
    region, so a reader can check it as the bytes stream past."""
    meta_json = json.dumps(meta, separators=(",", ":"), allow_nan=False)
    entries, views, offset = {}, [], 0
    for name in sorted(tensors, key=lambda n: (-tensors[n].element_size(), n)):
        t = tensors[name].detach()
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which the wire format does not carry")
        t = t.cpu().contiguous()
        view = _byte_view(t)
        entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        if view.nbytes:
            views.append(view)
    h = hasher(meta_json, entries)
    for v in views:
        h.update(v)
    header = {"__metadata__": {"schema": schema, "version": str(WIRE_VERSION), "meta": meta_json,
                               "xxh3_64": h.hexdigest()}, **entries}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text, views


def pack(schema: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    header, views = frame(schema, meta, tensors)
    return b"".join([header, *views])


def read_header(head: bytes | memoryview, size: int | None, schema: str) -> tuple[int, dict, dict]:
    """Parse a payload's header from its first bytes -> (header length, header, metadata).
    `size` is the whole payload's size where known (to catch truncation early)."""
    (header_len,) = struct.unpack("<Q", bytes(head[:8]))
    limit = MAX_HEADER_BYTES if size is None else min(size - 8, MAX_HEADER_BYTES)
    if header_len > limit:
        raise CorruptPayload(f"header claims {header_len} bytes but the payload has {size - 8 if size else '?'} "
                             f"(truncated?)")
    if len(head) < 8 + header_len:
        raise CorruptPayload(f"payload ends inside its {header_len}-byte header (truncated?)")
    try:
        header = json.loads(bytes(head[8:8 + header_len]))
        meta_header = header.get("__metadata__") if isinstance(header, dict) else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptPayload(f"header is not valid JSON: {exc}") from None
    except RecursionError:  # json's parser recurses per nesting level: refuse, never crash
        raise CorruptPayload("header JSON is nested too deep") from None
    if not isinstance(meta_header, dict):
        raise CorruptPayload("payload carries no toolrl metadata")
    got_schema, got_version = meta_header.get("schema"), meta_header.get("version")
    if got_schema != schema:
        raise SchemaMismatch(f"expected schema {schema!r}, got {got_schema!r}")
    if got_version != str(WIRE_VERSION):
        raise SchemaMismatch(f"{schema} version {got_version!r} is not supported (this side speaks {WIRE_VERSION})")
    if not isinstance(meta_header.get("meta"), str):
        raise CorruptPayload("metadata has no 'meta' field")
    return header_len, header, meta_header


def parse_meta(meta_json: str) -> dict[str, Any]:
    try:
        meta = json.loads(meta_json)
    except json.JSONDecodeError as exc:
        raise CorruptPayload(f"meta is not valid JSON: {exc}") from None
    except RecursionError:
        raise CorruptPayload("meta JSON is nested too deep") from None
    if not isinstance(meta, dict):
        raise CorruptPayload("meta must be a JSON object")
    return meta


def unpack(data: bytes, schema: str, max_bytes: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Decode and verify a payload of `schema`. Raises a WireFormatError subclass on any defect."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptPayload(f"payload must be bytes, got {type(data).__name__}")
    size = len(data)
    if size > max_bytes:
        raise PayloadTooLarge(f"payload of {size} bytes is over the limit of {max_bytes}")
    if size < 8:
        raise CorruptPayload(f"payload of {size} bytes is too short to be safetensors")
    header_len, header, meta_header = read_header(data, size, schema)
    try:
        tensors = st_load(bytes(data))
    except Exception as exc:  # safetensors raises its own error types for every parse failure
        raise CorruptPayload(f"malformed safetensors body: {exc}") from None
    meta_json = meta_header["meta"]
    h = hasher(meta_json, {k: v for k, v in header.items() if k != "__metadata__"})
    h.update(memoryview(data)[8 + header_len:])
    if meta_header.get("xxh3_64") != h.hexdigest():
        raise CorruptPayload("checksum mismatch: the payload was altered or truncated in transit")
    return parse_meta(meta_json), tensors


def incarnation(worker: dict) -> tuple:
    """One life of a registered worker (an entry of the reference server's GET /workers): its id and
    URL, and when it registered. A worker restarted under the same id and URL (launch.sh's worker-$i)
    comes back empty: what was pushed to its last life says nothing of it (found in review: it was
    never caught up, and produced from its base weights until the next sync)."""
    return worker["id"], worker["url"], worker.get("registered_at")


# ---------------------------------------------------------------------------------------------
# Sample groups

def _flat(rows: list[list], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    flat = [x for r in rows for x in r]
    return torch.tensor(flat, dtype=dtype), offsets


def encode_samples(samples: list[Sample], **extra: Any) -> bytes:
    """A group (or batch) of samples -> one payload. `extra` goes into the JSON meta."""
    if not samples:
        raise ValueError("cannot encode an empty list of samples")
    prompt, p_off = _flat([s.prompt_ids for s in samples], torch.int32)
    comp, c_off = _flat([s.completion_ids for s in samples], torch.int32)
    mask, _ = _flat([s.loss_mask for s in samples], torch.uint8)
    logp, _ = _flat([[math.nan if x is None else x for x in s.logprobs] for s in samples], torch.float32)
    tensors = {"prompt_ids": prompt, "prompt_offsets": p_off, "completion_ids": comp,
               "completion_offsets": c_off, "loss_mask": mask, "logprobs": logp}
    has_ref = [s.ref_logprobs is not None for s in samples]
    if any(has_ref):
        if not all(has_ref):
            raise ValueError("either every sample or none carries ref_logprobs")
        tensors["ref_logprobs"], _ = _flat([s.ref_logprobs for s in samples], torch.float32)
    rows = [s.model_dump(exclude=set(_TOKEN_FIELDS)) for s in samples]
    return pack(SCHEMA_SAMPLES, {"samples": rows, **extra}, tensors)


_SAMPLE_TENSORS = {"prompt_ids": torch.int32, "prompt_offsets": torch.int64, "completion_ids": torch.int32,
                   "completion_offsets": torch.int64, "loss_mask": torch.uint8, "logprobs": torch.float32}


def _lengths(flat: torch.Tensor, offsets: torch.Tensor, name: str) -> torch.Tensor:
    """Each sample's entry count, from offsets checked to partition `flat` (tensor ops only)."""
    if offsets.ndim != 1 or flat.ndim != 1:
        raise CorruptPayload(f"{name} must be one-dimensional")
    if offsets.numel() == 0 or offsets[0] != 0 or offsets[-1] != flat.numel() or bool((offsets.diff() < 0).any()):
        raise CorruptPayload(f"{name} offsets do not partition its {flat.numel()} entries")
    return offsets.diff()


def _split(flat: torch.Tensor, offsets: torch.Tensor, name: str) -> list[list]:
    _lengths(flat, offsets, name)
    off, values = offsets.tolist(), flat.tolist()
    return [values[a:b] for a, b in zip(off, off[1:])]


def held_bytes(prompt_tokens: int, completion_tokens: int) -> int:
    """The resident bytes a group's tokens take once decoded into Samples."""
    return PROMPT_TOKEN_BYTES * prompt_tokens + COMPLETION_TOKEN_BYTES * completion_tokens


def samples_held_bytes(data: bytes) -> int:
    """`held_bytes` of a samples payload, from its header alone (no tensor is read); 0 when the header
    cannot be read (decode_samples then says what is wrong)."""
    try:
        _, header, _ = read_header(data, len(data), SCHEMA_SAMPLES)
        shapes = [header[k]["shape"] for k in ("prompt_ids", "completion_ids")]
    except Exception:  # noqa: BLE001 - any defect: decode_samples names it
        return 0
    # a forged header may say anything: negative or absurd dimensions estimate nothing
    if not all(isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape)
               for shape in shapes):
        return 0
    return held_bytes(*(math.prod(shape) for shape in shapes))


def decode_samples(data: bytes, max_bytes: int = MAX_SAMPLES_BYTES, max_tokens: int | None = None,
                   max_samples: int | None = None, max_held_bytes: int | None = None
                   ) -> tuple[list[Sample], dict[str, Any]]:
    """Payload -> (samples, extra meta). Raises a WireFormatError subclass on any defect. With
    `max_tokens` (a sample's prompt + completion), `max_samples` and `max_held_bytes` (the tokens'
    resident size once decoded), a payload over any is refused from its tensors, before its tokens
    become Python lists (about 12x their wire size)."""
    meta, t = unpack(data, SCHEMA_SAMPLES, max_bytes)
    for name, dtype in _SAMPLE_TENSORS.items():
        if name not in t:
            raise CorruptPayload(f"missing tensor {name!r}")
        if t[name].dtype != dtype:
            raise CorruptPayload(f"tensor {name!r} has dtype {t[name].dtype}, expected {dtype}")
    rows = meta.pop("samples", None)
    if not isinstance(rows, list) or not rows:
        raise CorruptPayload("meta.samples must be a non-empty list")
    n = len(rows)
    if t["prompt_offsets"].numel() != n + 1 or t["completion_offsets"].numel() != n + 1:
        raise CorruptPayload(f"offsets do not match the {n} samples in meta")
    if max_samples is not None and n > max_samples:
        raise PayloadTooLarge(f"a group of {n} samples can never fit the limit of {max_samples}")
    held = held_bytes(t["prompt_ids"].numel(), t["completion_ids"].numel())
    if max_held_bytes is not None and held > max_held_bytes:
        raise PayloadTooLarge(f"a group of {n} samples with {t['prompt_ids'].numel()} prompt and "
                              f"{t['completion_ids'].numel()} completion tokens would hold ~{held} bytes once "
                              f"decoded, over the limit of {max_held_bytes}; upload smaller groups")
    if max_tokens is not None:
        lengths = (_lengths(t["prompt_ids"], t["prompt_offsets"], "prompt_ids")
                   + _lengths(t["completion_ids"], t["completion_offsets"], "completion_ids"))
        if bool((lengths > max_tokens).any()):
            i = int((lengths > max_tokens).nonzero()[0])
            raise SampleTooLong(i, int(lengths[i]), max_tokens)
    prompts = _split(t["prompt_ids"], t["prompt_offsets"], "prompt_ids")
    comps = _split(t["completion_ids"], t["completion_offsets"], "completion_ids")
    c_off = t["completion_offsets"]
    per_token = {}
    for name in ("loss_mask", "logprobs", "ref_logprobs"):
        if name in t:
            if t[name].numel() != t["completion_ids"].numel():
                raise CorruptPayload(f"{name} has {t[name].numel()} entries for {t['completion_ids'].numel()} tokens")
            per_token[name] = _split(t[name], c_off, name)
    if "ref_logprobs" in t and t["ref_logprobs"].dtype != torch.float32:
        raise CorruptPayload("tensor 'ref_logprobs' must be float32")
    samples = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise CorruptPayload(f"meta.samples[{i}] is not an object")
        fields = dict(row, prompt_ids=prompts[i], completion_ids=comps[i], loss_mask=per_token["loss_mask"][i],
                      logprobs=[None if math.isnan(x) else x for x in per_token["logprobs"][i]])
        if "ref_logprobs" in per_token:
            fields["ref_logprobs"] = per_token["ref_logprobs"][i]
        try:
            samples.append(Sample.model_validate(fields))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise CorruptPayload(f"sample {i}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    return samples, meta


# ---------------------------------------------------------------------------------------------
# Reference logprobs of a leased window (a reference replica's answer)

def encode_ref_logprobs(rows: list[list[float] | None], **extra: Any) -> bytes:
    """Each sample's reference logprobs (one per completion token), in the window's order; None for
    a sample the replica could not compute."""
    failed = [i for i, r in enumerate(rows) if r is None]
    flat, offsets = _flat([r or [] for r in rows], torch.float32)
    return pack(SCHEMA_REF_LOGPROBS, {"failed": failed, **extra}, {"logprobs": flat, "offsets": offsets})


def decode_ref_logprobs(data: bytes, max_bytes: int = MAX_SAMPLES_BYTES) -> tuple[list[list[float] | None], dict]:
    """Payload -> (rows, extra meta). Raises a WireFormatError subclass on any defect."""
    meta, t = unpack(data, SCHEMA_REF_LOGPROBS, max_bytes)
    if set(t) != {"logprobs", "offsets"}:
        raise CorruptPayload(f"expected tensors logprobs and offsets, got {sorted(t)}")
    if t["logprobs"].dtype != torch.float32 or t["offsets"].dtype != torch.int64:
        raise CorruptPayload("logprobs must be float32 and offsets int64")
    rows: list[list[float] | None] = list(_split(t["logprobs"], t["offsets"], "logprobs"))
    failed = meta.pop("failed", None)
    if not isinstance(failed, list) or not all(isinstance(i, int) and 0 <= i < len(rows) for i in failed):
        raise CorruptPayload(f"meta.failed must list sample indices below {len(rows)}")
    for i in failed:
        rows[i] = None
    return rows, meta
