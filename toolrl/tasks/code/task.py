"""The code family (`data.source: code`, held out `code:TASKS`): the seeded split of the loaded
tasks, or the split a prepared directory holds (`prepared:DIR`, toolrl.tasks.code.prepare), and its
teacher, which writes a collected trace (toolrl.tasks.code.traces) or the data's reference solution."""
from __future__ import annotations

import json
import random
from functools import partial
from pathlib import Path

from toolrl.config import DataConfig, TeacherConfig
from toolrl.tasks.base import DataError, Problem, Task, Teacher, TeacherTrace
from toolrl.tasks.code.prepared import code_side, parse_prepared

_CODE_THINKING = [
    "I will write the function directly and make sure it handles the edge cases.",
    "Let me work out the approach, then write the complete solution.",
    "The task is clear; here is a straightforward implementation.",
]


def load_code_traces(path: str | None) -> dict[str, list[dict]]:
    """Collected traces by problem id (jsonl rows with id, thinking, code; see toolrl.tasks.code.traces)."""
    if not path:
        return {}
    traces: dict[str, list[dict]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"teacher.traces_path: cannot read {path}: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"teacher.traces_path {path}:{n}: not a trace row: {exc}") from None
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("id", "code")) \
                    or not isinstance(row.get("thinking") or "", str):
                raise ValueError(f"teacher.traces_path {path}:{n}: not a trace row (needs id and code, and "
                                 "optional thinking, as strings)")
            traces.setdefault(row["id"], []).append(row)
    return traces


def code_trace(problem: Problem, rng: random.Random, traces: dict[str, list[dict]]) -> TeacherTrace | None:
    """The ideal answer in the layout prompts/code.txt asks for: thinking, then one python block.
    None when there is neither a collected trace nor a reference solution."""
    if problem.id in traces:
        row = rng.choice(traces[problem.id])
        thinking, code = row.get("thinking") or rng.choice(_CODE_THINKING), row["code"]
    elif problem.program:  # a compact solution where the task has one (pycode: no repeated docstring)
        thinking, code = rng.choice(_CODE_THINKING), problem.meta.get("solution") or problem.program
    else:
        return None
    return TeacherTrace(f"<think>\n{thinking.strip()}\n</think>\n```python\n{code.strip()}\n```")


class CodeTask(Task):
    """TASKS: `humaneval`, `mbpp[:PATH][@SPLIT]`, `apps[:PATH][@SPLIT][@DIFFICULTY]`, joined with `+`.
    Training takes one side of a per-source split seeded by data.seed, evaluation the other (with
    MBPP's challenge tests added to each held-out problem's tests). Or `prepared:DIR`: the two sides
    as written, whatever the seed (`code:prepared:DIR@train` evaluates on the train side)."""

    name = "code"
    grading = "tests"

    def problems(self, data: DataConfig, n: int | None = None, seed: int | None = None) -> list[Problem]:
        train = code_side(data.path or "humaneval", "train", data.seed, data.train_fraction)
        return train[:n] if n else train

    def heldout(self, arg: str, n: int, seed: int, data: DataConfig) -> list[Problem]:
        prepared = parse_prepared(arg)
        if prepared is None and seed != data.seed:
            raise DataError(f"seed {seed} for code:{arg or 'humaneval'}: a code task's held-out side is that of "
                            f"the split data.seed ({data.seed}) makes, the one training took the other side of; "
                            f"another seed holds out problems it trained on. For another split set data.seed "
                            f"(--set data.seed={seed}) and leave the evaluation seed unset")
        named = (prepared or (None, None))[1]  # prepared:DIR@train asks for the train side
        return code_side(arg or "humaneval", named or "test", seed, data.train_fraction)[:n]

    def eval_seed(self, data: DataConfig) -> int:
        return data.seed  # the held-out side of the split the training run made

    def teacher(self, cfg: TeacherConfig) -> Teacher:
        return partial(code_trace, traces=load_code_traces(cfg.traces_path))
