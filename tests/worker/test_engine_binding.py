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
