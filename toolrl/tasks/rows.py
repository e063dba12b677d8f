"""Reading a data set's rows: a local .jsonl/.jsonl.gz/.json file, or a hub dataset through
`datasets` (an id `org/name` or `org/name:config`; that needs the network)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from toolrl.tasks.base import DataError


def read_jsonl(path: Path) -> list[dict]:
    """The objects of a .jsonl or .jsonl.gz file, one a line; a bad line is a DataError naming it."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object")
            rows.append(row)
    return rows


def read_rows(path: str, split: str = "train") -> list[dict]:
    """Rows from a local .jsonl/.jsonl.gz/.json file, or from a hub dataset via `datasets`."""
    local = Path(path).expanduser()
    if local.is_file():
        if local.suffix == ".json":
            data = json.loads(local.read_text())
            if not isinstance(data, list):
                raise DataError(f"{local}: expected a JSON list of objects")
            return data
        return read_jsonl(local)
    if local.exists() or path.startswith((".", "/", "~")):
        raise DataError(f"{path}: not a readable data file")
    repo, _, config = path.partition(":")
    try:
        import datasets  # lazy: slow to import, and only hub ids need it

        ds = datasets.load_dataset(repo, config or None, split=split)
    except Exception as exc:  # offline, unknown id, bad split: one clear line
        raise DataError(f"could not load hub dataset {path!r} split {split!r}: {type(exc).__name__}: {exc}") from None
    return [dict(r) for r in ds]


def field_of(row: dict, name: str, where: str):
    """`row[name]`, or a DataError that names the row and the fields it has."""
    if name not in row:
        raise DataError(f"{where}: missing field {name!r} (has {', '.join(sorted(row))})")
    return row[name]
