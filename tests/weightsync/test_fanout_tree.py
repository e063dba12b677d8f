"""Weight updates down a fan-out tree of real worker receivers: seven processes, each the gen
worker's own HTTP API, gate, assembler and relay, with a stand-in engine that reads every bucket's
slot file as vLLM's loader would and records a digest of each tensor (toolrl.worker.standin).
The learner is the real WeightSync over the real HTTP transport. Workers are killed (SIGKILL) and
silenced (SIGSTOP) mid-update; relays are corrupted and sent out of order."""
import asyncio
import itertools
import json
import threading
import time

import httpx
import pytest
import torch

from standin_pool import BUCKET_WAIT_S, assert_exact, loaded, running
from toolrl.config import load_config
from toolrl.net import auth_headers
from toolrl.protocol import CONTENT_TYPE, incarnation
from toolrl.weightsync.buckets import bucketize, encode_weight_bucket
from toolrl.weightsync.fanout import PLAN_HEADER, FanoutPlan, PlanNode, make_plans, plan_for
from toolrl.weightsync.gate import WeightGate
from toolrl.weightsync.pusher import WeightSync
from toolrl.weightsync.receiver import WeightAssembler, bucket_file
from toolrl.weightsync.relay import Relay
from toolrl.worker.standin import FixedRegistry
from toolrl.weightsync.vllm_ext import iter_bucket_files

TOKEN = "fanout-secret"
N = 7  # fanout 2: w0 -> w1 (-> w3, w4), w2 (-> w5, w6)
VERSIONS = itertools.count(1)


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    """8 MiB in 1-MiB tensors (one bucket each at sync_bucket_mb=1), and two small ones of other dtypes."""
    g = torch.Generator().manual_seed(seed)
    big = [(f"model.layers.{i}.w", torch.randn(512, 1024, generator=g).to(torch.bfloat16)) for i in range(8)]
    return big + [("model.norm.weight", torch.randn(1024, generator=g)), ("model.step", torch.arange(5) + seed)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with running(tmp_path_factory.mktemp("fanout"), N, TOKEN) as p:
        yield p


@pytest.fixture(autouse=True)
def healed(pool):
    yield
    pool.heal()


def _sync(workers, *sets) -> WeightSync:
    cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled", f"rollout.token={TOKEN}",
                                                "learner.sync_fanout=2", "learner.sync_bucket_mb=1",
                                                "learner.sync_timeout_s=20", "learner.sync_retries=1", *sets])
    return WeightSync(cfg, FixedRegistry(workers))


def _one_copy(pool, version) -> int:
    """What one direct push of the test weights at `version` sends (the learner's count of it)."""
    s = _sync([pool.worker(0)], "learner.sync_fanout=0")
    return s.push(_named(version), version)["egress_bytes"]


def _when_loading(w: dict, after_s: float, then) -> threading.Thread:
    """Run `then` `after_s` after `w` starts loading an update (its first bucket is in)."""
    def watch():
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"{w['url']}/health", timeout=2).json()["update_phase"] == "loading":
                    time.sleep(after_s)
                    then()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    th = threading.Thread(target=watch, daemon=True)
    th.start()
    return th


def test_a_tree_gets_bit_exact_weights_to_every_worker_and_the_learner_sends_one_copy(pool):
    version = next(VERSIONS)
    copy = _one_copy(pool, version)
    s = _sync(pool.workers)
    named = _named(version)
    res = s.push(named, version)
    assert res["workers_ok"] == N and not res["failed"]
    assert res["egress_bytes"] == copy  # each byte left the learner once; the workers relayed the rest
    assert_exact(pool.workers, named, version)
    assert all(s.pushed[incarnation(w)] == version for w in pool.workers)


def test_fanout_zero_pushes_every_worker_directly_as_before(pool):
    version = next(VERSIONS)
    copy = _one_copy(pool, version)
    s = _sync(pool.workers, "learner.sync_fanout=0")
    named = _named(version)
    res = s.push(named, version)
    assert res["workers_ok"] == N and res["egress_bytes"] == N * copy
    assert_exact(pool.workers, named, version)


def test_a_worker_killed_mid_update_is_reported_failed_and_its_subtree_still_gets_the_weights(pool):
    # 4 MiB/s per sender: w1 gets the update at 2 MiB/s (w0 feeds two children), 4 s for 8 MiB
    s = _sync(pool.workers, "learner.sync_max_mb_s=4")
    version = next(VERSIONS)
    named = _named(version)
    killer = _when_loading(pool.worker(1), 1.0, lambda: pool.kill(1))
    res = s.push(named, version)
    killer.join(30)
    assert pool.procs[1].p.poll() is not None, "w1 was not killed mid-update"
    assert sorted(res["failed"]) == ["w1"] and res["workers_ok"] == N - 1
    assert "w1: bucket" in res["failed"]["w1"]  # its parent's error: which bucket, and why
    assert res["egress_bytes"] < 1.1 * 8 * 2**20  # the learner sent no second copy
    assert_exact([w for w in pool.workers if w["id"] != "w1"], named, version)  # w3, w4 from w0 instead
    assert s.failures.keys() == {"w1"}
    pool.heal()  # w1 comes back, at version 0; the learner catches it up by a direct push
    assert s.catch_up(lambda: named, version) == 1 and not s.failures
    assert_exact(pool.workers, named, version)


def test_a_silent_worker_is_given_up_after_the_hop_timeout_and_routed_around(pool):
    s = _sync(pool.workers, "learner.sync_max_mb_s=4", "learner.sync_timeout_s=3")
    version = next(VERSIONS)
    named = _named(version)
    pauser = _when_loading(pool.worker(2), 1.0, lambda: pool.pause(2))
    t0 = time.time()
    res = s.push(named, version)
    pauser.join(30)
    assert 2 in pool.stopped, "w2 was not stopped mid-update"
    assert sorted(res["failed"]) == ["w2"] and time.time() - t0 < 25
    assert_exact([w for w in pool.workers if w["id"] != "w2"], named, version)  # w5, w6 from w0 instead
    pool.heal()  # w2 wakes up; its relay's late buckets are refused (another sender), and it is caught up
    assert s.catch_up(lambda: named, version) == 1
    version = next(VERSIONS)
    named = _named(version)
    assert s.push(named, version)["workers_ok"] == N
    assert_exact(pool.workers, named, version)


def test_a_root_killed_mid_update_is_planned_around_and_the_others_get_the_weights(pool):
    s = _sync(pool.workers, "learner.sync_max_mb_s=4")
    version = next(VERSIONS)
    named = _named(version)
    killer = _when_loading(pool.worker(0), 1.0, lambda: pool.kill(0))
    res = s.push(named, version)
    killer.join(30)
    assert pool.procs[0].p.poll() is not None
    assert sorted(res["failed"]) == ["w0"] and res["workers_ok"] == N - 1
    assert res["egress_bytes"] > 8 * 2**20  # the root's share went out again, to the new root
    assert_exact(pool.workers[1:], named, version)


def _post(w, body: bytes, plan: str | None) -> httpx.Response:
    headers = {"Content-Type": CONTENT_TYPE, **auth_headers(TOKEN), **({PLAN_HEADER: plan} if plan else {})}
    return httpx.post(f"{w['url']}/update_weights", content=body, headers=headers, timeout=20)


def _bodies(named, version):
    buckets = bucketize(named, 1 << 20)
    return [encode_weight_bucket(b, version, i, len(buckets)) for i, b in enumerate(buckets)]


def test_a_bad_plan_is_refused_before_anything_is_received(pool):
    w = pool.worker(3)
    before = loaded(w)
    version = next(VERSIONS)
    body = _bodies(_named(version), version)[0]
    good = json.loads(plan_for(PlanNode(id="w3", url=w["url"]), 10, None).header())
    for plan, needle in [("{oops", "Invalid JSON"), (json.dumps({**good, "children": [{"id": "x"}]}), "url"),
                         (json.dumps({**good, "children": [{"id": "w", "url": "http://h:1"}] * 2}), "twice"),
                         ('{"tag": "' + "x" * 13000 + '"}', "over the limit of")]:
        r = _post(w, body, plan)
        assert r.status_code == 400 and needle in r.json()["detail"], (needle, r.status_code, r.text)
    assert _post(w, body, "x" * 20000).status_code in (400, 431)  # a head over 16 KiB: uvicorn refuses it
    after = loaded(w)
    assert after["version"] == before["version"] and after["loads"] == before["loads"]
    assert httpx.get(f"{w['url']}/health").json()["update_phase"] is None  # nothing was started


def test_a_relay_out_of_order_or_from_another_sender_is_refused_at_the_child(pool):
    w = pool.worker(4)
    version = next(VERSIONS)
    bodies = _bodies(_named(version), version)
    plan = plan_for(PlanNode(id="w4", url=w["url"]), 10, None).header()
    assert _post(w, bodies[0], plan).status_code == 200
    r = _post(w, bodies[2], plan)
    assert r.status_code == 409 and "expected bucket 1/" in r.json()["detail"]
    other = plan_for(PlanNode(id="w4", url=w["url"]), 10, None).header()  # a fresh tag: another sender
    r = _post(w, bodies[1], other)
    assert r.status_code == 409 and "another sender" in r.json()["detail"]
    for body in bodies[1:]:
        assert _post(w, body, plan).status_code == 200
    assert_exact([w], _named(version), version)


def _received(tmp_path, named, version, tag="upstream"):
    """An update received here, in-process, as a relaying worker would hold it in its slot files."""
    a = WeightAssembler(tmp_path / "slots")

    async def chunks(body):
        yield body

    async def run():
        for body in _bodies(named, version):
            _, u = await a.receive(chunks(body), 0, tag=tag)
        return u
    return a, asyncio.run(run())


def test_a_corrupt_relay_is_refused_at_every_child(pool, tmp_path):
    version = next(VERSIONS)
    named = _named(version)
    a, update = _received(tmp_path, named, version)
    slot = update.dir / bucket_file(3)
    raw = bytearray(slot.read_bytes())
    raw[-100] ^= 0x01  # one bit of one weight, after this worker checked it
    slot.write_bytes(raw)
    kids = [PlanNode(id=f"w{i}", url=pool.worker(i)["url"]) for i in (5, 6)]
    before = [loaded(pool.worker(i)) for i in (5, 6)]

    async def relay():
        r = Relay(update, FanoutPlan(tag="x" * 16, timeout_s=10, children=kids), TOKEN, "test")
        for i in range(update.count):
            r.bucket_whole(i)
        return await r.report()
    out = asyncio.run(relay())
    for i, b in zip((5, 6), before):
        assert "HTTP 400" in out[f"w{i}"]["error"] and "checksum" in out[f"w{i}"]["error"]
        assert loaded(pool.worker(i))["version"] == b["version"]  # the child kept its weights
    a.close()


class FailingEngine:
    """Reads the whole update, then dies (a failure before the last bucket aborts the update instead)."""

    async def load_buckets(self, weights_dir, update_id, count, timeout_s):
        await asyncio.to_thread(lambda: list(iter_bucket_files(weights_dir, update_id, count, timeout_s)))
        raise RuntimeError("the engine died")

    async def abort(self, ids):
        pass

    async def abort_all(self):
        return 0


def test_a_worker_whose_own_load_fails_still_reports_its_subtree(pool, tmp_path):
    """Its slots are whole and verified, so its children got the update: their outcomes go up with
    its error, and its parent does not serve them again."""
    version = next(VERSIONS)
    named = _named(version)
    kids = make_plans([pool.worker(i) for i in (5, 6)], 1)[0]  # w5 -> w6
    gate = WeightGate(FailingEngine(), WeightAssembler(tmp_path / "slots"), 5, 10, name="mid", token=TOKEN)
    plan = FanoutPlan(tag="y" * 16, timeout_s=10, children=[kids])

    async def run():
        async def chunks(body):
            yield body
        for body in _bodies(named, version):
            answer = await gate.receive_bucket(chunks(body), plan)
        return await answer  # the last bucket's: a future, heartbeated while the subtree finishes
    answer = asyncio.run(run())
    assert not answer["loaded"] and "the engine died" in answer["error"]
    assert {k: v["loaded"] for k, v in answer["tree"].items()} == {"w5": True, "w6": True}
    assert_exact([pool.worker(5), pool.worker(6)], named, version)
    gate.assembler.close()


def test_a_sender_that_stalls_mid_bucket_is_answered_408_and_the_update_dropped(pool):
    """A learner whose host vanished (no FIN) held the request, its update and its buffer for good:
    each gap in a bucket's body is bounded by the sync timeout (found in review)."""
    import socket
    w = pool.worker(4)
    version = next(VERSIONS)
    body = _bodies(_named(version), version)[0]
    host, port = w["url"].removeprefix("http://").split(":")
    head = (f"POST /update_weights HTTP/1.1\r\nHost: {host}\r\nContent-Type: {CONTENT_TYPE}\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head + body[:len(body) // 2])  # then nothing, the connection left open
        t0 = time.monotonic()
        s.settimeout(3 * BUCKET_WAIT_S)
        answer = b""
        while b"no body bytes for" not in answer and (chunk := s.recv(4096)):  # head and body may come apart
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"no body bytes for" in answer, answer[:200]
    assert time.monotonic() - t0 < 2 * BUCKET_WAIT_S
    deadline = time.monotonic() + 20
    while httpx.get(f"{w['url']}/health", timeout=5).json()["update_phase"] is not None:
        assert time.monotonic() < deadline, "the stalled update was never dropped"
        time.sleep(0.2)
    assert loaded(w)["version"] < version
