"""A prepared code split on disk (written by toolrl.tasks.code.prepare) and how it is read back:
`prepared:DIR` names DIR/train.jsonl and DIR/test.jsonl, one problem a line (`{id, question, tests,
program, meta}`), vouched for by DIR/manifest.json (their SHA-256). Training reads the train side
(`data.path: prepared:DIR`), evaluation the test side (`code:prepared:DIR`, or `@train` for the
other), and neither ever re-splits it; a file changed since it was written is refused.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from toolrl.tasks.base import DataError, Problem
from toolrl.tasks.code.loaders import load_code_task, split

FORMAT = "toolrl-code-prepared/1"
SIDES = ("train", "test")
PREFIX = "prepared:"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# One problem a line


def to_row(problem: Problem, side: str) -> dict:
    """A problem as a line of DIR/SIDE.jsonl. A training row drops its challenge tests: they are
    held-out material and must not travel in a file that may be trained on."""
    meta = dict(problem.meta)
    if side == "train":
        meta.pop("challenge_tests", None)
    return {"id": problem.id, "question": problem.question, "tests": json.loads(problem.answer),
            "program": problem.program, "meta": meta}


def from_row(row: dict, where: str) -> Problem:
    missing = {"id", "question", "tests"} - set(row)
    if missing:
        raise DataError(f"{where}: not a prepared problem (missing {', '.join(sorted(missing))})")
    # json.dumps of the loaded TestSpec gives back TestSpec.to_json's text, byte for byte
    return Problem(id=row["id"], question=row["question"], answer=json.dumps(row["tests"]),
                   program=row.get("program"), meta=row.get("meta") or {}, grading="tests")


# ---------------------------------------------------------------------------------------------
# Reading: `prepared:DIR[@train|@test]`


def parse_prepared(task: str) -> tuple[Path, str | None] | None:
    """`prepared:DIR[@SIDE]` -> (DIR, SIDE or None); None when `task` names no prepared directory."""
    if not task.startswith(PREFIX):
        return None
    rest = task[len(PREFIX):]
    head, _, side = rest.rpartition("@")
    if head and side in SIDES:
        return Path(head).expanduser(), side
    return Path(rest).expanduser(), None


def read_prepared(directory: Path, side: str) -> list[Problem]:
    """One side of a prepared directory, refused when it no longer matches its manifest."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        hint = " (a prepared directory stands alone, not joined by +)" if "+" in str(directory) else ""
        raise DataError(f"prepared:{directory}: not a prepared directory, no manifest.json{hint}; write one with "
                        "python -m toolrl.tasks.code.prepare")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        want, fmt = manifest["files"][f"{side}.jsonl"]["sha256"], manifest["format"]
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{manifest_path}: not a manifest written by toolrl.tasks.code.prepare") from None
    if fmt != FORMAT:
        raise DataError(f"{manifest_path}: format {fmt!r}, this version reads {FORMAT!r}; prepare again")
    path = directory / f"{side}.jsonl"
    data = path.read_bytes() if path.is_file() else b""  # read once: what is checked is what is parsed
    if hashlib.sha256(data).hexdigest() != want:
        raise DataError(f"{path}: changed since it was prepared (its SHA-256 is not the manifest's); prepare again")
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    return [from_row(r, f"{path} row {i}") for i, r in enumerate(rows)]


def code_side(task: str, side: str, seed: int, train_fraction: float) -> list[Problem]:
    """One side ("train" or "test") of a code task string: a prepared directory's file as written, or
    that side of the seeded in-memory split of the loaded sources."""
    if side not in SIDES:
        raise ValueError(f"side {side!r}: train or test")
    found = parse_prepared(task)
    if found is None:
        train, test = split(load_code_task(task), seed, train_fraction)
        return train if side == "train" else test
    directory, named = found
    if named is not None and named != side:
        raise DataError(f"{task!r} names the {named} side; the {side} side is read here")
    return read_prepared(directory, side)
