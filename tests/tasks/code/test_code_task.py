"""The code family's teacher: collected traces read back, and the trace it writes per problem."""
import random

import pytest

from toolrl.config import TeacherConfig
from toolrl.tasks import Problem, get_task
from toolrl.tasks.code.task import code_trace, load_code_traces


def test_bad_teacher_trace_files_get_one_clear_error(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text('{"id": "mbpp:1", "code": "x = 1", "thinking": ""}\n\n{"id": "mbpp:1", "code": "x = 2"}\n')
    assert [r["code"] for r in load_code_traces(str(good))["mbpp:1"]] == ["x = 1", "x = 2"]
    with pytest.raises(ValueError, match="cannot read"):
        load_code_traces(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "code": "1"}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a trace row"):
        load_code_traces(str(bad))
    for row in ('{"id": "a", "code": null}', '{"id": 7, "code": "x = 1"}', '{"id": "a", "code": "1", "thinking": 3}'):
        bad.write_text(row + "\n")  # each broke the teacher later, mid-run, with a TypeError
        with pytest.raises(ValueError, match=r"bad.jsonl:1: not a trace row"):
            load_code_traces(str(bad))


def test_the_teacher_writes_a_collected_trace_else_the_reference_solution(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "mbpp:1", "code": "x = 1", "thinking": "collected"}\n')
    teacher = get_task("code").teacher(TeacherConfig(traces_path=str(path)))
    rng = random.Random(0)
    p = Problem(id="mbpp:1", question="q", answer="{}", program="x = 2", grading="tests")
    assert teacher(p, rng).text == "<think>\ncollected\n</think>\n```python\nx = 1\n```"
    other = teacher(Problem(id="mbpp:2", question="q", answer="{}", program="x = 2\n"), rng)
    assert other.program is None and other.text.endswith("</think>\n```python\nx = 2\n```")  # learned whole
    assert code_trace(Problem(id="mbpp:3", question="q", answer="{}"), rng, {}) is None
