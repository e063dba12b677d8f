"""Delta weight updates through real worker receivers: four processes, each the gen worker's own
HTTP API, gate, assembler and relay, with a stand-in engine that reads every bucket's slot file as
vLLM's loader would and records a digest of each tensor (toolrl.worker.standin). The learner is
the real WeightSync over the real HTTP transport, with `learner.sync_delta: on` (the workers are on
loopback). Every sync is checked bit-exact against the digests of the weights pushed, which are
what a full push gives."""
import itertools

import httpx
import pytest
import torch

from standin_pool import assert_exact, loaded, running
from toolrl.config import load_config
from toolrl.net import auth_headers
from toolrl.protocol import CONTENT_TYPE
from toolrl.weightsync.fanout import make_plans
from toolrl.weightsync.outgoing import LastSent, Outgoing
from toolrl.weightsync.pusher import WeightSync
from toolrl.worker.standin import FixedRegistry

TOKEN = "delta-secret"
N = 4  # fanout 2: w0 -> w1 (-> w3), w2
LAYERS = 8
VERSIONS = itertools.count(1)


def _named(step: int = 0, layers=(), extra: bool = False) -> list[tuple[str, torch.Tensor]]:
    """8 MiB of bf16 in 1-MiB layers (a bucket each at sync_bucket_mb=1) and two small tensors;
    `layers` moved by `step` small training-like steps (most of their elements change)."""
    g = torch.Generator().manual_seed(0)
    named = [(f"model.layers.{i}.w", torch.randn(512, 1024, generator=g)) for i in range(LAYERS)]
    out = []
    for i, (n, t) in enumerate(named):
        if i in layers:
            t = t + 0.02 * step * torch.randn(t.shape, generator=torch.Generator().manual_seed(step))
        out.append((n, t.to(torch.bfloat16)))
    out += [("model.norm.weight", torch.ones(1024) + 0.001 * step), ("model.step", torch.tensor([step]))]
    return out + ([("model.extra", torch.zeros(16))] if extra else [])


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with running(tmp_path_factory.mktemp("delta"), N, TOKEN) as p:
        yield p


def _sync(workers, *sets) -> WeightSync:
    cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled", f"rollout.token={TOKEN}",
                                                "learner.sync_delta=on", "learner.sync_bucket_mb=1",
                                                "learner.sync_timeout_s=20", "learner.sync_retries=1", *sets])
    return WeightSync(cfg, FixedRegistry(workers))


def _push(s: WeightSync, named, workers) -> dict:
    version = next(VERSIONS)
    res = s.push(named, version)
    assert res["workers_ok"] == len(workers) and not res["failed"], res["failed"]
    assert_exact(workers, named, version)
    return res


def test_delta_then_full_then_delta_through_real_receivers_is_bit_exact(pool):
    workers = pool.workers[:2]
    s = _sync(workers)
    res = _push(s, _named(), workers)
    assert res["delta_bytes"] == 0 and res["egress_bytes"] > 2 * res["copy_bytes"]  # nothing to make a delta from
    for step in (1, 2):  # two layers (and the small tensors) moved, twice: each delta from the last
        res = _push(s, _named(step, layers={0, 5}), workers)
        assert 0 < res["delta_bytes"] <= res["egress_bytes"] < 0.5 * 2 * res["copy_bytes"]
    res = _push(s, _named(2, layers={0, 5}, extra=True), workers)  # another layout: full weights
    assert res["delta_bytes"] == 0 and res["egress_bytes"] > 2 * res["copy_bytes"]
    res = _push(s, _named(3, layers={3}, extra=True), workers)
    assert 0 < res["delta_bytes"] <= res["egress_bytes"] < 0.5 * 2 * res["copy_bytes"]


def test_one_layer_changed_costs_a_small_fraction_of_the_full_weights(pool):
    w = pool.workers[:1]
    s = _sync(w, "learner.sync_bucket_mb=64")  # one bucket: the delta is of a whole bucket
    _push(s, _named(1, layers={2}), w)
    before = loaded(w[0])["received_bytes"]
    res = _push(s, _named(2, layers={2}), w)  # one layer of eight moved, as far as a training step moves it
    got = loaded(w[0])["received_bytes"] - before
    assert got == res["egress_bytes"] == res["delta_bytes"] < 0.1 * res["copy_bytes"]


def test_a_worker_that_does_not_hold_the_base_refuses_the_delta_and_gets_the_full_weights(pool):
    workers = pool.workers[:2]
    s = _sync(workers, "learner.sync_retries=0")  # the full weights follow at once: no retry spent
    _push(s, _named(1, layers={1}), workers)
    pool.restart(1)  # the learner still thinks it holds the last version
    res = _push(s, _named(2, layers={1}), workers)
    assert 0 < res["delta_bytes"] < res["copy_bytes"] < res["egress_bytes"]  # w0 a delta, w1 the full weights

    # what w1 answered: refused before the body, naming what it holds; nothing started
    pool.restart(1)
    last = LastSent()
    Outgoing(_named(1), 1, 1 << 20, last).delta(0)
    last.encoder.join(10)
    header, views = Outgoing(_named(2, layers={0}), 2, 1 << 20, last).delta(0)
    r = httpx.post(f"{pool.worker(1)['url']}/update_weights", content=b"".join([header, *map(bytes, views)]),
                   headers={"Content-Type": CONTENT_TYPE, **auth_headers(TOKEN)}, timeout=20)
    assert r.status_code == 409 and r.json()["need_full"] is True and r.json()["holds"] is None
    assert "send the full update" in r.json()["detail"]
    assert httpx.get(f"{pool.worker(1)['url']}/health").json()["update_phase"] is None
    assert loaded(pool.worker(1))["loads"] == 0


def test_a_corrupted_delta_is_refused_and_recovered_by_a_full_push(pool, monkeypatch, caplog):
    workers = pool.workers[:2]
    s = _sync(workers, "learner.sync_retries=0")
    _push(s, _named(1, layers={4}), workers)
    import toolrl.weightsync.outgoing as og
    real = og.encode

    def corrupt(*args, **kw):  # wrong before it is framed: only the check after applying can see it
        body = real(*args, **kw)
        if len(body) > 1000:
            body[len(body) // 2] ^= 0x04
        return body
    monkeypatch.setattr(og, "encode", corrupt)
    res = _push(s, _named(2, layers={4}), workers)  # bit-exact: the workers loaded the full weights
    assert res["delta_bytes"] > 0 and res["egress_bytes"] > 2 * res["copy_bytes"]
    assert "does not match its checksum" in caplog.text  # the worker's 400, logged by the learner


def test_deltas_are_relayed_down_a_tree_as_received(pool):
    s = _sync(pool.workers, "learner.sync_fanout=2")
    assert make_plans(pool.workers, 2)[0].height == 2  # w0 -> w1 -> w3: a delta crosses two relays
    _push(s, _named(1, layers={6}), pool.workers)
    before = {w["id"]: loaded(w)["received_bytes"] for w in pool.workers}
    res = _push(s, _named(2, layers={6}), pool.workers)
    assert 0 < res["delta_bytes"] <= res["egress_bytes"] < 0.2 * res["copy_bytes"]  # one delta left the learner
    for w in pool.workers:  # and each worker received it as sent, not the full buckets of its parent's slots
        assert loaded(w)["received_bytes"] - before[w["id"]] == res["egress_bytes"]


def test_a_worker_in_a_delta_tree_without_the_base_gets_the_full_weights_directly(pool, caplog):
    s = _sync(pool.workers, "learner.sync_fanout=2")
    _push(s, _named(1, layers={7}), pool.workers)
    pool.restart(1)  # inside the tree, with w3 below it
    before = loaded(pool.worker(3))["received_bytes"]
    res = _push(s, _named(2, layers={7}), pool.workers)
    # w1 refused the delta; w0 relayed it to w3 instead, and the learner sent w1 the full weights
    assert "refused the delta or could not apply it" in caplog.text and "['w1']" in caplog.text
    assert loaded(pool.worker(3))["received_bytes"] - before < 0.2 * res["copy_bytes"]
    assert res["copy_bytes"] < res["egress_bytes"] < 1.3 * res["copy_bytes"]
