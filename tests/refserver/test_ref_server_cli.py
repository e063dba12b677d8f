"""ref_server.py as a process: loads the reference from config, binds 127.0.0.1, serves with a token."""
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from toolrl.protocol import Sample
from toolrl.refserver.client import AsyncRefServerClient, RefServerClient
from procs import ROOT, free_port  # tests/ is on sys.path (conftest)



def listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses in LISTEN state on `port`, from /proc/net/tcp (hex, little-endian)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            found.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_entry_point_serves_reference_logprobs_on_localhost():
    port = free_port()
    cmd = [sys.executable, str(ROOT / "ref_server.py"), "--config", str(ROOT / "configs/cpu_tiny.yaml"),
           "--set", "grpo.beta=0.1", "--set", "ref_server.token=tok", "--port", str(port), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "ref_server.py did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert listening_addresses(port) == {"127.0.0.1"}
        s = Sample(prompt_ids=[1, 2, 3], completion_ids=[4, 5, 6, 7], loss_mask=[1, 1, 0, 1],
                   logprobs=[-1.0, -1.0, None, -1.0], group_id="cli")

        async def upload():
            async with AsyncRefServerClient(url, token="tok") as c:
                return await c.upload([s])

        assert asyncio.run(upload())["accepted"] == 1
        with RefServerClient(url, token="tok") as c:
            (got,) = c.get_batch(4, 1000, wait_s=30)
            stats = c.stats()
        assert len(got.ref_logprobs) == 4 and all(-30 < x < 0 for x in got.ref_logprobs)
        assert stats["reference"]["model"] == "tiny-random" and stats["reference"]["temperature"] == 1.0
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
