"""The engine's core binding with the model worker in the engine-core process ("uni", the CPU
default): an explicit `rollout.cpu_threads_bind` pins that process as vLLM pins its own worker."""
import json
import os
import subprocess
import sys

import pytest

from procs import ROOT  # tests/ is on sys.path (conftest)

SCRIPT = """
import asyncio, json, os, sys
from pathlib import Path
from toolrl.config import load_config
from toolrl.models import resolve_model
from toolrl.worker.engine import VllmEngine

def main():
    cfg = load_config("configs/cpu_tiny.yaml", ["rollout.cpu_threads_bind=" + sys.argv[1]])
    engine = VllmEngine(cfg, resolve_model(cfg.model.name))
    try:
        pids = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()
                and (p / "comm").read_text().startswith("VLLM::EngineCor")
                and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
        env = dict(x.split("=", 1) for x in Path(f"/proc/{pids[0]}/environ").read_text().split("\\0") if "=" in x)
        out = asyncio.run(engine.generate([1, 2, 3], 4, "r"))
        print(json.dumps({"engines": len(pids), "cores": sorted(os.sched_getaffinity(int(pids[0]))),
                          "threads": env.get("OMP_NUM_THREADS"), "tokens": len(out.token_ids)}))
    finally:
        engine.shutdown()

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to the second")
def test_an_explicit_core_list_pins_the_engine_core_process(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(SCRIPT)
    core = sorted(os.sched_getaffinity(0))[1]
    p = subprocess.run([sys.executable, str(script), str(core)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads([x for x in p.stdout.splitlines() if x.startswith('{"engines"')][-1])  # past vLLM's logs
    assert got == {"engines": 1, "cores": [core], "threads": "1", "tokens": 4}, got


THREADS_SCRIPT = """
import asyncio, json, os, sys
from pathlib import Path
from toolrl.config import load_config
from toolrl.models import resolve_model
from toolrl.worker.engine import VllmEngine

def thread_ticks(pid):
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            f = (t / "stat").read_text().rsplit(")", 1)[1].split()
            out[t.name] = int(f[11]) + int(f[12])  # utime + stime
        except OSError:  # a thread that ended
            pass
    return out

async def busy_threads(engine, pid, tag):
    before = thread_ticks(pid)
    await asyncio.gather(*[engine.generate(list(range(1, 200)), 64, f"{tag}{i}", stop_at_marker=False)
                           for i in range(16)])
    ticks = sorted((t - before.get(k, 0) for k, t in thread_ticks(pid).items()), reverse=True)
    return sum(t > ticks[0] / 3 for t in ticks)  # threads that ran for a third of the busiest one's time

def main():
    cfg = load_config("configs/cpu_tiny.yaml", ["rollout.cpu_threads_bind=all"])
    engine = VllmEngine(cfg, resolve_model(cfg.model.name))
    try:
        pid = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()
               and (p / "comm").read_text().startswith("VLLM::EngineCor")
               and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid())][0]
        async def go():
            out = [await busy_threads(engine, pid, "start")]
            for n in (1, None, 5, 1):
                out.append([await engine.set_threads(n), await busy_threads(engine, pid, f"n{n}")])
            return out
        runs = asyncio.run(go())
        cores = set().union(*(os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()))
        print(json.dumps({"cores": len(cores), "runs": runs}))  # each OpenMP thread is pinned to its core
    finally:
        engine.shutdown()

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="written for a 2-core machine")
def test_the_engine_changes_its_threads_while_it_runs(tmp_path):
    """rollout.cpu_threads_bind=all binds one thread per core; set_threads then moves the model between
    one thread (training rollouts beside the learner) and all of them (evaluations) without a restart,
    never above the bound cores. Checked by which of the engine process's threads burn CPU."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads([x for x in p.stdout.splitlines() if x.startswith('{"cores"')][-1])
    assert got == {"cores": 2, "runs": [2, [1, 1], [2, 2], [2, 2], [1, 1]]}, got
