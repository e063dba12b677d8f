"""The tool loop: one sample, from prompt to answer, as segments of token ids.

    prompt | model | tool | model | tool | model ...

Model segments keep vLLM's token ids and logprobs exactly (loss mask 1). Tool segments are the
executor's output, tokenised once (loss mask 0, no logprob). Each resume sends the whole token
list back as the prompt; prefix caching makes that cheap. Nothing the model wrote is ever
decoded and re-tokenised.

A weight update may cut a model segment short (toolrl.weightsync.gate): the tokens so far stay,
tagged with the version that generated them, and the segment goes on as a new request under the
new version; the engine recomputes the context under the new weights. So one sample can hold
several versions, and `version_runs` says which token came from which.
"""
from __future__ import annotations

import contextlib
import hashlib
import secrets
from dataclasses import dataclass, field
from typing import AsyncContextManager, Protocol

from toolrl.config import RolloutConfig
from toolrl.worker.engine import GenOut
from toolrl.format import ends_inside_stop, extract_program, format_tool_result, stop_strings
from toolrl.executor.client import ExecutorRequestError, ExecutorUnavailable
from toolrl.net import AUTH_REFUSED
from toolrl.protocol import StopReason, ToolCall
from toolrl.weightsync.gate import Segment

# A restarted worker draws the same request ids again (its counter starts over, a resumed problem
# stream replays): this process's own mark keeps its sessions apart from its predecessor's, whose
# tombstones ("expired", executor-caused) would otherwise reset a first block and drop its group
SESSION_MARK = secrets.token_hex(4)

TRUNCATION_MARK = "\n...[output truncated]\n"


class Generator(Protocol):
    async def generate(self, ids: list[int], max_tokens: int, request_id: str,
                       seed: int | None = None, temperature: float | None = None) -> GenOut: ...


class Tool(Protocol):
    async def run(self, code: str, session_id: str | None, continues: bool = False) -> ToolCall: ...
    async def end_session(self, session_id: str) -> None: ...


class Versions(Protocol):
    """Where each generation request runs: the weight gate's `segment` (interruptible), or one version."""
    def segment(self, request_id: str) -> AsyncContextManager[Segment]: ...


class FixedVersion:
    """Every request under one version, never interrupted: a whole rollout inside `gate.rollout()`,
    or an engine whose weights never change."""

    def __init__(self, version: int = 0):
        self.version = version

    @contextlib.asynccontextmanager
    async def segment(self, request_id: str):
        yield Segment(request_id, self.version)


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    segments: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, start, end) in completion
    stop_reason: StopReason = ""
    generated: int = 0  # model tokens only
    version_runs: list[tuple[int, int]] = field(default_factory=list)  # (first token, policy version)
    interruptions: int = 0  # model segments cut short by a weight update and resumed

    def add(self, kind: str, ids: list[int], logprobs: list[float] | None, version: int | None = None) -> None:
        """Append a segment; `version`: the policy that generated a model segment (tool output
        takes the current one; an empty segment records nothing, so runs always hold tokens)."""
        start = len(self.completion_ids)
        if version is not None and ids and (not self.version_runs or self.version_runs[-1][1] != version):
            self.version_runs.append((0 if not self.version_runs else start, version))
        self.completion_ids += ids
        if kind == "model":
            self.loss_mask += [1] * len(ids)
            self.logprobs += logprobs
            self.generated += len(ids)
        else:
            self.loss_mask += [0] * len(ids)
            self.logprobs += [None] * len(ids)
        self.segments.append((kind, start, len(self.completion_ids)))

    def texts(self, tokenizer, prefill: str = "") -> tuple[str, str]:
        """(the whole completion, what the model wrote after its last tool output); the prompt's
        prefill (e.g. "<think>\\n") is put back in front, since the model's answer continues it."""
        text = prefill + tokenizer.decode(self.completion_ids, skip_special_tokens=True)
        last_tool_end = max((e for k, _, e in self.segments if k == "tool"), default=0)
        final = tokenizer.decode(self.completion_ids[last_tool_end:], skip_special_tokens=True)
        return text, (prefill + final if last_tool_end == 0 else final)


def tool_output_text(call: ToolCall) -> str:
    return call.output if call.output.strip() else "(no output)\n"


def tool_segment_ids(tokenizer, output: str, max_tokens: int, lead: str = "") -> list[int]:
    """The inserted text, tokenised once; long output is cut at a token budget with a marker. A
    program controls its output, so a special token's text in it (`<|im_end|>`, `<|endoftext|>`) is
    tokenised as plain text: it must not end the turn or open a chat turn the harness never wrote."""
    body_ids = tokenizer.encode(output, add_special_tokens=False, split_special_tokens=True)
    if len(body_ids) > max_tokens:
        output = tokenizer.decode(body_ids[:max_tokens]) + TRUNCATION_MARK
    return tokenizer.encode(lead + format_tool_result(output), add_special_tokens=False, split_special_tokens=True)


def pending_program(prefill: str, stop_marker: str) -> str | None:
    """The program a prefill hands to the tool before the model writes anything: a prompt whose
    assistant turn already ends at the marker is waiting for that program's output."""
    text = prefill.rstrip()
    return extract_program(text, stop_marker) if text.endswith(stop_marker) else None


def resumable(tokenizer, before: list[int], ids: list[int], stops: list[str]) -> int:
    """How many of an interrupted segment's tokens to keep: all but a tail that could be the start
    of a stop string, which the resumed request would otherwise never see whole (`before`: the
    model's tokens since the last tool output). The tail is generated again."""
    keep = len(ids)
    while keep and ends_inside_stop(tokenizer.decode(before + ids[:keep], skip_special_tokens=True), stops):
        keep -= 1
    return keep


def request_seed(*key: object) -> int:
    """A sampling seed from a key (rollout.seeded): the same in every process and every run."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, key)).encode()).digest()[:4], "little") & 0x7FFFFFFF


async def run_rollout(gen: Generator, tool: Tool | None, tokenizer, prompt_ids: list[int], cfg: RolloutConfig,
                      request_id: str, pending_code: str | None = None, versions: Versions | None = None,
                      seed: int | None = None, temperature: float | None = None) -> Rollout:
    """One sample. `versions`: the gate's segments for an interruptible rollout; default one version (0).
    `seed`: each model segment is sampled with a seed derived from it and the segment's place.
    `temperature`: None samples at the engine's (the rollout temperature); 0 decodes greedily."""
    r = Rollout(prompt_ids=list(prompt_ids))
    versions = versions or FixedVersion()
    stops = stop_strings(cfg.stop_marker, cfg.stop_at_program_close)
    run_start = 0  # where the model's current run of text began (after the last tool output)
    session = f"{request_id}#{SESSION_MARK}" if cfg.session_per_rollout else None
    ran = False  # a program ran in the session: end it, even if its output did not fit

    def insert(call: ToolCall, lead: str = "") -> bool:
        """Append a call's output, or end the sample if it does not fit: an output that never
        reaches the model is not part of the sample (no masked span, no tool reward)."""
        ids = tool_segment_ids(tokenizer, tool_output_text(call), cfg.max_tool_output_tokens, lead)
        if len(r.prompt_ids) + len(r.completion_ids) + len(ids) >= cfg.max_total_tokens:
            r.stop_reason = "max_total_tokens"
            return False
        nonlocal run_start
        r.tool_calls.append(call)
        r.add("tool", ids, None)
        run_start = len(r.completion_ids)
        return True

    async def execute(code: str) -> ToolCall:
        """A block in the rollout's session, which it continues once an earlier block ran there."""
        nonlocal ran
        call = await tool.run(code, session, continues=ran and session is not None)
        ran = True
        return call

    def unavailable(call: ToolCall) -> bool:
        """An infrastructure failure ends the sample, unscored: the model did nothing wrong."""
        if call.status != "unavailable":
            return False
        r.tool_calls.append(call)
        r.stop_reason = "tool_unavailable"
        return True

    try:
        if pending_code is not None and tool is not None:
            call = await execute(pending_code)
            if unavailable(call) or not insert(call):
                return r
        while True:
            budget = min(cfg.max_new_tokens - r.generated,
                         cfg.max_total_tokens - len(r.prompt_ids) - len(r.completion_ids))
            if budget <= 0:
                r.stop_reason = "length" if cfg.max_new_tokens - r.generated <= 0 else "max_total_tokens"
                break
            rid = f"{request_id}.{len(r.segments)}" + (f".r{r.interruptions}" if r.interruptions else "")
            segment_seed = None if seed is None else request_seed(seed, len(r.segments), r.interruptions)
            async with versions.segment(rid) as seg:
                out = await gen.generate(r.prompt_ids + r.completion_ids, budget, rid, seed=segment_seed,
                                         temperature=temperature)
            if seg.interrupted and out.finish_reason == "abort":  # a weight update: go on under the new one
                keep = resumable(tokenizer, r.completion_ids[run_start:], out.token_ids, stops)
                if keep:
                    r.add("model", out.token_ids[:keep], out.logprobs[:keep], seg.version)
                r.interruptions += 1
                continue
            r.add("model", out.token_ids, out.logprobs, seg.version)
            if out.stop is None:
                # vLLM's other finish reasons (abort, error) are the engine's doing, not the model's
                r.stop_reason = {"stop": "eos", "length": "length"}.get(out.finish_reason, "abort")
                if r.stop_reason == "length" and r.generated < cfg.max_new_tokens:
                    r.stop_reason = "max_total_tokens"
                break
            if tool is None or len(r.tool_calls) >= cfg.max_tool_calls:
                r.stop_reason = "max_tool_calls"
                break
            text = out.text if r.segments[-1][1] == run_start else tokenizer.decode(
                r.completion_ids[run_start:], skip_special_tokens=True)  # a resumed run: the whole of it
            code = extract_program(text, cfg.stop_marker)
            # Stopped at </program> instead of the marker: the harness writes the marker line itself.
            lead = "" if out.stop == cfg.stop_marker else f"\n{cfg.stop_marker}"
            if code is None:
                call = ToolCall(code="", status="error",
                                output="Error: no ```python block was found before this line.\n")
            else:
                call = await execute(code)
            if unavailable(call) or not insert(call, lead):
                break
    finally:
        if tool is not None and session is not None and ran:
            await tool.end_session(session)
    return r


class ExecutorTool:
    """The executor service as the rollout's tool. What the executor could not run (down,
    unreachable or busy through the client's bounded retries, or refusing the request) is status
    `unavailable`: the rollout ends there and its group is left out of training, since the model
    did nothing wrong (a refused token, 401/403, would refuse every program: it raises instead). So
    is a run the executor itself spoiled (`executor_fault`: the session's earlier state evicted,
    expired or lost to a restart, a runner that could not start). Timeouts,
    errors and limits of the program itself are the model's, and so is a session its own code lost."""

    def __init__(self, client, timeout_s: float | None = None):
        self.client = client
        self.timeout_s = timeout_s
        self.calls = 0
        self.errors = 0

    async def run(self, code: str, session_id: str | None, continues: bool = False) -> ToolCall:
        """`continues`: an earlier block of this rollout ran in the session, so an executor that
        lost it (restarted meanwhile) says so as its fault, never runs the block as a fresh start."""
        self.calls += 1
        try:
            res = await self.client.execute(code, timeout_s=self.timeout_s, session_id=session_id,
                                            session_continues=continues)
        except ExecutorUnavailable as exc:
            self.errors += 1
            return ToolCall(code=code, status="unavailable",
                            output=f"Error: the Python executor is unavailable ({exc})\n")
        except ExecutorRequestError as exc:
            if exc.status_code in AUTH_REFUSED:
                raise  # a wrong token refuses every program: stop, and say why (not one left-out group after another)
            self.errors += 1
            return ToolCall(code=code, status="unavailable",
                            output=f"Error: the executor refused the request ({exc})\n")
        except Exception as exc:  # a refused request is this sample's tool error, never the worker's crash
            self.errors += 1
            return ToolCall(code=code, status="unavailable",
                            output=f"Error: the executor refused the request ({exc})\n")
        if res.executor_fault:
            self.errors += 1
            return ToolCall(code=code, status="unavailable", output="Error: the executor lost this run or its "
                            f"session's state ({res.session_note or res.stderr.strip()})\n")
        output = res.stdout
        if res.status != "ok":
            self.errors += 1
            output += res.stderr if res.stderr else f"Error: execution ended with status {res.status}\n"
        if res.session_reset:
            output = f"[note: the interpreter was restarted; earlier variables are gone: {res.session_note}]\n" + output
        return ToolCall(code=code, status=res.status, output=output)

    async def end_session(self, session_id: str) -> None:
        try:
            await self.client.delete_session(session_id)
        except Exception:  # sessions also expire on their own; never fail a rollout over cleanup
            pass
