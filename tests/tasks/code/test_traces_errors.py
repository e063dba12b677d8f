"""Teacher traces without vLLM: thinking and code saved apart, the tasks a prepared directory gives,
and the error paths (a bad base URL, a model the server does not serve, a key it wants, no answers,
no answer that passes), each one line on stderr with its exit status. The servers here are stubs
that only ever fail; collecting real traces from vLLM's own server is test_teacher_traces.py."""
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from procs import ROOT, free_port  # tests/ is on sys.path (tests/conftest.py)

from toolrl.tasks.code.judge import TestSpec, program_in
from toolrl.tasks.code.prepare import main as prepare_main
from toolrl.tasks.code.prepared import read_prepared
from toolrl.tasks.code.traces import main, select_problems, thinking_of

FIX = ROOT / "tests" / "fixtures"
MBPP = FIX / "mbpp_trivial.jsonl"
CONFIG = str(ROOT / "configs" / "cpu_demo.yaml")
WRONG = "<think>\nAdd them, I think.\n</think>\n```python\ndef add(a, b):\n    return a - b\n```"


_DEFAULT = object()


@contextmanager
def stub(models=("teacher",), key=None, chat_status=200, message=_DEFAULT, models_busy=0, seen=None):
    """An OpenAI-shaped server at /v1 that serves `models` and answers every chat with WRONG code
    (or `chat_status`, or `message` as the choice's message); with `key`, anything without that
    bearer token is 401; the first `models_busy` model lists are 503; `seen` (a dict) gets the most
    chat requests it held at once."""
    lock, state = threading.Lock(), {"busy": models_busy, "now": 0}

    class Handler(BaseHTTPRequestHandler):
        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def authorized(self):
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                self.reply(401, {"error": {"message": "missing or bad API key"}})
                return False
            return True

        def do_GET(self):  # noqa: N802
            if self.path != "/v1/models":
                self.reply(404, {"detail": "Not Found"})
            elif state["busy"] > 0:
                state["busy"] -= 1
                self.reply(503, {"error": {"message": "loading the model"}})
            elif self.authorized():
                self.reply(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if seen is not None:
                with lock:
                    state["now"] += 1
                    seen["peak"] = max(seen.get("peak", 0), state["now"])
                time.sleep(0.05)
                with lock:
                    state["now"] -= 1
            msg = {"role": "assistant", "content": WRONG} if message is _DEFAULT else message
            if self.authorized():
                self.reply(chat_status, {"choices": [{"index": 0, "message": msg}]}
                           if chat_status == 200 else {"error": {"message": "the stub is overloaded"}})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=10)


def run(capsys, tmp_path, base_url, *args, model="teacher"):
    """traces' main with --quiet; (exit status, stderr, stdout)."""
    argv = ["--base-url", base_url, "--model", model, "--tasks", f"mbpp:{MBPP}", "--split", "all", "--retries", "1",
            "--config", CONFIG, "--set", f"executor.url=http://127.0.0.1:{free_port()}",  # a private executor
            "--out", str(tmp_path / "traces.jsonl"), "--quiet", *args]
    try:
        main(argv)
        status = 0
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.err, captured.out


def test_thinking_and_code_are_taken_apart():
    spec = TestSpec("assert", tests=["assert add(1, 2) == 3"])
    assert thinking_of({"content": WRONG}) == "Add them, I think."
    assert program_in(WRONG, spec) == "def add(a, b):\n    return a - b"  # no thinking in the code
    fenced = "First add, then return.\n```python\ndef add(a, b):\n    return a + b\n```"
    assert thinking_of({"content": fenced}) == "First add, then return."
    # a server with a reasoning parser hands the reasoning apart: vLLM as `reasoning`, others as `reasoning_content`
    for field in ("reasoning", "reasoning_content"):
        assert thinking_of({"content": "```python\nx = 1\n```", field: " sum it \n"}) == "sum it"


def test_traces_ask_one_side_of_a_prepared_directory_as_written(tmp_path):
    out = tmp_path / "prep"
    prepare_main(["--sources", f"humaneval+mbpp:{FIX / 'mbpp_sample.jsonl'}", "--seed", "4", "--out", str(out),
                  "--quiet"])
    train, test = read_prepared(out, "train"), read_prepared(out, "test")
    assert select_problems(f"prepared:{out}", "train", 0, 0.5) == train  # its split, whatever --seed says
    assert select_problems(f"prepared:{out}", "heldout", 0, 0.5) == test
    assert select_problems(f"prepared:{out}", "all", 0, 0.5) == train + test


@pytest.mark.parametrize("where,says", [
    ("unreachable", "cannot reach http://127.0.0.1:PORT/v1 (ConnectError"),
    ("no /v1", "/models: HTTP 404: --base-url should be the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1"),
    ("not a URL", "--base-url 127.0.0.1:PORT/v1: not an http(s) URL (Request URL is missing an 'http://'"),
])
def test_a_bad_base_url_is_one_line_before_anything_runs(capsys, tmp_path, where, says):
    with stub() as url:
        port = url.rsplit(":", 1)[1]
        base = {"unreachable": f"http://127.0.0.1:{free_port()}/v1", "no /v1": url,
                "not a URL": f"127.0.0.1:{port}/v1"}[where]
        status, err, out = run(capsys, tmp_path, base)
    says = says.replace("PORT", base.rsplit(":", 1)[1].split("/")[0])
    assert (status, out) == (2, "") and err.count("\n") == 1 and err.startswith("teacher_traces: ") and says in err
    assert not (tmp_path / "traces.jsonl").exists()


def test_a_model_the_server_does_not_serve_or_a_missing_key_is_one_line(capsys, tmp_path):
    with stub(models=("teacher-a", "teacher-b")) as url:
        status, err, _ = run(capsys, tmp_path, f"{url}/v1", model="teacher")
    assert status == 2 and err == (f"teacher_traces: model 'teacher' is not served at {url}/v1; "
                                   "it serves: teacher-a, teacher-b\n")
    with stub(key="sekrit") as url:
        status, err, _ = run(capsys, tmp_path, f"{url}/v1")
        assert status == 2 and "HTTP 401: the server wants a key (--api-key or OPENAI_API_KEY)" in err
        status, err, _ = run(capsys, tmp_path, f"{url}/v1", "--api-key", "sekrit", "--n", "0")
        assert status == 2 and err == "teacher_traces: --n 0: must be at least 1\n"


def test_bad_arguments_and_tasks_are_one_line(capsys, tmp_path):
    with stub() as url:
        for args, says in ((["--samples", "0"], "--samples 0: must be at least 1"),
                           (["--tasks", "mbpx"], "unknown code task 'mbpx'"),
                           (["--tasks", f"prepared:{tmp_path}"], "not a prepared directory"),
                           (["--tasks", f"mbpp:{MBPP}", "--split", "heldout", "--train-fraction", "1"],
                            "no tasks: --tasks"),
                           (["--config", str(tmp_path / "none.yaml")], "no such config file")):
            status, err, _ = run(capsys, tmp_path, f"{url}/v1", *args)
            assert status == 2 and err.count("\n") == 1 and says in err, (args, err)


def test_no_answer_at_all_is_an_error_with_the_first_reason(capsys, tmp_path):
    with stub(chat_status=503) as url:
        status, err, out = run(capsys, tmp_path, f"{url}/v1", "--n", "1", "--samples", "2")
    stats = json.loads(out)
    assert (stats["requested"], stats["answered"], stats["failed_requests"], stats["retries"]) == (2, 0, 2, 2)
    assert status == 1 and err.splitlines()[-1] == (f"teacher_traces: no answer from {url}/v1 (2 asked; first error: "
                                                    'HTTP 503: {"error": {"message": "the stub is overloaded"}})')
    assert not (tmp_path / "traces.jsonl").exists()


def test_no_passing_answer_writes_no_traces_and_says_where_the_rejected_are(capsys, tmp_path):
    rejected = tmp_path / "rejected.jsonl"
    with stub() as url:
        status, err, out = run(capsys, tmp_path, f"{url}/v1", "--n", "1", "--samples", "2",
                               "--rejected", str(rejected))
    assert status == 1 and json.loads(out)["answered"] == 2 and json.loads(out)["kept"] == 0
    assert err.splitlines()[-1] == (f"teacher_traces: none of the 2 answers passed its tests (saved to {rejected}); "
                                    f"nothing written to {tmp_path / 'traces.jsonl'}")
    assert not (tmp_path / "traces.jsonl").exists()  # an empty traces file would silently teach nothing
    rows = [json.loads(x) for x in rejected.read_text().splitlines()]
    assert [(r["id"], r["thinking"], r["code"], r["passed"], r["total"]) for r in rows] == [
        ("mbpp:1", "Add them, I think.", "def add(a, b):\n    return a - b", 0, 3)] * 2


def test_an_executor_failure_on_one_task_keeps_the_others_answers(tmp_path):
    """The tests of one task could not run (the executor's doing): that task is unscored and counted,
    and every other task's answers are still judged and returned."""
    import asyncio

    from toolrl.executor.api import ExecResult
    from toolrl.tasks.code.traces import collect
    from toolrl.tasks.code.loaders import load_mbpp

    problems = load_mbpp(str(MBPP))[:2]
    assert len(problems) == 2

    class HalfDown:
        calls = 0

        async def execute_batch(self, items):
            HalfDown.calls += 1
            if HalfDown.calls == 1:
                return [ExecResult(status="killed", exit_code=None, stdout="", stderr="[executor: cannot start]\n",
                                   truncated=False, wall_ms=0, cpu_ms=0, executor_fault=True) for _ in items]
            return [ExecResult(status="ok", exit_code=0, stdout="", stderr="", truncated=False, wall_ms=1, cpu_ms=1)
                    for _ in items]

    with stub() as url:
        kept, rejected, stats = asyncio.run(collect(problems, f"{url}/v1", "teacher", HalfDown(), concurrency=1,
                                                    retries=1, progress=False))
    assert stats["unscored_tasks"] == 1 and stats["answered"] == 2 and len(rejected) == 1 and kept == []


def test_odd_messages_are_failed_requests_or_text_never_a_crash(capsys, tmp_path):
    """A 200 whose message was a string crashed the whole run with AttributeError (every trace
    collected so far lost), and all-null messages with IndexError on the first error (found in
    review). Content sent as a list of text parts (some APIs do) is text."""
    for message in ("just a string", None, {"role": "assistant", "content": 42}):
        with stub(message=message) as url:
            status, err, out = run(capsys, tmp_path, f"{url}/v1", "--n", "1", "--samples", "2")
        assert status == 1 and "Traceback" not in err, err
        assert err.splitlines()[-1].startswith(f"teacher_traces: no answer from {url}/v1 (2 asked; first error: "
                                               "not an OpenAI chat completion"), err
    parts = {"role": "assistant", "content": [{"type": "text", "text": WRONG[:30]},
                                              {"type": "text", "text": WRONG[30:]}]}
    with stub(message=parts) as url:
        status, err, out = run(capsys, tmp_path, f"{url}/v1", "--n", "1", "--samples", "2")
    assert status == 1 and json.loads(out)["answered"] == 2 and "none of the 2 answers passed" in err


def test_a_busy_model_list_is_retried_and_concurrency_counts_requests(capsys, tmp_path):
    """GET /models answering 503 (a server still loading its model) was "--base-url should be the
    API root" at once; --concurrency 2 with --samples 4 held 8 requests at once (found in review)."""
    seen = {}
    with stub(models_busy=2, seen=seen) as url:
        status, err, out = run(capsys, tmp_path, f"{url}/v1", "--n", "2", "--samples", "4", "--concurrency", "2",
                               "--retries", "3")
    assert status == 1 and json.loads(out)["answered"] == 8, err
    assert seen["peak"] == 2


def test_an_executor_that_could_test_nothing_is_blamed_not_the_answers(capsys, tmp_path, monkeypatch):
    """Every task's tests failed to run: the last line names the executor, not the answers, and no
    traces are written."""
    import toolrl.tasks.code.traces as traces
    from toolrl.executor.client import ExecutorError

    async def down(*args, **kw):
        raise ExecutorError("the executor went away")

    monkeypatch.setattr(traces, "arun_tests", down)
    rejected = tmp_path / "rejected.jsonl"
    with stub() as url:
        status, err, out = run(capsys, tmp_path, f"{url}/v1", "--n", "2", "--samples", "1",
                               "--rejected", str(rejected))
    stats = json.loads(out)
    assert (stats["answered"], stats["unscored_tasks"], stats["kept"]) == (2, 2, 0)
    assert status == 1 and err.splitlines()[-1] == (
        "teacher_traces: the executor could not test the answers of 2 of 2 tasks (see above) and none of the "
        f"others passed; nothing written to {tmp_path / 'traces.jsonl'}")
    assert "could not test the answers for mbpp:" in err and "the executor went away" in err
    assert not (tmp_path / "traces.jsonl").exists()
