"""The task interface: a `Problem`, the `Task` each family implements, and the `TeacherTrace` its
teacher writes."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

from toolrl.config import DataConfig, TeacherConfig

# How a completion is scored: its boxed answer against `Problem.answer` (math-verify), or its program
# against the tests in `Problem.answer` (a TestSpec as JSON, run in the executor).
Grading = Literal["answer", "tests"]


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str  # the ground truth, as text math-verify can parse; for grading "tests", the TestSpec JSON
    program: str | None = None  # the exact Python that computes the answer, where known (the teacher uses it)
    level: int | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    grading: Grading = "answer"


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class TeacherTrace:
    """What a teacher writes for one problem. A plain trace is `text`, learned whole. A tool trace
    ends `text` at the stop marker; the executor runs `program`, whose output (masked from the loss)
    must be `expect`, and `conclusion(output)` is the rest."""

    text: str
    program: str | None = None
    expect: str | None = None
    conclusion: Callable[[str], str] | None = None


Teacher = Callable[[Problem, random.Random], "TeacherTrace | None"]


class Task:
    """A task family, registered under `name` (toolrl.tasks.registry). A family implements
    `problems` and `heldout`; the rest has defaults."""

    name: str = ""
    grading: Grading = "answer"  # what its problems carry as Problem.grading
    curriculum: bool = False  # its level moves up with accuracy (data.level up to data.max_level)

    def problems(self, data: DataConfig, n: int | None = None, seed: int | None = None) -> list[Problem]:
        """Training problems for `data` (the first `n`; `seed` for generated ones, default data.seed)."""
        raise NotImplementedError

    def stream(self, data: DataConfig, offset: int, level: int | None = None) -> Iterator[Problem]:
        """An endless, seeded stream of training problems for one worker (`offset` differs per worker;
        `level` is the curriculum's). By default `problems`, reshuffled on every pass."""
        return reshuffled(self.problems(data), random.Random(data.seed + offset))

    def heldout(self, arg: str, n: int, seed: int, data: DataConfig) -> list[Problem]:
        """`n` held-out problems for the eval task `NAME[:ARG]` (`data`: the training run's)."""
        raise NotImplementedError

    def eval_seed(self, data: DataConfig) -> int:
        """The held-out seed when none is given: generated problems come from data.eval_seed, apart
        from the training stream."""
        return data.eval_seed

    def teacher(self, cfg: TeacherConfig) -> Teacher | None:
        """The family's teacher trace builder, or None when it has no teacher."""
        return None


def reshuffled(problems: list[Problem], rng: random.Random) -> Iterator[Problem]:
    """The problems over and over, in a new order each pass. An empty set is a DataError here, when
    the stream is made: drawing from it would spin forever inside the worker's event loop."""
    problems = list(problems)
    if not problems:
        raise DataError("the training data has no problems to draw from (an empty file or split?)")
    return _passes(problems, rng)


def _passes(problems: list[Problem], rng: random.Random) -> Iterator[Problem]:
    while True:
        order = list(problems)
        rng.shuffle(order)
        yield from order
