"""Phase 1 of the code pipeline: mix code sources, split them per source (seeded, exactly as training
splits them in memory: toolrl.tasks.code.loaders.split) and write the split once, so that teacher
traces, training and evaluation read the same problems and nothing re-splits them later.

    python -m toolrl.tasks.code.prepare --sources humaneval+mbpp:m.jsonl+apps:a.jsonl@introductory \\
        --seed 0 --train-fraction 0.8 --out data/code        # or: toolrl-code-prepare ...

writes DIR/train.jsonl, DIR/test.jsonl and DIR/manifest.json (the sources, seed, fraction, counts per
source and side, SHA-256 of the local input files and of both outputs); toolrl.tasks.code.prepared
is the format and reads it back as `prepared:DIR`. Bad input (an unknown source, a missing path, a
fraction outside (0, 1), a non-empty --out without --force) is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from toolrl.tasks.base import DataError, Problem
from toolrl.tasks.code.loaders import humaneval_path, load_part, parse_part, split
from toolrl.tasks.code.prepared import FORMAT, SIDES, sha256, to_row
from toolrl.tasks.rows import data_files, looks_local


# ---------------------------------------------------------------------------------------------
# Writing: load every source, split, write


def input_files(part: str) -> dict[str, str]:
    """SHA-256 of the local files a source part reads ({} for a hub id, which the manifest names)."""
    kind, path, data_split, _ = parse_part(part)
    if kind == "humaneval":
        files = [Path(path).expanduser() if path else humaneval_path()]
    elif path and Path(path).expanduser().exists():
        files = data_files(Path(path).expanduser(), data_split or "train")
    else:
        return {}
    return {str(f.resolve()): sha256(f) for f in files}


def check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DataError(f"--out {out}: exists and is not empty (--force replaces its train.jsonl, test.jsonl "
                        "and manifest.json)")


def check_unique(problems: list[Problem]) -> None:
    """Problem ids must be unique: a problem given twice could land on both sides (held-out leakage),
    and traces and evaluation find problems by id."""
    seen: dict[str, Problem] = {}
    for p in problems:
        if p.id not in seen:
            seen[p.id] = p
        elif seen[p.id] == p:
            raise DataError(f"problem {p.id} is in the sources twice: give each data set and split once")
        else:  # e.g. APPS train and test both number their problems from 0
            raise DataError(f"two different problems have the id {p.id}: use one of the splits whose ids overlap")


def write_atomic(path: Path, text: str) -> None:
    """Whole or not at all: a run killed mid-write leaves the old file (or none), never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def prepare(sources: str, seed: int, train_fraction: float, out: str | Path, force: bool = False,
            progress: bool = True) -> dict:
    """Write the split of `sources` (a data.path for source=code) to `out`; returns the manifest."""
    if not 0.0 < train_fraction < 1.0:
        raise DataError(f"--train-fraction {train_fraction}: must be between 0 and 1 (both sides need problems)")
    out = Path(out).expanduser()
    check_out(out, force)
    parts = sources.split("+")
    for part in parts:  # every part checked before anything loads (a source can take minutes)
        path = parse_part(part)[1]
        if path and looks_local(path) and not Path(path).expanduser().exists():
            raise DataError(f"{part}: no such file or directory")
    problems, inputs = [], []
    # a loader's warnings (APPS rows without tests) print above the bar, not through it
    with logging_redirect_tqdm(), tqdm(total=len(parts), desc="prepare", unit="source", disable=not progress) as bar:
        for part in parts:
            bar.set_postfix_str(f"loading {part[:60]}")
            loaded = load_part(part)
            problems += loaded
            inputs.append({"part": part, "problems": len(loaded), "files": input_files(part)})
            bar.update(1)
        bar.set_postfix_str(f"{len(problems)} problems")
    check_unique(problems)
    train, test = split(problems, seed, train_fraction)
    counts: dict[str, dict[str, int]] = {}
    for side, rows in zip(SIDES, (train, test)):
        for p in rows:
            counts.setdefault(p.meta.get("source", "?"), {s: 0 for s in SIDES})[side] += 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # no manifest vouches for a half-replaced directory
    files = {}
    for side, rows in zip(SIDES, (train, test)):
        path = out / f"{side}.jsonl"
        write_atomic(path, "".join(json.dumps(to_row(p, side)) + "\n" for p in rows))
        files[path.name] = {"rows": len(rows), "sha256": sha256(path)}
    manifest = {"format": FORMAT, "sources": sources, "seed": seed, "train_fraction": train_fraction,
                "counts": counts, "inputs": inputs, "files": files}
    write_atomic(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------
# The command


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="toolrl-code-prepare", description=__doc__.splitlines()[0])
    ap.add_argument("--sources", required=True,
                    help="humaneval, mbpp[:PATH][@SPLIT], apps[:PATH][@SPLIT][@DIFFICULTY], joined by +")
    ap.add_argument("--seed", type=int, default=0, help="the split's seed (a training run's data.seed)")
    ap.add_argument("--train-fraction", type=float, default=0.8, help="each source's train share, in (0, 1)")
    ap.add_argument("--out", required=True, help="the directory to write")
    ap.add_argument("--force", action="store_true", help="replace a prepared split already in --out")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    logging.basicConfig(format="toolrl-code-prepare: %(message)s")
    try:
        manifest = prepare(args.sources, args.seed, args.train_fraction, args.out, args.force, not args.quiet)
    except DataError as exc:
        print(f"toolrl-code-prepare: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for source, n in sorted(manifest["counts"].items()):
        empty = [s for s in SIDES if not n[s]]
        note = f"  (warning: no {' or '.join(empty)} problems)" if empty else ""
        print(f"{source:>10}: {n['train']:6d} train {n['test']:6d} test{note}", file=sys.stderr)
    print(json.dumps({"out": str(args.out), "counts": manifest["counts"]}))


if __name__ == "__main__":
    main()
