"""The executor's wire models, defined once for the service and its clients.

Requests forbid unknown keys so that a typo (`timeout` for `timeout_s`) is a 422 that names the key
instead of a silently ignored limit.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Status = Literal["ok", "error", "timeout", "oom", "output_limit", "killed"]
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "oom", "output_limit", "killed")

SESSION_ID_PATTERN = r"^[^\x00-\x1f\x7f]{1,256}$"  # any printable id; clients percent-encode it in URLs


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str
    timeout_s: float | None = Field(None, gt=0)  # None: the server's default
    memory_mb: int | None = Field(None, ge=16)
    stdin: str | None = None  # None: stdin is empty, input() raises EOFError
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN)  # state kept between calls
    # The caller ran an earlier block in this session. An executor that holds no record of the id
    # (it was restarted, or dropped the record) then says the state is gone, as its own fault, rather
    # than run the block in a fresh session as if nothing had been lost.
    session_continues: bool = False

    @field_validator("session_id")
    @classmethod
    def _not_a_dot_segment(cls, v: str | None) -> str | None:
        if v in (".", ".."):  # HTTP clients collapse them in DELETE /sessions/{id}: never deletable
            raise ValueError(f"session_id {v!r} is a path segment of its own; pick another id")
        return v


class ExecResult(BaseModel):
    """What one execution did.

    status: ok (exit code 0), error (non-zero exit, uncaught exception, crash), timeout (wall or CPU
    limit), oom (memory limit), output_limit (killed for printing more than the server allows),
    killed (a signal the sandbox did not send for a limit, or the request was cancelled).
    """

    status: Status
    exit_code: int | None  # negative: killed by that signal number
    stdout: str
    stderr: str
    truncated: bool  # stdout or stderr was cut; a marker in the text shows where
    wall_ms: float
    cpu_ms: float
    session_reset: bool = False  # the session's earlier state was NOT available to this execution
    session_note: str | None = None  # why it was reset, or that this execution lost the session
    # The executor, not the code, cost this execution its session's earlier state or its own run
    # (ipc.EXECUTOR_CAUSED): what it printed is not what the code would have done. A caller scoring the
    # code treats it as an infrastructure failure.
    executor_fault: bool = False


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ExecRequest]


class BatchResponse(BaseModel):
    results: list[ExecResult]  # in the order of the request's items


class HealthResponse(BaseModel):
    ok: bool
    workers: int
    queued: int  # admitted and not yet answered
    max_queue: int
    sessions: int
    isolation: dict[str, Any]  # what the fork server set up; `missing` lists what it could not
    uids: dict[str, list[int]]  # [first, last] uid of the slot and session ranges
    forkserver_pid: int | None
    restarts: int
    withdrawn: int = 0  # executions withdrawn because their client disconnected before the answer
    # how the executor's total memory is bounded: {"mode": "cgroup" | "admission" | "none", "total_mb",
    # "held_mb", ...} (docs/EXECUTOR.md, Isolation)
    memory: dict[str, Any] = Field(default_factory=dict)
