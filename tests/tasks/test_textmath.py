"""Math problems read from data (toolrl.tasks.textmath, toolrl.tasks.rows), and the answer and
program parsers they rely on."""
from pathlib import Path

import pytest

from toolrl.config import DataConfig
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
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # Both libraries read these once, at import: imported by an earlier test, they would try the
    # network (20 s of timeouts where there is none) instead of failing at once.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    with pytest.raises(DataError, match="could not load hub dataset 'openai/gsm8k:main'"):
        load_gsm8k("openai/gsm8k:main")


def test_training_problems_come_from_data_path():
    cfg = DataConfig(source="gsm8k", path=str(FIX / "gsm8k_sample.jsonl"))
    assert len(load_problems(cfg)) == 3 and len(load_problems(cfg, n=2)) == 2
    with pytest.raises(DataError, match="data.path"):
        load_problems(DataConfig(source="math"))
