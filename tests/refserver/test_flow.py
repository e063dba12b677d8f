"""Flow control: queued + generating samples stay within what the learner can still use."""
import asyncio
import time

import httpx
import pytest

from procs import serve  # tests/ is on sys.path (conftest)
from test_ref_server import config, mk
from toolrl.refserver.app import create_app
from toolrl.refserver.client import AsyncRefServerClient, RefServerClient
from toolrl.refserver.flow import Grants


def test_the_bound_counts_queued_generating_and_this_versions_deliveries():
    t = [0.0]
    g = Grants(samples_per_version=4, max_staleness=1, lease_s=60, clock=lambda: t[0])  # limit 8
    a = g.take("w1", 4, queued=0, delivered_since_version=0)
    b = g.take("w2", 4, queued=0, delivered_since_version=0)
    assert a and b and g.in_flight == 8
    assert g.take("w1", 1, queued=0, delivered_since_version=0) is None  # full
    assert g.release(a) and not g.release(a) and g.in_flight == 4
    assert g.take("w1", 4, queued=3, delivered_since_version=1) is None  # 1 taken + 3 queued + 4 = 8: full
    exact = g.take("w1", 3, queued=1, delivered_since_version=0)  # 1 queued + 4 + 3 = 8: fits exactly
    assert exact is not None and g.take("w1", 1, queued=1, delivered_since_version=0) is None
    g.release(exact)
    assert g.take("w1", 3, queued=0, delivered_since_version=1) is not None
    assert g.release_worker("w2") == 1 and g.in_flight == 3
    t[0] = 61.0  # w1's lease ran out: taken back
    assert g.capacity(queued=0, delivered_since_version=0) == 8 and g.stats()["expired_total"] == 1
    # the learner took all of this version's samples: nothing more may start until the version moves,
    # even with the queue empty and nothing generating (it would be stale at max_staleness 0)
    g0 = Grants(samples_per_version=4, max_staleness=0, lease_s=60)
    assert g0.take("w", 2, queued=0, delivered_since_version=4) is None
    # 3 of 4 taken (a sample of a group was dropped as stale): the learner lacks one sample that
    # nothing will bring, so a group of 2 starts, one over the bound; refused, the learner would
    # wait out its batch deadline (as a resumed run in CI did)
    assert g0.take("w", 2, queued=0, delivered_since_version=3) is not None
    assert g0.take("w", 2, queued=0, delivered_since_version=3) is None and g0.in_flight == 2
    big = Grants(samples_per_version=2, max_staleness=0, lease_s=60)
    assert big.take("w", 5, queued=0, delivered_since_version=0) is not None  # too big for the bound: alone
    assert big.take("w", 5, queued=0, delivered_since_version=0) is None
    big.release_worker("w")
    assert big.take("w", 5, queued=0, delivered_since_version=2) is None  # the version's share is taken


def test_grants_over_http_end_with_uploads_versions_and_workers_leaving():
    cfg = config(max_staleness=1, worker_ttl_s=1.5, _extra=["learner.batch_samples=4"])  # limit 8
    with serve(create_app(cfg)) as url, RefServerClient(url) as learner:
        async def go():
            async with AsyncRefServerClient(url) as c:
                await c.register("w1", "http://127.0.0.1:1")
                ok1, g1 = await c.grant("w1", 4)
                ok2, g2 = await c.grant("w1", 4)
                assert ok1 and ok2 and g1 != g2
                assert await c.grant("w1", 4) == (False, None)  # 8 generating: no room
                await c.upload([mk(i) for i in range(4)], grant_id=g1)  # 4 queued, 4 generating
                assert (await c.grant("w1", 1))[0] is False
                t0 = time.time()
                waiting = asyncio.create_task(c.grant("w1", 4, wait_s=20))
                await asyncio.sleep(0.3)
                assert not waiting.done()
                # the learner takes its batch and moves to the next version: that version's room opens
                await asyncio.to_thread(learner.get_batch, 4, 10**6, 5)
                await asyncio.to_thread(learner.set_version, 1)
                ok, g3 = await waiting
                assert ok and time.time() - t0 < 5  # woken by the version, not by its timeout
                assert await c.give_back(g2) and not await c.give_back(g2)
                flow = (await c.stats())["flow"]
                assert flow["in_flight"] == 4 and flow["limit"] == 8
                metrics = (await asyncio.to_thread(httpx.get, f"{url}/metrics")).text  # the same numbers
                for line in ("toolrl_ref_flow_in_flight 4.0", "toolrl_ref_flow_limit 8.0",
                             "toolrl_ref_flow_granted_total 3.0", "toolrl_ref_flow_refused_total 2.0",
                             "toolrl_ref_flow_released_total 2.0"):
                    assert line in metrics.splitlines(), (line, metrics)
                # a worker that stops heartbeating loses its grants with its registration
                await asyncio.sleep(2.5)
                await c.stats()  # any request sweeps the registry
                assert (await c.stats())["flow"]["in_flight"] == 0
        asyncio.run(go())


def test_a_worker_that_restarts_under_its_id_gets_the_room_its_earlier_run_held():
    """Its groups died with the earlier process; their grants held the bound for grant_lease_s and
    every worker waited (found in review)."""
    cfg = config(max_staleness=1, _extra=["learner.batch_samples=4"])  # limit 8
    with serve(create_app(cfg)) as url:
        async def go():
            async with AsyncRefServerClient(url) as c:
                await c.register("w1", "http://127.0.0.1:1")
                assert (await c.grant("w1", 4))[0] and (await c.grant("w1", 4))[0]
                assert await c.grant("w1", 4) == (False, None)
                await c.register("w1", "http://127.0.0.1:1")  # the same id, restarted within worker_ttl_s
                assert (await c.stats())["flow"]["in_flight"] == 0
                assert (await c.grant("w1", 4))[0]
        asyncio.run(go())


class LosesFirstAnswer(httpx.AsyncHTTPTransport):
    """The request reaches the server, but its first answer to `path` is lost on the way back."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.lost = path, 0

    async def handle_async_request(self, request):
        r = await super().handle_async_request(request)
        if request.url.path == self.path and not self.lost:
            self.lost += 1
            await r.aclose()
            raise httpx.ReadTimeout("answer lost", request=request)
        return r


def test_a_grant_retried_after_its_answer_was_lost_is_the_same_grant():
    """The client retries a read timeout; the server had granted the first try, so a second grant held
    room nobody would use until its lease ran out (found in review)."""
    cfg = config(max_staleness=1, _extra=["learner.batch_samples=4"])  # limit 8
    with serve(create_app(cfg)) as url:
        async def go():
            lossy = LosesFirstAnswer("/grants")
            async with AsyncRefServerClient(url, transport=lossy) as c:
                await c.register("w1", "http://127.0.0.1:1")
                ok, gid = await c.grant("w1", 4)
                assert ok and gid and lossy.lost == 1
                flow = (await c.stats())["flow"]
                assert flow["in_flight"] == 4 and flow["granted_total"] == 1
                assert await c.give_back(gid) and (await c.stats())["flow"]["in_flight"] == 0
                # a new request (a new id) is a new grant
                assert (await c.grant("w1", 4))[1] != gid
        asyncio.run(go())


def test_flow_control_off_grants_everything():
    cfg = config(flow_control="false", _extra=["learner.batch_samples=1"])
    with serve(create_app(cfg)) as url:
        async def go():
            async with AsyncRefServerClient(url) as c:
                return [await c.grant("w", 64) for _ in range(5)]
        assert asyncio.run(go()) == [(True, None)] * 5


@pytest.mark.parametrize("flow", ["true", "false"])
def test_once_the_learner_finishes_no_group_starts_until_it_trains_again(flow):
    """The learner's finish (POST /version with finished) ends every grant, with flow control on or
    off, and heartbeat answers tell the workers; a waiting grant request is answered without room at
    once; a version announced again (a resumed learner) opens the room again."""
    cfg = config(flow_control=flow, max_staleness=1, _extra=["learner.batch_samples=4"])  # limit 8
    with serve(create_app(cfg)) as url, RefServerClient(url) as learner:
        async def go():
            async with AsyncRefServerClient(url) as c:
                reg = await c.register("w1", "http://127.0.0.1:1")
                assert reg["training_over"] is False
                ok, g1 = await c.grant("w1", 4)
                assert ok
                t0 = time.time()
                waiting = asyncio.create_task(c.grant("w1", 4, wait_s=20))
                await asyncio.sleep(0.3)
                if flow == "true":  # 4 granted of 8: the second fits at once
                    assert waiting.done()
                    waiting = asyncio.create_task(c.grant("w1", 1, wait_s=20))
                    await asyncio.sleep(0.3)
                    assert not waiting.done()  # no room left: it waits
                answer = await asyncio.to_thread(learner.finish, 0)
                assert answer["finished"] is True
                if flow == "true":
                    assert await waiting == (False, None) and time.time() - t0 < 5  # told at once
                assert await c.grant("w1", 1) == (False, None)
                assert (await c.heartbeat("w1", 0))["training_over"] is True
                assert (await c.stats())["training_over"] is True
                if g1 is not None:
                    assert await c.give_back(g1)  # room for 4 again, were training on
                assert await c.grant("w1", 1) == (False, None)
                await asyncio.to_thread(learner.set_version, 1)  # a resumed learner trains again
                assert (await c.heartbeat("w1", 0))["training_over"] is False
                got = await c.grant("w1", 1)
                assert got[0] is True and (got[1] is None) == (flow == "false")
        asyncio.run(go())


def test_stale_drops_are_counted_against_the_policy_samples_received():
    from toolrl.refserver.queue import SampleQueue

    q = SampleQueue(100, 1 << 30, max_staleness=0)
    q.put([mk(1, version=0), mk(2, version=0), mk(3, version=0, source="teacher")])
    q.set_version(1)  # the two policy samples are now stale; the teacher trace never is
    q.put([mk(4, version=1), mk(5, version=1)])
    st = q.stats()
    assert (st["policy_in"], st["dropped_stale"], st["stale_drop_fraction"]) == (4, 2, 0.5)


def test_an_upload_without_an_upload_id_still_ends_its_grant():
    """The grant was released only on the X-Upload-Id path: an upload carrying X-Grant-Id alone (both
    headers are optional) held its room for the whole lease, 600 s (found in review)."""
    from toolrl.protocol import CONTENT_TYPE, encode_samples

    cfg = config(max_staleness=1, _extra=["learner.batch_samples=4"])
    with serve(create_app(cfg)) as url, httpx.Client(base_url=url) as h:
        g = h.post("/grants", json={"worker_id": "w1", "n": 2}).json()
        r = h.post("/upload", content=encode_samples([mk(1), mk(2)]),
                   headers={"Content-Type": CONTENT_TYPE, "X-Grant-Id": g["grant_id"]})
        flow = h.get("/stats").json()["flow"]
    assert r.status_code == 200 and flow["in_flight"] == 0 and flow["released_total"] == 1, flow


def test_dynamic_sampling_and_a_restarted_learner_find_room():
    """With dynamic sampling the learner draws up to max_draws batches a step (leaving out groups
    without signal), but the room was one batch a version: once it had taken one, no grant came and
    the learner waited out its batch deadline; a learner restarted at the version the server holds
    found the room used up the same way (found in review)."""
    cfg = config(max_staleness=0, _extra=["learner.batch_samples=4", "grpo.dynamic_sampling=true",
                                          "grpo.max_draws=3"])
    with serve(create_app(cfg)) as url, httpx.Client(base_url=url) as h:
        from toolrl.protocol import CONTENT_TYPE, encode_samples

        def group(tag):
            g = h.post("/grants", json={"worker_id": "w1", "n": 2}).json()
            h.post("/upload", content=encode_samples([mk(tag), mk(tag + 1)]),
                   headers={"Content-Type": CONTENT_TYPE, "X-Grant-Id": g["grant_id"]})
        for tag in (10, 20):
            group(tag)
        assert h.get("/batch", params={"max_samples": 4, "min_samples": 4, "wait_s": 5}).status_code == 200
        r = h.post("/grants", json={"worker_id": "w1", "n": 2})  # the step draws again: room for it
        assert r.status_code == 200, r.headers
        h.delete(f"/grants/{r.json()['grant_id']}")
        for tag in (30, 40, 50, 60):
            group(tag)
        assert h.get("/batch", params={"max_samples": 8, "min_samples": 8, "wait_s": 5}).status_code == 200
        assert h.post("/grants", json={"worker_id": "w1", "n": 2}).status_code == 204  # 3 batches taken: none
        h.post("/version", json={"version": 0, "restart": True})  # a new learner at the same version
        assert h.post("/grants", json={"worker_id": "w1", "n": 2}).status_code == 200


def test_refused_total_counts_refused_requests():
    """It counted every re-check of a waiting request: one request waiting across 20 uploads added 21
    (found in review)."""
    import threading

    from toolrl.protocol import CONTENT_TYPE, encode_samples

    cfg = config(max_staleness=0, _extra=["learner.batch_samples=2"])  # room: 2
    with serve(create_app(cfg)) as url, httpx.Client(base_url=url) as h:
        assert h.post("/grants", json={"worker_id": "w1", "n": 2}).status_code == 200  # all the room
        waiting = threading.Thread(target=lambda: h.post("/grants", json={"worker_id": "w2", "n": 2, "wait_s": 2}))
        waiting.start()
        time.sleep(0.3)
        for i in range(10):  # each upload wakes the waiting request, which looks again
            h.post("/upload", content=encode_samples([mk(100 + i)]), headers={"Content-Type": CONTENT_TYPE})
        waiting.join()
        assert h.get("/stats").json()["flow"]["refused_total"] == 1
