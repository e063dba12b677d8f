"""Reading a data set's rows from wherever a user keeps it, the format told by the path:

- a file: .jsonl / .jsonl.gz (one object a line), .json (a list of objects), .parquet, .arrow
  (what `datasets` writes; IPC stream or file); a file with another name is sniffed by its content;
- a `Dataset.save_to_disk` directory (state.json and its .arrow shards), or a `DatasetDict` one
  (dataset_dict.json, one such directory per split);
- any other directory: a hub snapshot (`huggingface-cli download`, `snapshot_download`) or a
  `datasets` cache, searched recursively for .parquet / .arrow / .jsonl / .jsonl.gz files;
- anything else: a hub id (`org/name` or `org/name:config`) loaded through `datasets` (network); a
  hub dataset that ships a loading script (APPS) has its data files downloaded and read as above.

`split` picks a split where the data has several: the subdirectory of a DatasetDict, the files of a
directory whose path names it (`full/test-00000-of-00001.parquet`, `test.jsonl`, `default/test/0.parquet`,
`mbpp-test.arrow`), or the hub split. A directory whose files name no split is read whole; a single
file is read as it is. Parquet and arrow are read with pyarrow (installed with `datasets`).
"""
from __future__ import annotations

import gzip
import json
import logging
import re
from pathlib import Path

from toolrl.tasks.base import DataError

EXPECTED = ("expected a .jsonl, .jsonl.gz, .json, .parquet or .arrow file, a directory holding such files "
            "(a hub snapshot or a datasets cache), a Dataset/DatasetDict.save_to_disk directory, or a hub id")
# Words that name a split in a file's path (as the hub's own data-file patterns use them)
SPLIT_WORDS = {"train", "training", "test", "testing", "validation", "valid", "val", "dev", "eval", "prompt"}
_DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".jsonl.gz")

# How `datasets` refuses a hub dataset that ships a loading script (datasets/load.py, 4.0 and later)
SCRIPT_REFUSED = "Dataset scripts are no longer supported"
log = logging.getLogger(__name__)

Located = tuple[str, dict]  # (where: "FILE row N", the row)


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


def _pyarrow():
    try:
        import pyarrow  # lazy: only parquet and arrow data need it
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading parquet or arrow data needs the `pyarrow` package (pip install pyarrow)") from None
    return pyarrow


def _file_format(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, fmt in ((".parquet", "parquet"), (".arrow", "arrow"), (".jsonl", "jsonl"), (".jsonl.gz", "jsonl"),
                        (".json", "json")):
        if name.endswith(suffix):
            return fmt
    with open(path, "rb") as f:  # another name: tell by the content
        head = f.read(64)
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith((b"ARROW1", b"\xff\xff\xff\xff")):
        return "arrow"
    if head.startswith(b"\x1f\x8b") or head.lstrip().startswith(b"{"):
        return "jsonl"
    return "json" if head.lstrip().startswith(b"[") else None


def _table_rows(path: Path, fmt: str) -> list[dict]:
    pa = _pyarrow()
    try:
        if fmt == "parquet":
            table = pa.parquet.read_table(path)
        else:
            with pa.memory_map(str(path)) as src:
                magic = src.read(6)
                src.seek(0)
                reader = pa.ipc.open_file(src) if magic == b"ARROW1" else pa.ipc.open_stream(src)
                table = reader.read_all()
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable {fmt} file ({type(exc).__name__}: {exc})") from None
    return table.to_pylist()


def read_file(path: Path) -> list[Located]:
    """The rows of one data file, each with where it is."""
    fmt = _file_format(path)
    if fmt is None:
        raise DataError(f"{path}: not a readable data file: {EXPECTED}")
    if fmt == "json":
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("{"):  # JSON lines under a .json name
            rows = read_jsonl(path)
        else:
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise DataError(f"{path}: expected a JSON list of objects")
    else:
        rows = read_jsonl(path) if fmt == "jsonl" else _table_rows(path, fmt)
    return [(f"{path} row {i}", r) for i, r in enumerate(rows)]


def _saved_dataset(folder: Path) -> list[Path]:
    """The .arrow shards of a Dataset.save_to_disk directory, in state.json's order."""
    try:
        state = json.loads((folder / "state.json").read_text())
        names = [f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        names = []
    return [folder / n for n in names] or sorted(folder.glob("*.arrow"))


def _saved_splits(folder: Path, split: str | None) -> list[Path]:
    """The shards of a DatasetDict.save_to_disk directory: one split, or all of them."""
    try:
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        splits = sorted(p.parent.name for p in folder.glob("*/state.json"))
    if split is not None and split not in splits:
        raise DataError(f"{folder}: a saved DatasetDict with no split {split!r} (it has {', '.join(splits)})")
    return [f for s in ([split] if split is not None else splits) for f in _saved_dataset(folder / s)]


def _words(rel: Path) -> set[str]:
    """The words of a path inside the data folder: its directories, and its file name cut at - _ ."""
    name = rel.name.lower()
    for suffix in _DATA_SUFFIXES:
        name = name.removesuffix(suffix)
    return {p.lower() for p in rel.parts[:-1]} | set(re.split(r"[-_.]", name))


def _snapshot(folder: Path, split: str | None) -> list[Path]:
    """The data files of a snapshot or cache directory for one split (all when none is asked for, or
    when no file names a split). One copy of the data only: files from several configurations
    (MBPP's full/ and sanitized/) or in several formats are an error that says where to point."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.lower().endswith(_DATA_SUFFIXES)
                   and not p.name.startswith("cache-")  # what datasets' .map() left in a cache
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not files:
        raise DataError(f"{folder}: no data files in this directory: {EXPECTED}")
    words = {f: _words(f.relative_to(folder)) for f in files}
    if split is not None:
        chosen = [f for f in files if split.lower() in words[f]]
        named = sorted(set().union(*words.values()) & SPLIT_WORDS)
        if not chosen and named:
            raise DataError(f"{folder}: no file for split {split!r} (its files name the splits {', '.join(named)})")
        files = chosen or files
    skip = SPLIT_WORDS | ({split.lower()} if split else set())
    copies = {"/".join(p for p in f.relative_to(folder).parent.parts if p.lower() not in skip) or "." for f in files}
    if len(copies) > 1:
        raise DataError(f"{folder}: the data is here more than once (under {', '.join(sorted(copies))}, e.g. one "
                        "configuration each): point at one of those directories")
    kinds = {_file_format(f) for f in files}
    if len(kinds) > 1:
        raise DataError(f"{folder}: the data is here in more than one format ({', '.join(sorted(kinds))}): "
                        "point at one file")
    return files


def data_files(path: Path, split: str | None) -> list[Path]:
    """The files that hold a local data set's rows (see the module's doc)."""
    if path.is_file():
        return [path]
    if (path / "dataset_dict.json").is_file():
        return _saved_splits(path, split)
    if (path / "state.json").is_file():
        return _saved_dataset(path)
    return _snapshot(path, split)


def looks_local(path: str) -> bool:
    """Whether `path` can only mean a local file or directory: a missing one must not fall through to
    the hub (a slow, misleading network error), and a hub id never starts like a path or ends like a
    data file."""
    return path.startswith((".", "/", "~")) or "\\" in path or path.lower().endswith(_DATA_SUFFIXES + (".json",))


def _cached_script(repo: str) -> bool:
    """Whether the hub cache holds `repo` with its loading script (NAME.py, as datasets looks for it)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        # one file, not the snapshot: a snapshot an online run cached is checked against the repo's whole
        # file list, which holds files never downloaded (found in review)
        found = try_to_load_from_cache(repo, f"{repo.rpartition('/')[2]}.py", repo_type="dataset")
    except Exception:  # no huggingface_hub, or a repo id it refuses
        return False
    return isinstance(found, str)


def _script_dataset_files(repo: str, split: str | None) -> list[Path]:
    """The data files of a hub dataset that also ships a loading script, which `datasets` 4 and later
    no longer runs (codeparrot/apps: apps.py beside train.jsonl and test.jsonl). Only the files whose
    names can hold `split` are downloaded, then read like a local snapshot."""
    from huggingface_hub import snapshot_download  # installed with datasets

    patterns = [f"*{split}*{suffix}" if split else f"*{suffix}" for suffix in _DATA_SUFFIXES]
    log.info("%s ships a loading script, which datasets no longer runs: downloading its %s data files as they are",
             repo, split or "")
    try:
        folder = snapshot_download(repo, repo_type="dataset", allow_patterns=patterns)
    except Exception as exc:  # offline, gated, a file missing from the cache
        raise DataError(f"could not download the data files of hub dataset {repo!r} (it ships a loading script, "
                        f"which datasets no longer runs): {type(exc).__name__}: {exc}") from None
    return _snapshot(Path(folder), split)


def read_located_rows(path: str, split: str | None = "train") -> list[Located]:
    """Every row of a data set, each with where it is ("FILE row N", for error messages), from a
    local file or directory in any of the module's formats, or a hub id."""
    local = Path(path).expanduser()
    if local.exists():
        if not (local.is_file() or local.is_dir()):
            raise DataError(f"{path}: not a readable data file: {EXPECTED}")
        return [row for f in data_files(local, split) for row in read_file(f)]
    if looks_local(path):
        raise DataError(f"{path}: not a readable data file (no such file or directory)")
    repo, _, config = path.partition(":")
    failed = None
    try:
        import datasets  # lazy: slow to import, and only hub ids need it

        ds = datasets.load_dataset(repo, config or None, split=split)
    except ImportError:
        raise DataError(f"{path!r} is not a local path, and a hub id needs the `datasets` package") from None
    except Exception as exc:  # offline, unknown id, bad split: one clear line
        failed = exc
    if failed is not None:
        # Refused for its script, or offline (datasets fails before it looks) with a script in the cache
        if not config and (SCRIPT_REFUSED in str(failed) or _cached_script(repo)):
            return [row for f in _script_dataset_files(repo, split) for row in read_file(f)]
        raise DataError(f"could not load hub dataset {path!r} split {split!r} ({path!r} is not a local file or "
                        f"directory either): {type(failed).__name__}: {failed}") from None
    parts = ds.items() if split is None else [(split, ds)]  # None: a DatasetDict, every split
    return [(f"{path} ({name}) row {i}", dict(r)) for name, d in parts for i, r in enumerate(d)]


def read_rows(path: str, split: str | None = "train") -> list[dict]:
    """The rows of `read_located_rows`, without where they are."""
    return [row for _, row in read_located_rows(path, split)]


def field_of(row: dict, name: str, where: str):
    """`row[name]`, or a DataError that names the row and the fields it has."""
    if name not in row:
        raise DataError(f"{where}: missing field {name!r} (has {', '.join(sorted(row))})")
    return row[name]
