"""The reference server as a real HTTP service (uvicorn in a thread, the tiny model in float32)."""
import asyncio
import random
import threading
import time

import httpx
import pytest
import torch

from toolrl.config import load_config
from toolrl.models import load_hf_model
from toolrl.protocol import CONTENT_TYPE, WIRE_VERSION, Sample, decode_samples, encode_samples
from toolrl.weightsync.buckets import encode_weight_bucket
from toolrl.refserver import reference as reference_mod
from toolrl.refserver.app import create_app
from toolrl.refserver.client import AsyncRefServerClient, RefServerClient, RefServerError, RefServerUnavailable
from toolrl.refserver.queue import sample_nbytes
from procs import free_port, serve  # tests/ is on sys.path (conftest)


def config(**ref):
    overrides = ["model.name=tiny-random", "model.dtype=float32", "grpo.beta=0", "rollout.temperature=1.0"]
    overrides += [f"ref_server.{k}={v}" for k, v in ref.items() if not k.startswith("_")]
    overrides += ref.get("_extra", [])
    return load_config(None, overrides)


@pytest.fixture(scope="module")
def tiny():
    m = load_hf_model("tiny-random", dtype="float32")
    with torch.no_grad():  # random init gives near-uniform logits; sharpen so position errors would show
        m.get_output_embeddings().weight.mul_(30.0)
    return m


def mk(tag, p=3, c=4, version=0, source="policy", seed=None) -> Sample:
    g = random.Random(seed if seed is not None else tag)
    ids = [g.randrange(1, 49152) for _ in range(p + c)]
    mask = [0 if j % 4 == 3 else 1 for j in range(c)]
    return Sample(prompt_ids=ids[:p], completion_ids=ids[p:], loss_mask=mask,
                  logprobs=[-1.0 if m else None for m in mask], group_id=str(tag), policy_version=version,
                  source=source, rewards={"correct": 1.0}, reward=1.0, advantage=0.5, text=f"t{tag}")


def plain_logprobs(model, s: Sample, temperature: float) -> list[float]:
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits.float() / temperature
    lp = logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return lp[len(s.prompt_ids) - 1:].tolist()


def test_reference_logprobs_equal_a_plain_forward_with_mixed_lengths(tiny):
    cfg = config(token_budget=4096, _extra=["grpo.beta=0.04", "rollout.temperature=0.7"])
    group = [mk(1, 3, 5), mk(2, 40, 60), mk(3, 10, 1), mk(4, 100, 7), mk(5, 1, 30)]
    with serve(create_app(cfg, model=tiny)) as url, RefServerClient(url) as c:
        asyncio.run(_upload(url, group))
        got = c.get_batch(max_samples=10, max_tokens=10**6, wait_s=20)
        stats, meta = c.stats(), c.last_batch_meta
    assert [s.group_id for s in got] == ["1", "2", "3", "4", "5"]  # upload order, not the length order
    plan = reference_mod.plan_batches([s.num_tokens for s in group], 4096)
    assert stats["reference"]["batches_total"] == len(plan) < len(group)
    mixed = max(max(group[i].num_tokens for i in b) / min(group[i].num_tokens for i in b) for b in plan)
    assert mixed > 3  # some batch padded very different lengths together
    assert stats["reference"]["tokens_total"] == sum(s.num_tokens for s in group)
    for s, back in zip(group, got):
        want = plain_logprobs(tiny, s, 0.7)
        assert back.ref_logprobs == pytest.approx(want, abs=2e-4)
        assert back.model_dump(exclude={"ref_logprobs"}) == s.model_dump(exclude={"ref_logprobs"})
    spread = torch.tensor([x for s in got for x in s.ref_logprobs]).std()
    assert spread > 1.0  # the comparison is meaningful: logprobs differ a lot from token to token
    assert meta["learner_version"] == 0 and len(meta["compute_s"]) == 5 and meta["compute_s"][0] > 0


async def _upload(url, *groups, **kw):
    async with AsyncRefServerClient(url, **kw) as c:
        return [await c.upload(g) for g in groups]


def test_health_says_so_while_a_reference_forward_hangs(tiny, monkeypatch):
    """The process is up and answers, but a forward that never returns (a hung device) gives no batch:
    /health must not say ok (it did: only a stopped loop counted)."""
    release = threading.Event()
    forward = reference_mod.Reference.compute_all

    def hung(self, window):
        release.wait(60)
        return forward(self, window)

    monkeypatch.setattr(reference_mod.Reference, "compute_all", hung)
    cfg = config(forward_stall_s=0.5, _extra=["grpo.beta=0.04"])
    with serve(create_app(cfg, model=tiny)) as url, httpx.Client(base_url=url, timeout=10) as h:
        assert h.get("/health").status_code == 200
        asyncio.run(_upload(url, [mk(1), mk(2)]))
        deadline = time.time() + 20
        while (r := h.get("/health")).status_code == 200 and time.time() < deadline:
            time.sleep(0.1)
        assert r.status_code == 503 and r.json()["status"].startswith("reference forward running for"), r.text
        release.set()
        with RefServerClient(url) as c:
            assert [x.group_id for x in c.get_batch(max_samples=2, max_tokens=10**6, wait_s=20)] == ["1", "2"]
        assert h.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize("bound", ["samples", "bytes"])
def test_producer_flood_is_bounded_lossless_and_in_order(bound):
    if bound == "samples":
        cfg, make = config(max_queue_samples=8), (lambda i: mk(i))
    else:  # ~110 KB per sample: 1 MiB holds 9 of them
        cfg, make = config(max_queue_bytes=1 << 20), (lambda i: mk(i, p=20, c=1000))
    n_groups, per_group = 40, 2
    sent = [[make(g * per_group + k) for k in range(per_group)] for g in range(n_groups)]
    received, peak, errors = [], [0], []
    with serve(create_app(cfg)) as url:
        def consume():
            try:
                with RefServerClient(url) as c:
                    deadline = time.time() + 30
                    while not c.stats()["queue"]["upload_waiters"]:  # start once the producer is held back
                        assert time.time() < deadline, "the producer never filled the queue"
                        time.sleep(0.02)
                    while len(received) < n_groups * per_group:
                        got = c.get_batch(max_samples=3, max_tokens=10**6, wait_s=20)
                        assert got is not None, "producer stalled"
                        received.extend(got)
                        peak[0] = max(peak[0], c.stats()["queue"]["samples"])
                        time.sleep(0.01)  # a slow learner
            except Exception as exc:  # surfaced below, in the test's thread
                errors.append(exc)

        consumer = threading.Thread(target=consume)
        consumer.start()
        results = asyncio.run(_upload(url, *sent, upload_wait_s=0.2, max_wait_s=60))
        consumer.join(60)
        with RefServerClient(url) as c:
            q = c.stats()["queue"]
    assert not errors and not consumer.is_alive(), errors
    assert [s.group_id for s in received] == [s.group_id for g in sent for s in g]  # nothing lost, in order
    assert all(r["accepted"] == per_group for r in results)
    assert q["samples_in"] == q["samples_out"] == n_groups * per_group and q["samples"] == 0
    assert q["waited_full"] >= 1  # the flood really hit the bound and waited
    assert q["high_water_samples"] <= q["max_samples"] and q["high_water_bytes"] <= q["max_bytes"]
    if bound == "samples":
        assert q["high_water_samples"] == q["max_samples"]
    else:
        assert q["high_water_bytes"] > q["max_bytes"] - 3 * sample_nbytes(sent[0][0])
    assert peak[0] <= q["max_samples"]


def test_stale_samples_are_dropped_and_counted():
    cfg = config(max_staleness=2)
    with serve(create_app(cfg)) as url, RefServerClient(url) as c:
        c.set_version(5)
        (r,) = asyncio.run(_upload(url, [mk(1, version=2), mk(2, version=3), mk(3, source="teacher")]))
        assert (r["accepted"], r["dropped_stale"]) == (2, 1)
        asyncio.run(_upload(url, [mk(4, version=4)]))
        assert c.set_version(7)["dropped_stale"] == 2  # v3 and v4 are now older than 7 - 2
        got = c.get_batch(10, 10**6, wait_s=1)
        stats = c.stats()["queue"]
    assert [s.group_id for s in got] == ["3"]  # teacher samples are exempt from the policy-lag rule
    assert stats["dropped_stale"] == 3 and stats["samples"] == 0 and stats["learner_version"] == 7


def test_newest_first_order():
    with serve(create_app(config(order="newest"))) as url, RefServerClient(url) as c:
        asyncio.run(_upload(url, [mk(0), mk(1)], [mk(2), mk(3)], [mk(4), mk(5)]))
        time.sleep(0.2)  # let the pass-through loop move all of them to ready
        got = c.get_batch(10, 10**6, wait_s=1)
    assert [s.group_id for s in got] == ["4", "5", "2", "3", "0", "1"]


def test_workers_register_expire_and_reregister():
    async def main(url):
        async with AsyncRefServerClient(url, retries=0) as a:
            r = await a.register("w1", "http://127.0.0.1:9001", {"gpus": 0}, policy_version=1)
            assert r["ttl_s"] == 1.5 and r["learner_version"] == 0
            await a.register("w2", "http://127.0.0.1:9002", {}, 0)
            with RefServerClient(url) as c:
                assert sorted(w["id"] for w in c.workers()) == ["w1", "w2"]
                for _ in range(10):  # w1 heartbeats, w2 falls silent for 2 s > ttl
                    assert await a.heartbeat("w1", 2)
                    await asyncio.sleep(0.2)
                live = c.workers()
                assert [(w["id"], w["policy_version"]) for w in live] == [("w1", 2)]
                assert {"id", "url", "capabilities", "policy_version", "last_seen"} <= set(live[0])
                assert not await a.heartbeat("w2", 0)  # forgotten: told to re-register
                await a.register("w2", "http://127.0.0.1:9022", {}, 3)
                assert {w["id"]: w["url"] for w in c.workers()}["w2"] == "http://127.0.0.1:9022"
                assert c.stats()["workers"]["expired_total"] == 1
            with pytest.raises(RefServerError) as e:
                await a.register("bad id", "http://x", {}, 0)
            assert e.value.status == 400

    with serve(create_app(config(worker_ttl_s=1.5))) as url:
        asyncio.run(main(url))


def test_registration_waits_for_a_server_still_starting_and_gives_up_clearly():
    """launch.sh starts the workers beside the reference server, so a worker may register before it
    listens: the registration waits for it, within a bound; a wrong token fails at once."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def main():
        async with AsyncRefServerClient(url, retries=1) as a:
            t = time.monotonic()
            with pytest.raises(RefServerUnavailable, match=f"at {url} within 1s"):
                await a.register("w1", "http://127.0.0.1:9001", wait_s=1.0)
            assert 1.0 <= time.monotonic() - t < 10
            late = asyncio.create_task(a.register("w1", "http://127.0.0.1:9001", wait_s=60.0))
            await asyncio.sleep(2.0)
            assert not late.done()
            with serve(create_app(config(token="tok")), port=port):
                with pytest.raises(RefServerError) as e:  # it answers: no waiting on a wrong token
                    await late
                assert e.value.status == 401
                async with AsyncRefServerClient(url, token="tok", retries=1) as b:
                    late = asyncio.create_task(b.register("w1", "http://127.0.0.1:9001", wait_s=60.0))
                    assert (await late)["learner_version"] == 0
                with RefServerClient(url, token="tok") as c:
                    assert [w["id"] for w in c.workers()] == ["w1"]

    asyncio.run(main())


def test_resumed_learner_hands_each_worker_its_state_until_it_is_applied():
    """The learner reads the states workers heartbeat (for its checkpoint); a resumed learner hands them
    back, and each worker gets its own in heartbeat or register answers until it says it applied it
    (handed once, a retry after a lost answer got nothing: found in review)."""
    mine = {"source": "arithmetic", "level": 2, "drawn": 5, "recent_acc": [0.5, 1.0], "groups": 12}

    async def main(url):
        async with AsyncRefServerClient(url, retries=0) as a:
            assert (await a.register("w1", "http://127.0.0.1:9001", {}, 0))["resume_state"] is None
            await a.register("w2", "http://127.0.0.1:9002", {}, 0)
            with RefServerClient(url) as c:
                assert (await a.heartbeat("w1", 0, {"level": 1}))["resume_state"] is None
                assert {w["id"]: w["state"] for w in c.workers()} == {"w1": {"level": 1}, "w2": None}
                assert c.set_resume_states({"w1": mine, "w3": {"level": 3}}) == {"ok": True, "pending": 2}
                assert c.stats()["workers"]["resume_states_pending"] == 2
                assert (await a.heartbeat("w2", 0))["resume_state"] is None  # not its state
                first = await a.heartbeat("w1", 0)
                assert first["resume_state"] == mine
                assert (await a.heartbeat("w1", 0))["resume_state"] == mine  # the first answer was lost
                assert (await a.heartbeat("w1", 0, resume_applied=first["resume_id"]))["resume_state"] is None
                # A worker that registers after the learner resumed gets its state in the answer.
                reg = await a.register("w3", "http://127.0.0.1:9003", {}, 0)
                assert reg["resume_state"] == {"level": 3}
                await a.heartbeat("w3", 0, resume_applied=reg["resume_id"])
                assert c.stats()["workers"]["resume_states_pending"] == 0
                for bad in [{"bad id": {}}, {"w1": [1, 2]}, {"w1": {"blob": "x" * 20000}}]:
                    with pytest.raises(RefServerError) as e:
                        c.set_resume_states(bad)
                    assert e.value.status == 400, bad
                assert "state of w1" in e.value.detail and "over the limit" in e.value.detail
                with pytest.raises(RefServerError) as e:
                    await a.heartbeat("w1", 0, {"blob": "x" * 20000})
                assert e.value.status == 400 and "over the limit" in e.value.detail

    with serve(create_app(config())) as url:
        asyncio.run(main(url))


def test_keep_registered_reports_the_state_and_applies_a_resume_state():
    """The worker's side: its state goes out with every heartbeat, and a resume state handed back in a
    register or heartbeat answer reaches `on_resume` once; a failing `on_resume` does not stop it."""
    got, state = [], {"level": 1, "drawn": 0}

    def on_resume(s):
        got.append(s)
        if s.get("bad"):
            raise ValueError("does not fit")

    async def until(check, c):
        deadline = time.monotonic() + 10
        while not check(c.workers()[0]["state"] if c.workers() else None):
            assert time.monotonic() < deadline, (got, c.workers())
            await asyncio.sleep(0.05)

    async def main(url):
        with RefServerClient(url) as c:
            c.set_resume_states({"w1": {"level": 2, "bad": True}})  # taken by the register
            async with AsyncRefServerClient(url, retries=0) as a:
                hb = asyncio.create_task(a.keep_registered("w1", "http://127.0.0.1:9001", {}, lambda: 0, 0.05,
                                                           state=lambda: dict(state), on_resume=on_resume))
                try:
                    await until(lambda s: s == state, c)  # heartbeats (after the register) carry it
                    assert got == [{"level": 2, "bad": True}] and not hb.done()
                    c.set_resume_states({"w1": {"level": 3}})  # taken by a heartbeat
                    state["drawn"] = 4
                    await until(lambda s: s == {"level": 1, "drawn": 4} and len(got) == 2, c)
                    await asyncio.sleep(0.2)
                    assert got[1:] == [{"level": 3}] and not hb.done()  # once
                finally:
                    hb.cancel()
                    await asyncio.gather(hb, return_exceptions=True)

    with serve(create_app(config())) as url:
        asyncio.run(main(url))


def test_bad_uploads_are_rejected_and_the_server_keeps_serving(tiny):
    cfg = config(max_upload_bytes=20000, _extra=["grpo.beta=0.04"])
    good = encode_samples([mk(1), mk(2)])
    wrong_version = good.replace(f'"version":"{WIRE_VERSION}"'.encode(), b'"version":"9"')
    assert wrong_version != good
    cases = {
        "garbage": (b"\x00not safetensors at all" * 10, 400, "CorruptPayload"),
        "truncated": (good[: len(good) - 17], 400, "CorruptPayload"),
        "wrong version": (wrong_version, 400, "version"),
        "wrong schema": (encode_weight_bucket([("w", torch.zeros(2))], 1, 0, 1), 400, "schema"),
        "flipped byte": (good[:-3] + bytes([good[-3] ^ 0xFF]) + good[-2:], 400, "checksum"),
        "oversize": (encode_samples([mk(i, p=200, c=2000) for i in range(2)]), 413, "limit"),
        "out of vocab": (encode_samples([mk(1).model_copy(update={"prompt_ids": [60000]})]), 400, "vocabulary"),
        "empty": (b"", 400, "too short"),
    }
    with serve(create_app(cfg, model=tiny)) as url, httpx.Client(base_url=url) as h:
        for name, (body, status, words) in cases.items():
            r = h.post("/upload", content=body, headers={"Content-Type": CONTENT_TYPE})
            assert r.status_code == status, (name, r.text)
            assert words.lower() in r.json()["detail"].lower(), (name, r.text)
        r = h.post("/upload", json={"samples": []})
        assert r.status_code == 400 and CONTENT_TYPE in r.json()["detail"]
        r = h.post("/upload", content=good, headers={"Content-Type": CONTENT_TYPE})
        assert r.status_code == 200 and r.json()["accepted"] == 2
        stats = h.get("/stats").json()
    assert stats["http"]["uploads_rejected"] == 8 and stats["http"]["uploads_too_large"] == 1
    assert stats["queue"]["samples_in"] == 2


def test_group_that_can_never_fit_gets_413_not_503():
    with serve(create_app(config(max_queue_samples=2))) as url, httpx.Client(base_url=url) as h:
        r = h.post("/upload", content=encode_samples([mk(i) for i in range(3)]))
        assert r.status_code == 413 and "never fit" in r.json()["detail"]
        assert h.post("/upload", content=encode_samples([mk(1), mk(2)])).status_code == 200
        r = h.post("/upload", content=encode_samples([mk(3)]))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    # ... and one that could never be held once decoded is refused from its tensors: ~90 KB on the
    # wire, ~1.2 MB decoded, against a 1 MiB queue
    with serve(create_app(config(max_queue_bytes=1 << 20))) as url, httpx.Client(base_url=url) as h:
        r = h.post("/upload", content=encode_samples([mk(i, p=10, c=1000) for i in range(10)]))
        assert r.status_code == 413 and "once decoded, over the limit of 1048576" in r.json()["detail"]
        r = h.post("/upload", content=encode_samples([mk(i, p=10, c=1000) for i in range(8)]))
        assert r.status_code == 200, r.text


def test_batch_answers_204_after_the_wait_without_spinning():
    with serve(create_app(config())) as url, RefServerClient(url) as c:
        cpu0, t0 = time.process_time(), time.monotonic()
        assert c.get_batch(4, 1000, wait_s=1.0) is None
        waited, cpu = time.monotonic() - t0, time.process_time() - cpu0
        assert 0.95 <= waited < 3.0
        assert cpu < 0.3, f"{cpu:.2f}s of CPU while waiting: a busy loop?"
        # min_samples: waits for the rest, then returns what is ready when the wait ends
        asyncio.run(_upload(url, [mk(1)]))
        t0 = time.monotonic()
        got = c.get_batch(4, 1000, wait_s=0.5, min_samples=3)
        assert [s.group_id for s in got] == ["1"] and time.monotonic() - t0 >= 0.45


def test_bearer_token_required_except_health():
    cfg = config(token="s3cret")
    with serve(create_app(cfg)) as url, httpx.Client(base_url=url) as h:
        assert h.get("/health").status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json"):  # answered without the token (found in review)
            assert h.get(path).status_code in (401, 404), path
        for method, path in [("GET", "/stats"), ("GET", "/batch"), ("POST", "/upload"), ("GET", "/workers"),
                             ("GET", "/metrics"), ("POST", "/version"), ("POST", "/workers/resume")]:
            assert h.request(method, path).status_code == 401, path
            assert h.request(method, path, headers={"Authorization": "Bearer nope"}).status_code == 401, path
        with RefServerClient(url, token="s3cret") as c:
            asyncio.run(_upload(url, [mk(1)], token="s3cret"))
            assert c.get_batch(1, 100, wait_s=2)[0].group_id == "1"
        with pytest.raises(RefServerError) as e:
            asyncio.run(_upload(url, [mk(1)]))
        assert e.value.status == 401


def test_beta_zero_passes_through_and_loads_no_model(monkeypatch):
    def boom(cfg):
        raise AssertionError("beta=0 must not load a reference model")

    monkeypatch.setattr(reference_mod, "load_reference_model", boom)
    with serve(create_app(config())) as url, RefServerClient(url) as c:
        asyncio.run(_upload(url, [mk(1), mk(2)]))
        got = c.get_batch(10, 10**6, wait_s=2)
        stats = c.stats()
        metrics = httpx.get(f"{url}/metrics").text
    assert [s.ref_logprobs for s in got] == [None, None]
    assert stats["reference"]["enabled"] is False and stats["reference"]["tokens_total"] == 0
    assert "toolrl_ref_samples_out_total 2.0" in metrics and "toolrl_ref_queue_samples 0.0" in metrics


def test_retried_upload_and_batch_are_answered_once():
    with serve(create_app(config())) as url, httpx.Client(base_url=url) as h:
        body = encode_samples([mk(1)])
        hdr = {"Content-Type": CONTENT_TYPE, "X-Upload-Id": "abc"}
        assert h.post("/upload", content=body, headers=hdr).json().get("duplicate") is None
        assert h.post("/upload", content=body, headers=hdr).json()["duplicate"] is True
        q = {"max_samples": 5, "max_tokens": 1000, "wait_s": 2, "request_id": "r1"}
        first = h.get("/batch", params=q)
        again = h.get("/batch", params=q)  # the response was "lost": the retry gets the same batch
        assert first.status_code == 200 and again.content == first.content
        stats = h.get("/stats").json()["queue"]
    assert stats["samples_in"] == 1 and stats["samples_out"] == 1


def test_a_batch_that_cannot_be_sent_is_not_lost_and_client_ref_logprobs_are_dropped(monkeypatch):
    """At beta 0 an uploaded sample's own ref_logprobs were kept, so a batch mixing it with one
    without could not be encoded: a 500, the samples counted out and gone, the retry 204 (found in
    review). The server's are the only reference logprobs; and a batch that fails to encode returns
    its samples to the queue."""
    from toolrl.refserver import app as app_mod

    with serve(create_app(config())) as url, httpx.Client(base_url=url) as h:
        with_ref = mk(1).model_copy(update={"ref_logprobs": [-1.0] * 4})
        for s in (with_ref, mk(2)):
            r = h.post("/upload", content=encode_samples([s]), headers={"Content-Type": CONTENT_TYPE})
            assert r.status_code == 200
        got = RefServerClient(url).get_batch(10, 10**6, wait_s=2)
        assert [s.group_id for s in got] == ["1", "2"] and [s.ref_logprobs for s in got] == [None, None]
    real, calls = app_mod.encode_samples, []

    def flaky(samples, **kw):
        calls.append(len(samples))
        if len(calls) == 1:
            raise RuntimeError("the encoder failed once")
        return real(samples, **kw)
    monkeypatch.setattr(app_mod, "encode_samples", flaky)
    with serve(create_app(config())) as url:
        asyncio.run(_upload(url, [mk(3), mk(4)]))
        q = {"max_samples": 5, "max_tokens": 1000, "wait_s": 2, "request_id": "r1"}
        try:
            assert httpx.get(f"{url}/batch", params=q).status_code == 500
        except httpx.TransportError:  # the answer that never came: a 500, or the connection dropped
            pass
        again = httpx.get(f"{url}/batch", params=q)
        stats = httpx.get(f"{url}/stats").json()["queue"]
    assert again.status_code == 200 and len(decode_samples(again.content)[0]) == 2
    assert stats["samples_out"] == 2 and stats["samples"] == 0


def test_a_batch_retry_while_the_first_still_waits_takes_over():
    """The learner's connection dropped during a long-poll /batch; its retries with the same request
    id got 503 "still in progress" until the orphan's wait ran out, and the learner died when its
    retries ran out (found in review). The retry now takes the request over."""
    with serve(create_app(config())) as url, httpx.Client(base_url=url) as h:
        q = {"max_samples": 2, "max_tokens": 1000, "min_samples": 2, "wait_s": 30, "request_id": "r7"}
        orphan = threading.Thread(target=_silently, args=(lambda: httpx.get(f"{url}/batch", params=q, timeout=0.5),))
        orphan.start()
        time.sleep(1.0)  # its client gave up at 0.5 s; the request still waits on the server, queue empty
        got = {}
        retry = threading.Thread(target=lambda: got.update(r=h.get("/batch", params={**q, "wait_s": 10}, timeout=20)))
        t = time.time()
        retry.start()
        time.sleep(0.5)
        asyncio.run(_upload(url, [mk(5), mk(6)]))
        retry.join()
        took = time.time() - t
        orphan.join()
        again = got["r"]
        stats = h.get("/stats").json()["queue"]
    assert again.status_code == 200 and [s.group_id for s in decode_samples(again.content)[0]] == ["5", "6"]
    assert took < 5 and stats["samples_out"] == 2


def _silently(fn):
    try:
        fn()
    except httpx.HTTPError:
        pass


def test_padding_counts_this_servers_own_batches_not_a_replicas_tokens(tiny):
    """A replica's window settles through the same Reference: its tokens count in tokens_total, while
    the padding figure is of the forward batches run here (mixed, it read as 1 - all / local)."""
    from toolrl.refserver.queue import AsyncSampleQueue, SampleQueue

    ref = reference_mod.Reference(config(token_budget=64, _extra=["grpo.beta=0.04"]), model=tiny)
    local = [mk(1, p=3, c=4), mk(2, p=3, c=20)]  # one batch of 2 rows x 23 positions, 30 of them real
    ref.compute_all(local)
    assert ref.stats()["padding_fraction"] == round(1 - 30 / 46, 4)
    queue = AsyncSampleQueue(SampleQueue(100, 1 << 30))
    remote = [mk(3, p=10, c=200)]
    queue.core.put(remote)
    window = queue.core.take_pending(10**6)
    ref.settle(queue, window, [[-1.0] * 200], compute_s=0.5)  # as a replica's answer is settled
    stats = ref.stats()
    assert stats["tokens_total"] == 210 and stats["padding_fraction"] == round(1 - 30 / 46, 4)


def test_uploads_decoding_at_once_hold_at_most_the_queue_bound(monkeypatch):
    """Each decode slot could hold a group up to the queue's bound in Python lists (~12x its wire
    size): four at once, four times the bound. What the decodes in progress will hold is now counted
    from the headers, against the bound: one over it waits its turn (503 + Retry-After)."""
    import threading

    from toolrl.refserver import app as app_mod

    first_in, go_on = threading.Event(), threading.Event()
    real = app_mod.decode_samples

    def held_open(body, *args, **kw):  # the first decode stays in progress until told
        if not first_in.is_set():
            first_in.set()
            assert go_on.wait(30)
        return real(body, *args, **kw)

    monkeypatch.setattr(app_mod, "decode_samples", held_open)
    monkeypatch.setattr(app_mod, "INLINE_CODEC_BYTES", 0)  # every decode off the loop, as large ones are
    big = [mk(i, p=10, c=1000) for i in range(8)]  # ~963 KB once decoded, of a 1 MiB bound
    with serve(create_app(config(max_queue_bytes=1 << 20))) as url, httpx.Client(base_url=url) as h:
        answers = []
        first = threading.Thread(target=lambda: answers.append(h.post("/upload", content=encode_samples(big))))
        first.start()
        assert first_in.wait(30)
        r = h.post("/upload", content=encode_samples([mk(9, p=10, c=1000)]))  # ~120 KB more: over the bound
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "uploads being decoded" in r.json()["detail"]
        small = h.post("/upload", content=encode_samples([mk(10)]))  # ~1 KB: fits beside it
        go_on.set()
        first.join(30)
        assert small.status_code == 200 and answers[0].status_code == 200, (small.text, answers[0].text)
        assert h.get("/stats").json()["http"]["uploads_busy"] == 1
        with RefServerClient(url) as c:  # the queue emptied, the bound is whole again: as large a group fits
            assert len(c.get_batch(100, 10**7, wait_s=5)) == 9
        assert h.post("/upload", content=encode_samples(big)).status_code == 200
