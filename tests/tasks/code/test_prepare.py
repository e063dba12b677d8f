"""Phase 1, `toolrl.tasks.code.prepare`: the split it writes (counts per source and side, seeded, the
same as training's in-memory split, challenge tests on the test side only), `prepared:DIR` read back
by training's stream and by evaluation exactly as written, and bad input as one line and status 2."""
import hashlib
import json
import subprocess
import sys

import pytest
from procs import ROOT  # tests/ is on sys.path (tests/conftest.py)

from toolrl.config import DataConfig
from toolrl.tasks import DataError, load_problems, load_task, problem_stream
from toolrl.tasks.code.judge import TestSpec
from toolrl.tasks.code.loaders import load_code_task, split
from toolrl.tasks.code.prepare import main
from toolrl.tasks.code.prepared import read_prepared

FIX = ROOT / "tests" / "fixtures"
SOURCES = f"humaneval+mbpp:{FIX / 'mbpp_sample.jsonl'}+apps:{FIX / 'apps_sample.jsonl'}"
# MBPP rows as the hub publishes them, two with challenge tests (held-out material)
CHALLENGE = {11: ['assert remove_Occ("xaxbx","x") == "axb"'], 17: ["assert square_perimeter(0)==0",
                                                                   "assert square_perimeter(-1)==-4"]}


def prepare(tmp_path, *args, sources=SOURCES, name="out"):
    out = tmp_path / name
    main(["--sources", sources, "--out", str(out), "--quiet", *args])
    return out


def rows(out, side):
    return [json.loads(line) for line in (out / f"{side}.jsonl").read_text().splitlines()]


def as_values(problems):
    return [(p, p.meta) for p in problems]  # meta is left out of Problem's ==


@pytest.fixture
def mbpp_challenge(tmp_path):
    lines = []
    for line in (FIX / "mbpp_sample.jsonl").read_text().splitlines():
        row = json.loads(line)
        row["challenge_test_list"] = CHALLENGE.get(row["task_id"], [])
        lines.append(json.dumps(row) + "\n")
    path = tmp_path / "mbpp_challenge.jsonl"
    path.write_text("".join(lines))
    return path


def test_counts_per_source_and_side_and_a_manifest_that_vouches_for_the_files(tmp_path, capsys):
    out = prepare(tmp_path, "--seed", "3", "--train-fraction", "0.5")
    want = {"humaneval": {"train": 82, "test": 82}, "mbpp": {"train": 2, "test": 1},  # round(1.5) = 2
            "apps": {"train": 1, "test": 1}}  # the APPS row without tests is not a problem
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "counts": want}
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["sources"], manifest["seed"], manifest["train_fraction"], manifest["counts"]) == (
        SOURCES, 3, 0.5, want)
    for side in ("train", "test"):
        got = rows(out, side)
        assert manifest["files"][f"{side}.jsonl"] == {
            "rows": len(got), "sha256": hashlib.sha256((out / f"{side}.jsonl").read_bytes()).hexdigest()}
        assert {tuple(sorted(r)) for r in got} == {("id", "meta", "program", "question", "tests")}  # one schema
        for source, n in want.items():
            assert sum(r["meta"]["source"] == source for r in got) == n[side]
    inputs = {i["part"].split(":")[0]: i for i in manifest["inputs"]}
    assert [i["problems"] for i in manifest["inputs"]] == [164, 3, 2]
    mbpp_file = str((FIX / "mbpp_sample.jsonl").resolve())
    assert inputs["mbpp"]["files"] == {mbpp_file: hashlib.sha256((FIX / "mbpp_sample.jsonl").read_bytes()).hexdigest()}
    assert list(inputs["humaneval"]["files"])[0].endswith("HumanEval.jsonl.gz")


def test_a_seed_gives_one_split_and_another_seed_another(tmp_path):
    a, b, c = (prepare(tmp_path, "--seed", s, name=n) for s, n in (("0", "a"), ("0", "b"), ("1", "c")))
    for name in ("train.jsonl", "test.jsonl", "manifest.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ids = lambda out, side: [r["id"] for r in rows(out, side)]  # noqa: E731
    assert ids(a, "test") != ids(c, "test") and sorted(ids(a, "train") + ids(a, "test")) == sorted(
        ids(c, "train") + ids(c, "test"))
    humaneval_test = lambda out: {i for i in ids(out, "test") if i.startswith("humaneval")}  # noqa: E731
    assert humaneval_test(a) != humaneval_test(c)  # not only reordered: other problems are held out


@pytest.mark.parametrize("seed,fraction", [(0, 0.8), (5, 0.5), (11, 0.3)])
def test_the_prepared_split_is_the_split_training_makes_in_memory(tmp_path, mbpp_challenge, seed, fraction):
    sources = f"humaneval+mbpp:{mbpp_challenge}+apps:{FIX / 'apps_sample.jsonl'}"
    out = prepare(tmp_path, "--seed", str(seed), "--train-fraction", str(fraction), sources=sources)
    train, test = split(load_code_task(sources), seed, fraction)
    # what a training run on the same sources, seed and fraction trains on and evaluates on today
    d = DataConfig(source="code", path=sources, seed=seed, train_fraction=fraction)
    assert load_problems(d) == train and load_task(f"code:{sources}", 10_000, seed, d) == test
    assert as_values(read_prepared(out, "test")) == as_values(test)  # tests, challenge tests, meta: exact
    got = read_prepared(out, "train")
    assert got == train  # ids, questions, tests (byte for byte), programs, in order
    assert [p.meta for p in got] == [{k: v for k, v in p.meta.items() if k != "challenge_tests"} for p in train]


def test_challenge_tests_are_on_the_test_side_only(tmp_path, mbpp_challenge):
    held_out = set()
    for seed in range(8):
        out = prepare(tmp_path, "--seed", str(seed), "--train-fraction", "0.5",
                      sources=f"mbpp:{mbpp_challenge}", name=f"s{seed}")
        train_text = (out / "train.jsonl").read_text()
        for test in (t for ts in CHALLENGE.values() for t in ts):
            assert json.dumps(test)[1:-1] not in train_text  # not in tests, not in meta
        for row in rows(out, "test"):
            task = int(row["id"].split(":")[1])
            base = next(json.loads(x) for x in (FIX / "mbpp_sample.jsonl").read_text().splitlines()
                        if json.loads(x)["task_id"] == task)["test_list"]
            assert row["tests"]["tests"] == base + CHALLENGE.get(task, [])  # run by held-out evaluation
            held_out |= {task} & set(CHALLENGE)
    assert held_out == set(CHALLENGE)  # each challenge task was held out for some seed


def test_training_and_evaluation_read_the_prepared_rows_exactly(tmp_path, mbpp_challenge):
    out = prepare(tmp_path, "--seed", "2", sources=f"humaneval+mbpp:{mbpp_challenge}+apps:{FIX / 'apps_sample.jsonl'}")
    train, test = read_prepared(out, "train"), read_prepared(out, "test")
    assert [p.id for p in train] == [r["id"] for r in rows(out, "train")] and len(train) == 135
    assert [TestSpec.from_json(p.answer).tests for p in test] == [r["tests"]["tests"] for r in rows(out, "test")]
    # a seed and fraction of the run's own change nothing: the directory's split is never re-split
    d = DataConfig(source="code", path=f"prepared:{out}", seed=9, train_fraction=0.3)
    assert as_values(load_problems(d)) == as_values(train)
    stream = problem_stream(d, "gen-0")
    first_pass = [next(stream) for _ in train]
    assert sorted(as_values(first_pass), key=lambda v: v[0].id) == sorted(as_values(train), key=lambda v: v[0].id)
    assert as_values(load_task(f"code:prepared:{out}", 10_000, 9, d)) == as_values(test)
    assert as_values(load_task(f"code:prepared:{out}@test", 10_000, 0, d)) == as_values(test)
    assert as_values(load_task(f"code:prepared:{out}@train", 10_000, 0, d)) == as_values(train)
    assert [p.id for p in load_task(f"code:prepared:{out}", 5, 0, d)] == [p.id for p in test[:5]]


def test_a_prepared_directory_is_refused_when_misused_or_changed(tmp_path):
    out = prepare(tmp_path)
    with pytest.raises(DataError, match="names the test side; the train side is read here"):
        load_problems(DataConfig(source="code", path=f"prepared:{out}@test"))  # never train on the test side
    with pytest.raises(DataError, match="stands alone"):
        load_code_task(f"mbpp:{FIX / 'mbpp_sample.jsonl'}+prepared:{out}")
    with pytest.raises(DataError, match=r"not a prepared directory, no manifest.json \(a prepared directory stands"):
        load_problems(DataConfig(source="code", path=f"prepared:{out}+mbpp:{FIX / 'mbpp_sample.jsonl'}"))
    with pytest.raises(DataError, match="not a prepared directory"):
        load_problems(DataConfig(source="code", path=f"prepared:{tmp_path / 'nowhere'}"))
    text = (out / "test.jsonl").read_text()
    (out / "test.jsonl").write_text(text.replace("candidate", "candidat", 1))  # an edited test
    with pytest.raises(DataError, match=r"test.jsonl: changed since it was prepared"):
        load_task(f"code:prepared:{out}", 10, 0, DataConfig(source="code"))
    assert len(load_problems(DataConfig(source="code", path=f"prepared:{out}"))) == 135  # the other side is intact


@pytest.mark.parametrize("args,says", [
    (["--sources", "humaneval+mbpx:x.jsonl"], "unknown code task 'mbpx:x.jsonl'; use humaneval, mbpp"),
    (["--sources", "humaneval@test"], "unknown code task 'humaneval@test'"),
    (["--sources", "humaneval+mbpp:/no/such/mbpp.jsonl"], "mbpp:/no/such/mbpp.jsonl: no such file"),
    (["--sources", "mbpp:data/mbpp.parquet"], "mbpp:data/mbpp.parquet: no such file"),  # not taken for a hub id
    (["--sources", "apps:FIX/apps_sample.jsonl@interview@competition"], "use KIND[:PATH][@SPLIT], and for apps"),
    (["--sources", "humaneval", "--train-fraction", "1"], "--train-fraction 1.0: must be between 0 and 1"),
    (["--sources", "humaneval", "--train-fraction", "0"], "--train-fraction 0.0: must be between 0 and 1"),
    (["--sources", "humaneval", "--train-fraction", "-0.2"], "--train-fraction -0.2: must be between 0 and 1"),
    (["--sources", "mbpp:FIX/mbpp_sample.jsonl+mbpp:FIX/mbpp_sample.jsonl"], "problem mbpp:11 is in the sources twice"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, args, says):
    args = [a.replace("FIX", str(FIX)) for a in args]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("toolrl-code-prepare: ")
    assert says in err
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_missing_data_file_is_never_taken_for_a_hub_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # were it taken for one, fail fast rather than reach out
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    for path in ("data/mbpp.parquet", "mbpp.jsonl", "apps/test.jsonl.gz", "x.arrow", "y.json"):
        with pytest.raises(DataError, match=rf"^{path}: not a readable data file \(no such file or directory\)$"):
            load_code_task(f"mbpp:{path}")


def test_an_existing_out_needs_force(tmp_path, capsys):
    out = prepare(tmp_path, "--seed", "0")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        prepare(tmp_path, "--seed", "1")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "exists and is not empty (--force replaces" in err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # untouched
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        prepare(tmp_path, name="file")
    assert exc.value.code == 2 and "exists and is not a directory" in capsys.readouterr().err
    prepare(tmp_path, "--seed", "1", "--force")
    assert json.loads((out / "manifest.json").read_text())["seed"] == 1
    assert sorted(f.name for f in out.iterdir()) == ["manifest.json", "test.jsonl", "train.jsonl"]  # no temp files


def test_the_command_runs_with_progress_and_fails_without_a_traceback(tmp_path):
    cmd = [sys.executable, "-m", "toolrl.tasks.code.prepare", "--sources", f"mbpp:{FIX / 'mbpp_sample.jsonl'}",
           "--out", str(tmp_path / "out")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "prepare: 100%" in p.stderr and "1/1" in p.stderr and "3 problems" in p.stderr  # the progress line
    assert "mbpp:      2 train      1 test" in p.stderr and "RuntimeWarning" not in p.stderr
    cmd[4], cmd[6] = "nope", str(tmp_path / "other")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr == "toolrl-code-prepare: unknown code task 'nope'; use humaneval, " \
        "mbpp[:PATH][@SPLIT], apps[:PATH][@SPLIT][@DIFFICULTY]\n"


def test_evaluate_py_evaluates_the_test_side_as_written_and_says_which_ks_it_left_out(tmp_path, monkeypatch, capsys):
    import toolrl.worker.evaluate as ev

    out = prepare(tmp_path, "--seed", "6")
    capsys.readouterr()
    seen = {}

    def fake_evaluate(cfg, problems, samples, ks, progress=True, samples_out=None):  # no model runs here
        seen.update(problems=problems, ks=ks)
        return {"accuracy": 0.0, "pass_at_k": {str(k): 0.0 for k in ks}, "n_problems": len(problems),
                "temperature": cfg.rollout.temperature if cfg.eval.temperature is None else cfg.eval.temperature,
                **dict.fromkeys(("format_rate", "code_written_rate", "code_executed_rate", "tool_calls_per_answer",
                                 "tool_error_rate", "mean_completion_tokens", "wall_s"), 0.0)}

    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    ev.main(["--model", "tiny-random", "--task", f"code:prepared:{out}", "--n-problems", "1000", "--samples", "4",
             "--ks", "1,5,10", "--out", str(tmp_path / "eval.json"), "--quiet", "--set", "data.seed=99"])
    assert as_values(seen["problems"]) == as_values(read_prepared(out, "test")) and seen["ks"] == [1]
    err = capsys.readouterr().err
    assert "pass@5, pass@10 left out: they need --samples 10 or more (--samples is 4)" in err
    # the default config (the demo's) evaluates greedily; four samples a problem are drawn as in training
    assert "4 samples a problem at the rollout temperature 0.8" in err
    for task, says in ((f"code:prepared:{tmp_path / 'nowhere'}", "not a prepared directory"),
                       (f"code:prepared:{out}+humaneval", "stands alone")):
        with pytest.raises(SystemExit) as exc:
            ev.main(["--model", "tiny-random", "--task", task, "--out", str(tmp_path / "e.json"), "--quiet"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and says in err
