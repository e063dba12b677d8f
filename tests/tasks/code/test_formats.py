"""MBPP and APPS as users have them offline (toolrl.tasks.rows, toolrl.tasks.code.loaders): the same rows
as the hub publishes them, written as a parquet file, a snapshot directory, save_to_disk output (a
Dataset, a DatasetDict) and a datasets cache, each read back to the Problems the jsonl gives; the
hub schemas' fields, MBPP's challenge tests on held-out problems only, the APPS difficulty filter,
clear errors, and the reference solutions through the real judge."""
import json
import logging
import shutil
from pathlib import Path

import pytest

from toolrl.config import DataConfig
from toolrl.tasks import DataError, load_problems, load_task
from toolrl.tasks.code.judge import TestSpec, run_tests
from toolrl.tasks.code.loaders import find_task, load_apps, load_code_task, load_mbpp, split

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

# MBPP, configuration "full": task_id, text, code, test_list, test_setup_code, challenge_test_list
MBPP = [
    {"task_id": 2, "text": "Write a function to find the shared elements from the given two lists.",
     "code": "def similar_elements(a, b):\r\n  return tuple(sorted(set(a) & set(b)))",
     "test_list": ["assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
                   "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)",
                   "assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 3, "text": "Write a python function to identify non-prime numbers.",
     "code": "import math\ndef is_not_prime(n):\n    if n < 2:\n        return True\n"
             "    return any(n % i == 0 for i in range(2, int(math.sqrt(n)) + 1))",
     "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True",
                   "assert is_not_prime(35) == True"],
     "test_setup_code": "",
     "challenge_test_list": ["assert is_not_prime(1) == True", "assert is_not_prime(49) == True"]},
    {"task_id": 17, "text": "Write a function to find the perimeter of a square.",
     "code": "def square_perimeter(a):\r\n  perimeter=4*a\r\n  return perimeter",
     "test_list": ["assert square_perimeter(10)==40", "assert square_perimeter(5)==20"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 900, "text": "Write a function that returns the sum of a list of the values in DATA.",
     "code": "def total(xs):\n    return sum(xs)",
     "test_list": ["assert total(DATA) == 6", "assert total([]) == 0"],
     "test_setup_code": "DATA = [1, 2, 3]", "challenge_test_list": []},
]
# MBPP, configuration "sanitized": prompt instead of text, test_imports, no setup or challenge tests
SANITIZED = [
    {"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 2,
     "prompt": "Write a function to find the shared elements from the given two lists.",
     "code": "def similar_elements(a, b):\n  return tuple(sorted(set(a) & set(b)))", "test_imports": [],
     "test_list": ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))"]},
    {"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 139,
     "prompt": "Write a function to find the circumference of a circle.",
     "code": "def circle_circumference(r):\n  return 2 * 3.1415 * r", "test_imports": ["import math"],
     "test_list": ["assert math.isclose(circle_circumference(10), 62.83, rel_tol=0.001)",
                   "assert math.isclose(circle_circumference(5), 31.415, rel_tol=0.001)"]},
    {"source_file": "Mike's Copy of Benchmark Questions Verification V2.ipynb", "task_id": 17,
     "prompt": "Write a function that returns the perimeter of a square given its side length as input.",
     "code": "def square_perimeter(a):\n  return 4*a", "test_imports": [],
     "test_list": ["assert square_perimeter(10)==40"]},
]
# APPS: problem_id, question, solutions and input_output as JSON strings, difficulty, url, starter_code
APPS = [
    {"problem_id": 4000, "question": "Two integers a and b are given on one line. Print their sum.\n",
     "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)\n"]),
     "input_output": json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]}),
     "difficulty": "introductory", "url": "https://codeforces.com/problemset/problem/1/A", "starter_code": ""},
    {"problem_id": 4001, "question": "Given a list of integers, return it sorted in descending order.",
     "solutions": json.dumps(["def sort_desc(xs):\n    return sorted(xs, reverse=True)\n"]),
     "input_output": json.dumps({"fn_name": "sort_desc", "inputs": [[[3, 1, 2]], [[]], [[5, 5, 1]]],
                                 "outputs": [[[3, 2, 1]], [[]], [[5, 5, 1]]]}),
     "difficulty": "interview", "url": "https://leetcode.com/problems/x/", "starter_code": "def sort_desc(xs):\n    "},
    {"problem_id": 4002, "question": "A task whose tests were never written.", "solutions": "",
     "input_output": "", "difficulty": "competition", "url": "", "starter_code": ""},
    {"problem_id": 4003, "question": "The first line holds n, the second n integers. Print their sum.",
     "solutions": json.dumps(["input()\nprint(sum(map(int, input().split())))\n", "print(0)"]),
     "input_output": json.dumps({"inputs": [["3", "1 2 3"], "2\n5 5\n"], "outputs": [["6"], "10\n"]}),
     "difficulty": "competition", "url": "https://atcoder.jp/x", "starter_code": ""},
    {"problem_id": 4004, "question": "Print the largest of the integers on the line.",
     "solutions": "[]", "input_output": json.dumps({"inputs": ["1 5 2\n"], "outputs": ["5\n"]}),
     "difficulty": "interview", "url": "", "starter_code": ""},
]
SCHEMAS = {
    "mbpp": pa.schema([("task_id", pa.int32()), ("text", pa.string()), ("code", pa.string()),
                       ("test_list", pa.list_(pa.string())), ("test_setup_code", pa.string()),
                       ("challenge_test_list", pa.list_(pa.string()))]),
    "sanitized": pa.schema([("source_file", pa.string()), ("task_id", pa.int32()), ("prompt", pa.string()),
                            ("code", pa.string()), ("test_imports", pa.list_(pa.string())),
                            ("test_list", pa.list_(pa.string()))]),
    "apps": pa.schema([("problem_id", pa.int64()), ("question", pa.string()), ("solutions", pa.string()),
                       ("input_output", pa.string()), ("difficulty", pa.string()), ("url", pa.string()),
                       ("starter_code", pa.string())]),
}
ROWS = {"mbpp": MBPP, "sanitized": SANITIZED, "apps": APPS}
LOADER = {"mbpp": load_mbpp, "sanitized": load_mbpp, "apps": load_apps}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict], name: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMAS[name]), path)
    return path


def dataset(rows: list[dict], name: str):
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_list(rows, features=datasets.Features.from_arrow_schema(SCHEMAS[name]))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Each data set in every format; a snapshot / DatasetDict holds rows [:2] as train, the rest as test."""
    root = tmp_path_factory.mktemp("data")
    out = {}
    for name, rows in ROWS.items():
        d = root / name
        out[name, "jsonl"] = write_jsonl(d / "rows.jsonl", rows)
        out[name, "parquet"] = write_parquet(d / "rows.parquet", rows, name)
        dataset(rows, name).save_to_disk(str(d / "saved"))
        out[name, "saved"] = d / "saved"
    # MBPP's hub repo: one folder per configuration, one parquet file per split
    snap = root / "mbpp_snapshot"
    for config, name in (("full", "mbpp"), ("sanitized", "sanitized")):
        rows = ROWS[name]
        write_parquet(snap / config / "train-00000-of-00001.parquet", rows[:2], name)
        write_parquet(snap / config / "test-00000-of-00001.parquet", rows[2:], name)
        write_parquet(snap / config / "prompt-00000-of-00001.parquet", rows[:1], name)
    (snap / "README.md").write_text("---\nconfigs: ...\n---\n")
    write_jsonl(snap / "full" / ".cache" / "train.jsonl", [{"junk": 1}])  # hidden folders are not the data
    out["mbpp_snapshot"] = snap
    # APPS's hub repo: train.jsonl and test.jsonl, and the loading script
    apps = root / "apps_snapshot"
    write_jsonl(apps / "train.jsonl", APPS[:2])
    write_jsonl(apps / "test.jsonl", APPS[2:])
    (apps / "apps.py").write_text("# loading script\n")
    out["apps_snapshot"] = apps
    # the hub's parquet conversion (refs/convert/parquet): CONFIG/SPLIT/0000.parquet
    conv = root / "apps_converted"
    write_parquet(conv / "default" / "train" / "0000.parquet", APPS[:2], "apps")
    write_parquet(conv / "default" / "test" / "0000.parquet", APPS[2:], "apps")
    out["apps_converted"] = conv
    # DatasetDict.save_to_disk
    datasets = pytest.importorskip("datasets")
    for name, rows in ROWS.items():
        dd = datasets.DatasetDict({"train": dataset(rows[:2], name), "test": dataset(rows[2:], name)})
        dd.save_to_disk(str(root / name / "saved_dict"))
        out[name, "saved_dict"] = root / name / "saved_dict"
    # a datasets cache: BUILDER-SPLIT.arrow next to dataset_info.json
    cache = root / "cache" / "mbpp" / "full" / "0.0.0" / "0123abcd"
    cache.mkdir(parents=True)
    shutil.copy(out["mbpp", "saved_dict"] / "train" / "data-00000-of-00001.arrow", cache / "mbpp-train.arrow")
    shutil.copy(out["mbpp", "saved_dict"] / "test" / "data-00000-of-00001.arrow", cache / "mbpp-test.arrow")
    shutil.copy(out["mbpp", "saved_dict"] / "test" / "dataset_info.json", cache / "dataset_info.json")
    out["mbpp_cache"] = cache
    return out


def as_values(problems):
    return [(p, p.meta) for p in problems]  # meta is left out of Problem's ==


def spec(p) -> TestSpec:
    return TestSpec.from_json(p.answer)


# ---------------------------------------------------------------------------------------------
# The hub's fields, read from jsonl


def test_mbpp_rows_become_problems_with_their_tests_and_setup(data):
    ps = load_mbpp(str(data["mbpp", "jsonl"]))
    assert [p.id for p in ps] == ["mbpp:2", "mbpp:3", "mbpp:17", "mbpp:900"]
    assert ps[0].question == (f"{MBPP[0]['text']}\nYour code should pass this test:\n{MBPP[0]['test_list'][0]}")
    assert [p.program for p in ps] == [r["code"] for r in MBPP]
    assert [spec(p).tests for p in ps] == [r["test_list"] for r in MBPP]  # the challenge tests are not here
    assert [spec(p).setup for p in ps] == ["", "", "", ""]
    assert [spec(p).program_setup for p in ps] == ["", "", "", "DATA = [1, 2, 3]"]  # beside the program
    assert [p.meta for p in ps] == [{"source": "mbpp"},
                                    {"source": "mbpp", "challenge_tests": MBPP[1]["challenge_test_list"]},
                                    {"source": "mbpp"}, {"source": "mbpp"}]
    assert {(p.grading, spec(p).kind) for p in ps} == {("tests", "assert")}


def test_sanitized_mbpp_uses_prompt_and_runs_test_imports_first(data):
    ps = load_mbpp(str(data["sanitized", "jsonl"]))
    assert [p.id for p in ps] == ["mbpp:2", "mbpp:139", "mbpp:17"]
    assert ps[1].question.startswith("Write a function to find the circumference of a circle.\n")
    assert [spec(p).setup for p in ps] == ["", "import math", ""]
    assert [spec(p).program_setup for p in ps] == ["", "", ""]
    assert [len(spec(p).tests) for p in ps] == [1, 2, 1] and spec(ps[1]).tests == SANITIZED[1]["test_list"]


def test_apps_rows_become_stdio_and_call_problems_and_rows_without_tests_are_counted(data, caplog):
    with caplog.at_level(logging.WARNING):
        ps = load_apps(str(data["apps", "jsonl"]))
    assert [p.id for p in ps] == ["apps:4000", "apps:4001", "apps:4003", "apps:4004"]  # 4002 has no tests
    assert "skipped 1 APPS rows with no tests" in caplog.text
    s = [spec(p) for p in ps]
    assert [x.kind for x in s] == ["stdio", "call", "stdio", "stdio"]
    assert (s[0].inputs, s[0].outputs) == (["1 2\n", "10 -3\n"], ["3\n", "7\n"])
    assert (s[1].fn_name, s[1].inputs, s[1].outputs) == ("sort_desc", [[[3, 1, 2]], [[]], [[5, 5, 1]]],
                                                         [[[3, 2, 1]], [[]], [[5, 5, 1]]])
    assert (s[2].inputs, s[2].outputs) == (["3\n1 2 3", "2\n5 5\n"], ["6", "10\n"])  # lists of lines joined
    assert "Write the function `sort_desc`" in ps[1].question and ps[1].question.endswith(
        "```python\ndef sort_desc(xs):\n    \n```")
    assert ps[0].question.endswith("print the answer to standard output.") and "```" not in ps[0].question
    assert [p.program for p in ps] == [json.loads(APPS[i]["solutions"])[0] for i in (0, 1, 3)] + [None]
    assert [p.meta for p in ps] == [{"source": "apps", "difficulty": d}
                                    for d in ("introductory", "interview", "competition", "interview")]


def test_the_apps_difficulty_filter_keeps_exactly_that_difficulty(data):
    path = data["apps", "parquet"]
    ids = lambda task: [p.id for p in load_code_task(task)]  # noqa: E731
    assert ids(f"apps:{path}@interview") == ["apps:4001", "apps:4004"]
    assert ids(f"apps:{path}@introductory") == ["apps:4000"]
    assert ids(f"apps:{path}@competition") == ["apps:4003"]
    assert ids(f"apps:{data['apps_snapshot']}@test@interview") == ["apps:4004"]  # with a split, either order
    assert ids(f"apps:{data['apps_snapshot']}@interview@test") == ["apps:4004"]
    for bad in (f"apps:{path}@interview@competition", f"mbpp:{path}@interview", f"apps:{path}@"):
        with pytest.raises(DataError, match="code task"):
            load_code_task(bad)


# ---------------------------------------------------------------------------------------------
# Every format gives the jsonl's Problems


@pytest.mark.parametrize("name", ["mbpp", "sanitized", "apps"])
def test_every_format_gives_the_problems_jsonl_gives(data, name):
    load, want = LOADER[name], as_values(LOADER[name](str(data[name, "jsonl"])))
    assert len(want) >= 3
    assert as_values(load(str(data[name, "parquet"]))) == want
    assert as_values(load(str(data[name, "saved"]))) == want  # a Dataset's save_to_disk: no split to choose
    saved_dict = str(data[name, "saved_dict"])
    assert as_values(load(saved_dict, "train") + load(saved_dict, "test")) == want
    assert as_values(load(saved_dict, None)) == want  # every split, in dataset_dict.json's order


def test_a_file_is_told_by_its_content_when_its_name_does_not_say(data, tmp_path):
    want = as_values(load_apps(str(data["apps", "jsonl"])))
    shutil.copy(data["apps", "parquet"], tmp_path / "apps-parquet")
    shutil.copy(data["apps", "saved"] / "data-00000-of-00001.arrow", tmp_path / "apps-stream")
    with pa.ipc.new_file(tmp_path / "apps.feather", SCHEMAS["apps"]) as w:  # the IPC file format (feather v2)
        w.write_table(pa.Table.from_pylist(APPS, schema=SCHEMAS["apps"]))
    shutil.copy(data["apps", "jsonl"], tmp_path / "apps-lines")
    (tmp_path / "apps.json").write_text(json.dumps(APPS))
    for name in ("apps-parquet", "apps-stream", "apps.feather", "apps-lines", "apps.json"):
        assert as_values(load_apps(str(tmp_path / name))) == want, name


def test_snapshots_and_caches_give_the_problems_jsonl_gives_split_by_split(data):
    mbpp, sanitized, apps = (as_values(LOADER[n](str(data[n, "jsonl"]))) for n in ("mbpp", "sanitized", "apps"))
    snap = data["mbpp_snapshot"]
    assert as_values(load_mbpp(str(snap / "full"))) == mbpp[:2]  # split train by default, as for a hub id
    assert as_values(load_mbpp(str(snap / "full"), "test")) == mbpp[2:]
    assert as_values(load_mbpp(str(snap / "full"), "prompt")) == mbpp[:1]
    assert as_values(load_mbpp(str(snap / "sanitized"), "test")) == sanitized[2:]
    assert as_values(load_mbpp(str(snap / "full" / "test-00000-of-00001.parquet"))) == mbpp[2:]
    assert as_values(load_code_task(f"mbpp:{snap / 'full'}@train+mbpp:{snap / 'full'}@test")) == mbpp
    assert as_values(load_code_task(f"mbpp:{snap / 'full'}")) == mbpp[:2]  # no @SPLIT: train
    for folder in (data["apps_snapshot"], data["apps_converted"]):
        assert as_values(load_apps(str(folder))) == apps[:2]
        assert as_values(load_apps(str(folder), "test")) == apps[2:]
    assert as_values(load_mbpp(str(data["mbpp_cache"]))) == mbpp[:2]
    assert as_values(load_mbpp(str(data["mbpp_cache"]), "test")) == mbpp[2:]
    assert find_task(f"apps:{data['apps_snapshot']}@test#4003").id == "apps:4003"
    assert find_task(f"mbpp:{snap / 'full'}@test#900").program == MBPP[3]["code"]


def test_the_code_family_reads_local_formats_through_data_path(data):
    task = f"mbpp:{data['mbpp_snapshot'] / 'full'}@test+apps:{data['apps', 'saved']}"
    d = DataConfig(source="code", path=task, train_fraction=0.5)
    train, held = load_problems(d), load_task(f"code:{task}", 10, d.seed, d)
    assert sorted(p.meta["source"] for p in train) == ["apps", "apps", "mbpp"]  # half of each source
    assert sorted(p.id for p in train + held) == ["apps:4000", "apps:4001", "apps:4003", "apps:4004",
                                                  "mbpp:17", "mbpp:900"]


# ---------------------------------------------------------------------------------------------
# Challenge tests: held-out problems only


def test_challenge_tests_are_run_on_held_out_problems_and_never_trained_on(data):
    path = str(data["mbpp", "parquet"])
    sides = set()
    for seed in range(12):
        d = DataConfig(source="code", path=f"mbpp:{path}", train_fraction=0.5, seed=seed)
        train, held = load_problems(d), load_task(f"code:mbpp:{path}", 10, seed, d)
        assert sorted(p.id for p in train + held) == ["mbpp:17", "mbpp:2", "mbpp:3", "mbpp:900"]
        for p in train:
            assert spec(p).tests == next(r["test_list"] for r in MBPP if f"mbpp:{r['task_id']}" == p.id)
        for p in held:
            row = next(r for r in MBPP if f"mbpp:{r['task_id']}" == p.id)
            assert spec(p).tests == row["test_list"] + row["challenge_test_list"]
        sides.add("mbpp:3" in {p.id for p in held})
    assert sides == {True, False}  # task 3 was on each side for some seed
    train, held = split(load_mbpp(path), seed=0, train_fraction=0.0)
    assert [len(spec(p).tests) for p in sorted(held, key=lambda p: p.id)] == [2, 3, 5, 2]  # 17, 2, 3, 900


# ---------------------------------------------------------------------------------------------
# Bad data: one DataError that names the problem


def test_a_missing_column_names_the_column_and_the_file(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "test_list"} for r in MBPP]
    f = tmp_path / "m.parquet"
    schema = SCHEMAS["mbpp"].remove(SCHEMAS["mbpp"].get_field_index("test_list"))
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), f)
    with pytest.raises(DataError, match=rf"{f} row 0: missing field 'test_list'"):
        load_mbpp(str(f))
    rows = [{k: v for k, v in r.items() if k != "question"} for r in APPS]
    with pytest.raises(DataError, match=r"row 0: missing field 'question'"):
        load_apps(str(write_jsonl(tmp_path / "a.jsonl", rows)))
    rows = [{k: v for k, v in r.items() if k != "text"} for r in MBPP]
    with pytest.raises(DataError, match=r"row 0: missing field 'text' \(or 'prompt'\)"):
        load_mbpp(str(write_jsonl(tmp_path / "t.jsonl", rows)))


def test_malformed_rows_name_the_row_and_the_field(tmp_path):
    bad = [dict(r) for r in APPS]
    bad[3]["input_output"] = '{"inputs": ["1"], "outputs": '
    f = write_parquet(tmp_path / "apps.parquet", bad, "apps")
    with pytest.raises(DataError, match=rf"{f} row 3: input_output is not valid JSON"):
        load_apps(str(f))
    assert [p.id for p in load_apps(str(f), difficulty="interview")] == ["apps:4001", "apps:4004"]  # not read
    bad[3]["input_output"] = json.dumps({"inputs": ["1", "2"], "outputs": ["1"]})
    with pytest.raises(DataError, match=r"row 3: input_output: .*equal length"):
        load_apps(str(write_parquet(tmp_path / "apps2.parquet", bad, "apps")))
    bad[3]["input_output"], bad[3]["solutions"] = APPS[3]["input_output"], "print(1)"
    with pytest.raises(DataError, match=r"row 3: solutions is not valid JSON"):
        load_apps(str(write_jsonl(tmp_path / "apps3.jsonl", bad)))
    mbpp = [dict(r) for r in MBPP]
    mbpp[1]["test_list"] = "assert is_not_prime(2) == False"
    with pytest.raises(DataError, match=r"row 1: test_list must be a list of strings, not str"):
        load_mbpp(str(write_jsonl(tmp_path / "m.jsonl", mbpp)))


def test_a_path_that_is_no_data_set_says_what_was_expected(tmp_path, data):
    (tmp_path / "notes.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match=r"notes.csv: not a readable data file: expected a .jsonl.*parquet"):
        load_mbpp(str(tmp_path / "notes.csv"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("hi")
    with pytest.raises(DataError, match=r"empty: no data files in this directory: expected"):
        load_apps(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="missing.parquet: not a readable data file"):
        load_mbpp(str(tmp_path / "missing.parquet"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"broken.parquet: not a readable parquet file"):
        load_mbpp(str(tmp_path / "broken.parquet"))
    with pytest.raises(DataError, match=r"more than once \(under full, sanitized"):
        load_mbpp(str(data["mbpp_snapshot"]))  # both configurations: point at one
    with pytest.raises(DataError, match=r"no file for split 'validation' \(its files name the splits prompt, test"):
        load_mbpp(str(data["mbpp_snapshot"] / "full"), "validation")
    with pytest.raises(DataError, match=r"DatasetDict with no split 'validation' \(it has train, test\)"):
        load_apps(str(data["apps", "saved_dict"]), "validation")


# ---------------------------------------------------------------------------------------------
# The reference solutions pass their own tests through the real judge


def test_reference_solutions_pass_their_tests_in_the_executor(data):
    from toolrl.executor.client import ExecutorClient
    from toolrl.executor.local import LocalExecutor

    _, held = split(load_mbpp(str(data["mbpp", "saved"])), seed=0, train_fraction=0.0)  # challenge tests too
    apps = load_apps(str(data["apps", "saved"]))
    problems = sorted(held, key=lambda p: p.id) + load_mbpp(str(data["sanitized", "parquet"])) + \
        [p for p in apps if p.program]
    with LocalExecutor(sets=["executor.workers=2"]) as ex, ExecutorClient(ex.url, timeout_s=60) as c:
        res = run_tests(c, [p.program for p in problems], [spec(p) for p in problems])
        wrong = run_tests(c, ["print(0)\ndef sort_desc(xs):\n    return xs\n"] * 2,
                          [spec(apps[0]), spec(apps[1])])
    assert [(p.id, r.passed, r.total) for p, r in zip(problems, res)] == [
        ("mbpp:17", 2, 2), ("mbpp:2", 3, 3), ("mbpp:3", 5, 5), ("mbpp:900", 2, 2),  # setup code, challenge tests
        ("mbpp:2", 1, 1), ("mbpp:139", 2, 2), ("mbpp:17", 1, 1),  # sanitized: test_imports
        ("apps:4000", 2, 2), ("apps:4001", 3, 3), ("apps:4003", 2, 2)]  # stdio, call, stdio (lines)
    assert [(r.passed, r.total) for r in wrong] == [(0, 2), (2, 3)]  # the judge does tell them apart


# ---------------------------------------------------------------------------------------------
# A hub dataset that ships a loading script (codeparrot/apps has apps.py beside train.jsonl and
# test.jsonl): datasets 4 and later refuses it, so its split's data files are downloaded and read as
# they are. The hub is out of reach here: the files come from a hub cache laid out as huggingface_hub
# keeps it, offline, where the real datasets.load_dataset fails before it sees the script.

@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """someone/apps in an offline hub cache: train.jsonl, test.jsonl and apps.py. -> the allow_patterns
    of every snapshot_download call (the real one, spied on)."""
    import datasets
    import huggingface_hub
    import huggingface_hub.constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "datasets--someone--apps"
    write_jsonl(repo / "snapshots" / commit / "train.jsonl", APPS[:2])
    write_jsonl(repo / "snapshots" / commit / "test.jsonl", APPS[2:])
    (repo / "snapshots" / commit / "apps.py").write_text("# loading script\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    # the repo's whole file list, as an online snapshot_download leaves it: files never downloaded too
    (repo / "trees").mkdir()
    listed = (".gitattributes", "README.md", "apps.py", "train.jsonl", "test.jsonl")
    (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": {
        f: {"size": 3, "blob_id": "x"} for f in listed}}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    patterns, real = [], huggingface_hub.snapshot_download

    def spy(*args, **kw):
        patterns.append(kw.get("allow_patterns"))
        return real(*args, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    return patterns


def test_a_hub_dataset_with_a_loading_script_is_read_from_its_data_files(tmp_path, hub_cache):
    jsonl = write_jsonl(tmp_path / "apps.jsonl", APPS)
    assert as_values(load_apps("someone/apps")) == as_values(load_apps(str(jsonl)))[:2]
    assert as_values(load_apps("someone/apps", "test")) == as_values(load_apps(str(jsonl)))[2:]
    # the split's files only (the test split of APPS is 1.3 GB), after a look for the script in the cache
    downloads = [p for p in hub_cache if p is not None]
    assert downloads == [[f"*{split}*{sfx}" for sfx in (".parquet", ".arrow", ".jsonl", ".jsonl.gz")]
                         for split in ("train", "test")]
    # not cached, and offline: datasets' own error, which names the dataset
    with pytest.raises(DataError, match=r"could not load hub dataset 'someone/other'.*ConnectionError"):
        load_apps("someone/other")
    # a configuration names what the script would build: it cannot be honoured from the files
    with pytest.raises(DataError, match=r"could not load hub dataset 'someone/apps:all'"):
        load_apps("someone/apps:all")


def test_online_the_refusal_itself_leads_to_the_files(tmp_path, hub_cache, monkeypatch):
    """Online, datasets reaches the hub, finds the script and refuses with this message (datasets/load.py):
    stood in for here, the one piece that needs the network."""
    import datasets

    def refuse(path, name=None, split=None, **_):
        raise RuntimeError("Dataset scripts are no longer supported, but found apps.py")

    monkeypatch.setattr(datasets, "load_dataset", refuse)
    (tmp_path / "hub" / "datasets--someone--apps" / "snapshots" / ("0" * 40) / "apps.py").unlink()
    jsonl = write_jsonl(tmp_path / "apps.jsonl", APPS)
    assert as_values(load_apps("someone/apps")) == as_values(load_apps(str(jsonl)))[:2]
