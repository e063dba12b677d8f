"""The tool loop's bookkeeping and limits, with scripted model segments, the real tokenizer and the
real executor service (vLLM itself is exercised in test_gen_worker.py)."""
import asyncio
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import Proc, free_port  # noqa: E402

from toolrl.config import RolloutConfig  # noqa: E402
from toolrl.data import arithmetic_problems  # noqa: E402
from toolrl.engine import GenOut  # noqa: E402
from toolrl.models import load_tokenizer  # noqa: E402
from toolrl.prompts import STOP_MARKER, format_tool_result  # noqa: E402
from toolrl.rollout import TRUNCATION_MARK, ExecutorTool, run_rollout, tool_segment_ids  # noqa: E402
from toolrl.teacher import teacher_sample  # noqa: E402

TOK = load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    from toolrl.sandbox.client import AsyncExecutorClient

    port = free_port()
    p = Proc("executor", ["executor_service.py", "--port", str(port)], tmp_path_factory.mktemp("ex"))
    try:
        p.wait_http(f"http://127.0.0.1:{port}/health", 60)
        yield lambda: ExecutorTool(AsyncExecutorClient(f"http://127.0.0.1:{port}"), timeout_s=5)
    finally:
        p.stop()


class Script:
    """Plays back model segments as a vLLM engine would return them (token ids from the tokenizer)."""

    def __init__(self, segments):
        self.segments = list(segments)
        self.prompts = []

    async def generate(self, ids, max_tokens, request_id):
        self.prompts.append(list(ids))
        text, stop = self.segments.pop(0)
        toks = TOK.encode(text, add_special_tokens=False)
        finish = "stop"
        if len(toks) > max_tokens:
            toks, finish, stop = toks[:max_tokens], "length", None
            text = TOK.decode(toks)
        return GenOut(toks, [-0.5] * len(toks), text, finish, stop)


def run(script, tool, cfg=None, prompt=(1, 2, 3), pending=None):
    cfg = cfg or RolloutConfig()
    return asyncio.run(run_rollout(script, tool, TOK, list(prompt), cfg, "t.0", pending))


def prog(code):
    return f"Let me compute.\n<program>\n```python\n{code}\n```\n</program>\n{STOP_MARKER}"


def test_segments_masks_and_resume_by_token_ids(tool):
    s = Script([(prog("x = 6 * 7\nprint(x)"), STOP_MARKER), (prog("print(x + 1)"), STOP_MARKER),
                ("So it is 43.\n</think>\n<answer>\\boxed{43}</answer>", None)])
    r = run(s, tool())
    assert [k for k, _, _ in r.segments] == ["model", "tool", "model", "tool", "model"]
    assert [c.output for c in r.tool_calls] == ["42\n", "43\n"]  # the session kept x between blocks
    for kind, a, b in r.segments:
        assert set(r.loss_mask[a:b]) == {1 if kind == "model" else 0}
        assert all((lp is None) == (kind == "tool") for lp in r.logprobs[a:b])
    _, a, b = r.segments[1]
    assert r.completion_ids[a:b] == tool_segment_ids(TOK, "42\n", 128)
    assert TOK.decode(r.completion_ids[a:b]) == format_tool_result("42\n")
    # every resume sends exactly the previous tokens back: nothing re-tokenised
    assert s.prompts[1] == [1, 2, 3] + r.completion_ids[: r.segments[1][2]]
    assert s.prompts[2] == [1, 2, 3] + r.completion_ids[: r.segments[3][2]]
    assert r.stop_reason == "eos" and r.generated == sum(b - a for k, a, b in r.segments if k == "model")


def test_program_close_stop_gets_the_marker_from_the_harness(tool):
    s = Script([("<program>\n```python\nprint(5)\n```\n</program>", "</program>"), ("done", None)])
    r = run(s, tool())
    _, a, b = r.segments[1]
    assert TOK.decode(r.completion_ids[a:b]) == f"\n{STOP_MARKER}" + format_tool_result("5\n")


def test_limits_end_cleanly(tool):
    cfg = RolloutConfig(max_tool_calls=1)
    r = run(Script([(prog("print(1)"), STOP_MARKER), (prog("print(2)"), STOP_MARKER)]), tool(), cfg)
    assert r.stop_reason == "max_tool_calls" and len(r.tool_calls) == 1
    cfg = RolloutConfig(max_new_tokens=10)
    r = run(Script([("word " * 50, None)]), tool(), cfg)
    assert r.stop_reason == "length" and r.generated == 10
    cfg = RolloutConfig(max_total_tokens=60, max_new_tokens=1000)
    r = run(Script([("word " * 100, None)]), tool(), cfg)
    assert r.stop_reason == "max_total_tokens" and len(r.prompt_ids) + len(r.completion_ids) == 60


def test_long_tool_output_is_cut_with_a_marker(tool):
    cfg = RolloutConfig(max_tool_output_tokens=16)
    r = run(Script([(prog("print('abc ' * 500)"), STOP_MARKER), ("ok", None)]), tool(), cfg)
    _, a, b = r.segments[1]
    text = TOK.decode(r.completion_ids[a:b])
    assert TRUNCATION_MARK.strip() in text and b - a < 40


def test_errors_and_missing_code_are_tool_errors(tool):
    r = run(Script([(prog("1/0"), STOP_MARKER), (f"no code here\n{STOP_MARKER}", STOP_MARKER), ("end", None)]),
            tool())
    assert [c.status for c in r.tool_calls] == ["error", "error"]
    assert "ZeroDivisionError" in r.tool_calls[0].output
    assert "no ```python block" in r.tool_calls[1].output


def test_a_dead_executor_is_a_tool_error_not_a_hang():
    from toolrl.sandbox.client import AsyncExecutorClient

    dead = ExecutorTool(AsyncExecutorClient(f"http://127.0.0.1:{free_port()}", timeout_s=2, retries=1))
    r = run(Script([(prog("print(1)"), STOP_MARKER), ("end", None)]), dead)
    assert r.tool_calls[0].status == "unavailable" and "unavailable" in r.tool_calls[0].output
    assert r.stop_reason == "eos"


def test_prefill_program_runs_first(tool):
    r = run(Script([("after", None)]), tool(), pending="print(6 * 7)")
    assert r.segments[0][0] == "tool" and r.tool_calls[0].output == "42\n"


def test_teacher_traces_have_the_rollout_layout(tool):
    rng = random.Random(0)
    for p in arithmetic_problems(6, seed=4, level=3):
        s = asyncio.run(teacher_sample(p, [1, 2], TOK, tool(), 128, rng, "g:teacher0", 5))
        assert s is not None and s.source == "teacher" and s.policy_version == 5
        assert s.tool_calls[0].output.strip() == p.answer  # the executor's output, not string formatting
        zeros = [i for i, m in enumerate(s.loss_mask) if m == 0]
        a, b = zeros[0], zeros[-1] + 1
        assert zeros == list(range(a, b))  # one masked tool span
        assert s.completion_ids[a:b] == tool_segment_ids(TOK, s.tool_calls[0].output, 128)
        head = TOK.decode(s.completion_ids[:a])
        assert head.endswith(STOP_MARKER) and "```python" in head
        assert s.text.rstrip().endswith(f"\\boxed{{{p.answer}}}\n</answer>")
        assert s.completion_ids[-1] == TOK.eos_token_id
        a, b, c = (p.meta["numbers"][k] for k in "abc")
        assert f"{a} times {b}, minus {c}" in head.split("<program>")[0]  # the plan names the operation


def test_expression_in_words():
    from toolrl.teacher import expression_in_words

    assert expression_in_words("148 * 36 - 2915") == "148 times 36, minus 2915"
    assert expression_in_words("(2 * 3 + 4 * 5) * 6 - 7") == "(2 times 3, plus 4 times 5) times 6, minus 7"


def test_a_code_group_is_scored_by_its_tests_with_a_teacher_trace(tool, tmp_path):
    """GenWorker on a code task (scripted engine, real executor): the tests reward is the fraction
    of tests passed, correct is all-or-nothing, and the teacher trace is the reference solution."""
    from toolrl.config import load_config
    from toolrl.genworker import GenWorker

    url = tool().client.url
    fixture = Path(__file__).parent / "fixtures" / "mbpp_sample.jsonl"
    cfg = load_config("configs/cpu_code.yaml", [f"executor.url={url}", f"data.path=mbpp:{fixture}",
                                                "data.train_fraction=1.0", "rollout.group_size=3",
                                                "teacher.traces_per_group=1"])
    answers = {"right": "def square_perimeter(a):\n    return 4 * a",
               "partly": "def square_perimeter(a):\n    return 40 if a == 10 else 0",
               "none": "I am not sure."}
    script = Script([(f"Perimeter is four sides.\n</think>\n```python\n{answers[k]}\n```", None) if k != "none"
                     else (answers[k], None) for k in answers])
    worker = GenWorker(cfg, worker_id="t", engine=script)
    problem = next(p for p in worker.problems if p.id == "mbpp:17")

    async def one_group():
        try:
            return await worker.rollout_group(problem)
        finally:
            await worker.executor.aclose()
    group = asyncio.run(one_group())
    model, teacher = group[:3], group[3]
    assert [s.rewards["tests"] for s in model] == pytest.approx([1.0, 1 / 3, 0.0])
    assert [s.rewards["correct"] for s in model] == [1.0, 0.0, 0.0]
    assert [s.rewards["code_format"] for s in model] == [1.0, 1.0, 0.0]
    assert model[0].advantage > model[1].advantage > model[2].advantage
    assert teacher.source == "teacher" and "perimeter=4*a" in teacher.text and set(teacher.loss_mask) == {1}


def test_evaluate_scores_the_policy_alone_and_leaves_training_state_alone(tool):
    """GenWorker.evaluate (what `POST /evaluate` and evaluate.py run): per-problem correctness and
    unbiased pass@k, tool use counted, no teacher traces although the config adds them in
    training, and neither the training statistics nor the curriculum move."""
    from toolrl.config import load_config
    from toolrl.genworker import GenWorker

    # Level 1 of 3 with a 1-group window: one right answer during training would promote.
    cfg = load_config("configs/cpu_demo.yaml", [f"executor.url={tool().client.url}", "data.level=1",
                                                "data.max_level=3", "data.promote_window=1"])
    assert cfg.teacher.traces_per_group >= 1  # training adds them; the evaluation must not
    problems = arithmetic_problems(3, seed=11, level=1)
    calls = {p.id: 0 for p in problems}

    class ByQuestion:
        """Problem 0: always right, with a program; problem 1: right on the first sample only;
        problem 2: always wrong, no program."""

        async def generate(self, ids, max_tokens, request_id):
            text = TOK.decode(ids)
            i = next(i for i, p in enumerate(problems) if p.question in text)
            p = problems[i]
            calls[p.id] += 1
            if i == 0 and STOP_MARKER not in text.split(p.question)[-1]:
                out, stop = prog(p.meta["expression"].join(["print(", ")"])), STOP_MARKER
            elif i == 0 or (i == 1 and calls[p.id] == 1):
                out, stop = f"Done.\n</think>\n<answer>\n\\boxed{{{p.answer}}}\n</answer>", None
            else:
                out, stop = "Done.\n</think>\n<answer>\n\\boxed{7}\n</answer>", None
            toks = TOK.encode(out, add_special_tokens=False)
            return GenOut(toks, [-0.5] * len(toks), out, "stop", stop)

    worker = GenWorker(cfg, worker_id="t", engine=ByQuestion())

    async def go():
        try:
            return await worker.evaluate(problems, samples=2, ks=[1, 2], concurrency=2)
        finally:
            await worker.executor.aclose()
    res = asyncio.run(go())
    assert [(r["id"], r["n"], r["correct"]) for r in res["per_problem"]] == [
        (problems[0].id, 2, 2), (problems[1].id, 2, 1), (problems[2].id, 2, 0)]
    assert res["n_samples"] == 6 and res["accuracy"] == pytest.approx(3 / 6)
    assert res["pass_at_k"] == {"1": pytest.approx(0.5), "2": pytest.approx(2 / 3)}
    assert res["tool_calls_per_answer"] == pytest.approx(2 / 6) and res["tool_error_rate"] == 0.0
    assert res["policy_version"] == 0 and res["aborted_samples"] == 0
    assert worker.stats.samples == 0 and worker.stats.teacher_traces == 0 and worker.level == 1


def test_curriculum_promotes_on_accuracy_and_mix_levels_keeps_reviewing():
    """Arithmetic curriculum: the level rises once the recent groups' accuracy passes the bar; with
    data.mix_levels the problems cycle through every level up to the current one."""
    from types import SimpleNamespace

    from toolrl.config import load_config
    from toolrl.genworker import GenWorker

    def worker(*sets):
        cfg = load_config("configs/cpu_demo.yaml", ["data.promote_window=2", "data.promote_at_accuracy=0.5",
                                                    "data.max_level=3", *sets])
        made.append(GenWorker(cfg, worker_id="t", engine=object()))
        return made[-1]

    made = []

    def group(acc):
        return [SimpleNamespace(rewards={"correct": float(i < acc * 4)}) for i in range(4)]

    def levels(w, n):
        return [next(w.problems).level for _ in range(n)]

    w = worker("data.level=1", "data.mix_levels=false")
    assert levels(w, 3) == [1, 1, 1]
    w._curriculum(group(0.25))
    assert w.level == 1  # the window of 2 groups is not full yet
    w._curriculum(group(0.5))
    assert w.level == 1  # (0.25 + 0.5) / 2 < 0.5
    w._curriculum(group(0.75))  # (0.5 + 0.75) / 2 >= 0.5
    assert w.level == 2 and levels(w, 3) == [2, 2, 2]

    w = worker("data.level=1", "data.mix_levels=true")
    assert levels(w, 2) == [1, 1]
    w._curriculum(group(1.0)), w._curriculum(group(1.0))
    assert w.level == 2 and levels(w, 4) == [1, 2, 1, 2]
    w._curriculum(group(1.0)), w._curriculum(group(1.0))
    w._curriculum(group(1.0)), w._curriculum(group(1.0))
    assert w.level == 3  # max_level: no further
    assert levels(worker("data.level=3", "data.mix_levels=true"), 6) == [1, 2, 3, 1, 2, 3]
    for w in made:
        w.assembler.close()
