"""Math problems read from data (toolrl.tasks.textmath, toolrl.tasks.rows), and the answer and
program parsers they rely on."""
from pathlib import Path

import pytest

from toolrl.config import DataConfig
from toolrl.format import extract_program, last_boxed
from toolrl.tasks import DataError, load_problems
from toolrl.tasks.textmath import gsm8k_answer, load_gsm8k, load_jsonl, load_math

FIX = Path(__file__).resolve().parent.parent / "fixtures"


def test_gsm8k_answers_after_hashes():
    probs = load_gsm8k(str(FIX / "gsm8k_sample.jsonl"))
    assert [p.answer for p in probs] == ["72", "10", "5000"]
    assert probs[0].question.startswith("Natalia")
    assert gsm8k_answer("so 4,000 + 1,000\n#### 5,000") == "5000" and gsm8k_answer("no final") is None


def test_math_answers_in_nested_boxes():
    probs = load_math(str(FIX / "math_sample.jsonl"))
    assert [p.answer for p in probs] == ["12", r"\frac{8-7x}{6}", r"\{1,2,3\}"]
    assert probs[1].meta == {"level": "Level 3", "type": "Algebra"}


def test_generic_jsonl_fields():
    probs = load_jsonl(str(FIX / "generic_sample.jsonl"), question_field="prompt", answer_field="target")
    assert [(p.id, p.question, p.answer) for p in probs] == [("q1", "What is 6 times 7?", "42"),
                                                            ("q2", "What is 100 minus 1?", "99")]
    with pytest.raises(DataError, match="missing field 'question'"):
        load_jsonl(str(FIX / "generic_sample.jsonl"))


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "#### 1"}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        load_gsm8k(str(bad))
    bad.write_text('{"question": "a", "answer": "no final"}\n')
    with pytest.raises(DataError, match="####"):
        load_gsm8k(str(bad))
    with pytest.raises(DataError, match="not a readable"):
        load_gsm8k(str(tmp_path / "missing.jsonl"))


def test_hub_path_fails_clearly_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="could not load hub dataset 'openai/gsm8k:main'"):
        load_gsm8k("openai/gsm8k:main")


@pytest.mark.parametrize("text, want", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{a}{b}}", r"\frac{a}{b}"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),
    (r"\boxed{unclosed", None),
    ("nothing", None),
])
def test_last_boxed(text, want):
    assert last_boxed(text) == want


M = "The result of executing this Python code is:"


@pytest.mark.parametrize("segment,want", [
    ("<program>\n```python\nx = 1\nprint(x)\n```\n</program>\n" + M, "x = 1\nprint(x)"),
    ("```python\na = 1\n```\nthen\n```python\nb = 2\n```\n" + M, "b = 2"),  # the last block
    ("```python\na = 1\n```\n```bash\nls\n```\n" + M, "a = 1"),  # python wins over a later other fence
    ("```\nprint(3)\n```\n" + M, "print(3)"),  # a bare fence
    ("<program>\nprint(4)\n</program>\n" + M, "print(4)"),  # bare code in <program> tags
    ("<program>\n```python\nprint(5)\n" + M, "print(5)"),  # an unclosed fence runs to the marker
    ("```python\nprint(6)\n```\n" + M + "\n```output\n6\n```\n", "print(6)"),  # after the marker: ignored
    ("```output\n7\n```\n" + M, None),  # an output fence is not a program
    ("I will just think.\n" + M, None),
    ("<program>\n</program>\n" + M, None),
])
def test_extract_program(segment, want):
    assert extract_program(segment, M) == want


def test_training_problems_come_from_data_path():
    cfg = DataConfig(source="gsm8k", path=str(FIX / "gsm8k_sample.jsonl"))
    assert len(load_problems(cfg)) == 3 and len(load_problems(cfg, n=2)) == 2
    with pytest.raises(DataError, match="data.path"):
        load_problems(DataConfig(source="math"))
