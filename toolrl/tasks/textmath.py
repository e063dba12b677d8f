"""Math word problems read from data: GSM8K, MATH, and any jsonl with a question and an answer
field (a local file or a hub dataset, see toolrl.tasks.rows). Graded by the boxed answer."""
from __future__ import annotations

from toolrl.config import DataConfig
from toolrl.format import last_boxed
from toolrl.tasks.base import DataError, Problem, Task
from toolrl.tasks.rows import field_of, read_rows


def gsm8k_answer(solution: str) -> str | None:
    """GSM8K keeps the final answer after '####'; commas are thousands separators."""
    if "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def load_gsm8k(path: str, split: str = "train") -> list[Problem]:
    out = []
    for i, row in enumerate(read_rows(path, split)):
        answer = gsm8k_answer(str(field_of(row, "answer", f"{path} row {i}")))
        if answer is None:
            raise DataError(f"{path} row {i}: GSM8K answer has no '####' final answer")
        out.append(Problem(id=str(row.get("id", f"gsm8k-{i}")), question=field_of(row, "question", path),
                           answer=answer))
    return out


def load_math(path: str, split: str = "train") -> list[Problem]:
    out = []
    for i, row in enumerate(read_rows(path, split)):
        where = f"{path} row {i}"
        answer = row.get("answer")
        if answer is None:
            answer = last_boxed(str(field_of(row, "solution", where)))
        if answer is None:
            raise DataError(f"{where}: MATH solution has no \\boxed{{}} answer")
        meta = {k: row[k] for k in ("level", "type", "subject") if k in row}
        out.append(Problem(id=str(row.get("unique_id", row.get("id", f"math-{i}"))),
                           question=field_of(row, "problem", where), answer=str(answer), meta=meta))
    return out


def load_jsonl(path: str, question_field: str = "question", answer_field: str = "answer",
               split: str = "train") -> list[Problem]:
    out = []
    for i, row in enumerate(read_rows(path, split)):
        where = f"{path} row {i}"
        out.append(Problem(id=str(row.get("id", f"row-{i}")), question=str(field_of(row, question_field, where)),
                           answer=str(field_of(row, answer_field, where))))
    return out


class _FileTask(Task):
    """A family read from data: `data.path` for training, `NAME:PATH` held out."""

    def read(self, path: str, data: DataConfig | None) -> list[Problem]:
        """The problems at `path`; with `data` None, the loader's defaults (split, fields)."""
        raise NotImplementedError

    def problems(self, data: DataConfig, n: int | None = None, seed: int | None = None) -> list[Problem]:
        if not data.path:
            raise DataError(f"data.source={self.name} needs data.path (a local file or a hub dataset id)")
        problems = self.read(data.path, data)
        return problems[:n] if n else problems

    def heldout(self, arg: str, n: int, seed: int, data: DataConfig) -> list[Problem]:
        if not arg:
            raise DataError(f"task {self.name!r} needs a file or hub id: {self.name}:PATH")
        return self.read(arg, None)[:n]  # a held-out file is read with the defaults, not data's split and fields


class GSM8KTask(_FileTask):
    name = "gsm8k"

    def read(self, path: str, data: DataConfig | None) -> list[Problem]:
        return load_gsm8k(path, data.split) if data else load_gsm8k(path)


class MathTask(_FileTask):
    name = "math"

    def read(self, path: str, data: DataConfig | None) -> list[Problem]:
        return load_math(path, data.split) if data else load_math(path)


class JsonlTask(_FileTask):
    name = "jsonl"

    def read(self, path: str, data: DataConfig | None) -> list[Problem]:
        if data is None:
            return load_jsonl(path)
        return load_jsonl(path, data.question_field, data.answer_field, data.split)
