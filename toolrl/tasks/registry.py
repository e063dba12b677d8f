"""The task registry: every family by name, and the entry points the rest of the system uses.

`data.source` names the family a run trains on; an eval task string is `NAME[:ARG]` (evaluate.py's
--task, the `eval` config section, `POST /evaluate`). Built-in families are registered in
toolrl/tasks/__init__.py.
"""
from __future__ import annotations

import zlib
from typing import Iterator

from toolrl.config import DataConfig
from toolrl.tasks.base import DataError, Problem, Task

TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    if not task.name or ":" in task.name:
        raise ValueError(f"a task family needs a name without ':', got {task.name!r}")
    if task.name in TASKS:
        raise ValueError(f"task family {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


def task_names() -> list[str]:
    return sorted(TASKS)


def get_task(name: str) -> Task:
    """The family registered under `name`; a DataError listing the registered ones if there is none."""
    try:
        return TASKS[name]
    except KeyError:
        raise DataError(f"unknown task family {name!r}; registered: {', '.join(task_names())}") from None


def load_problems(data: DataConfig, n: int | None = None, seed: int | None = None) -> list[Problem]:
    """Training problems of data.source (for generated ones, `n` from `seed`, default data.seed)."""
    return get_task(data.source).problems(data, n, seed)


def problem_stream(data: DataConfig, worker_id: str, level: int | None = None) -> Iterator[Problem]:
    """An endless, seeded problem stream of data.source, different for each worker."""
    return get_task(data.source).stream(data, zlib.crc32(worker_id.encode()) % 100_000, level)


def load_task(task: str, n: int, seed: int, data: DataConfig) -> list[Problem]:
    """`n` held-out problems for an eval task string, e.g. `arithmetic[:LEVEL or LO-HI][@KINDS]`, `gsm8k:PATH`,
    `math:PATH`, `jsonl:PATH`, `code:TASKS`, `pycode[:LEVEL or LO-HI]` (`data`: the training run's data section)."""
    name, _, arg = task.partition(":")
    return get_task(name).heldout(arg, n, seed, data)


def task_seed(data: DataConfig, task: str, seed: int | None = None) -> int:
    """The held-out problems' seed: `seed` when given, else the family's rule (generated tasks:
    data.eval_seed; code: data.seed, whose split the training run made)."""
    return seed if seed is not None else get_task(task.partition(":")[0]).eval_seed(data)
