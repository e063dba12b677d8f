"""Reference replicas (toolrl/refserver/replicas.py): other processes compute the reference logprobs
for one server. Real replicas (`ref_server.py --replica-of`) against a real server; the lease rules
through raw HTTP, as a replica that dies, lags or answers wrongly would use them."""
import asyncio
import sys
import time

import httpx
import pytest

from toolrl.models import load_hf_model
from toolrl.protocol import CONTENT_TYPE, decode_samples, encode_ref_logprobs
from toolrl.refserver import reference as reference_mod
from toolrl.refserver.app import create_app
from toolrl.refserver.client import RefServerClient
from toolrl.refserver.replicas import MAX_LEASES
from procs import Proc
from procs import serve  # tests/ is on sys.path (conftest)
from test_ref_server import _upload, config, mk, plain_logprobs

REF = ["grpo.beta=0.04", "rollout.temperature=0.7"]


def front(**ref):
    """A server that computes nothing itself: every window waits for a replica."""
    return create_app(config(local_reference="false", **ref, _extra=REF))


def no_model(cfg):
    raise AssertionError("a server with local_reference=false must not load a reference model")


def lease(h: httpx.Client, replica: str = "r", max_tokens: int = 10**6):
    r = h.post("/reference/lease", json={"replica_id": replica, "max_tokens": max_tokens, "wait_s": 5})
    assert r.status_code == 200, r.text
    samples, extra = decode_samples(r.content)
    return extra["lease"]["id"], samples


def answer(h: httpx.Client, lease_id: str, rows, **meta) -> httpx.Response:
    return h.post(f"/reference/lease/{lease_id}", content=encode_ref_logprobs(rows, **meta),
                  headers={"Content-Type": CONTENT_TYPE})


def marks(samples, k: int = 0):
    """Distinct, exactly representable logprobs per sample, to see which answer reached which sample."""
    return [[-(i + 1 + k) / 8] * len(s.completion_ids) for i, s in enumerate(samples)]


@pytest.mark.slow
def test_two_replica_processes_compute_every_window_as_the_server_would(tmp_path, monkeypatch):
    """A front with no model and two `ref_server.py --replica-of` processes: every sample comes back
    with the reference logprobs of a plain forward of the model, once, and the work is the replicas'."""
    monkeypatch.setattr(reference_mod, "load_reference_model", no_model)
    groups = [[mk(10 * g + i, p=5 + g, c=6 + 3 * i) for i in range(3)] for g in range(8)]
    with serve(front(token_budget=64)) as url:
        sets = [x for s in ["model.name=tiny-random", "model.dtype=float32", "ref_server.token_budget=64", *REF]
                for x in ("--set", s)]
        replicas = [Proc(f"replica{k}", ["ref_server.py", "--replica-of", url, "--replica-id", f"r{k}", *sets],
                         tmp_path) for k in range(2)]
        try:
            with RefServerClient(url) as c:
                deadline = time.monotonic() + 120
                while set(c.stats()["reference"]["replicas"]) != {"r0", "r1"}:  # both up and asking
                    assert time.monotonic() < deadline, [p.tail() for p in replicas]
                    time.sleep(0.2)
                asyncio.run(_upload(url, *groups))
                got = []
                while len(got) < 24:
                    batch = c.get_batch(24, 10**6, wait_s=60)
                    assert batch, [p.tail() for p in replicas]
                    got += batch
                stats = c.stats()
        finally:
            for p in replicas:
                p.stop()
    model = load_hf_model("tiny-random", dtype="float32")
    sent = {s.sample_id: s for g in groups for s in g}
    assert sorted(s.sample_id for s in got) == sorted(sent)  # every sample, once
    for s in got:
        assert s.ref_logprobs == pytest.approx(plain_logprobs(model, sent[s.sample_id], 0.7), abs=2e-4)
        assert s.text == sent[s.sample_id].text  # what the replicas were not sent is still delivered
    ref = stats["reference"]
    assert ref["local"] is False and ref["leases_out"] == 0 and set(ref["replicas"]) == {"r0", "r1"}
    assert sum(r["samples"] for r in ref["replicas"].values()) == ref["samples_total"] == 24
    assert ref["tokens_total"] == sum(s.num_tokens for s in sent.values())


def test_a_lease_that_runs_out_goes_back_and_its_late_answer_changes_nothing(monkeypatch):
    """A replica that takes a window and goes silent: after replica_lease_s the window is leased to the
    next taker, whose answer is delivered; the first replica's late answer is refused (409)."""
    monkeypatch.setattr(reference_mod, "load_reference_model", no_model)
    group = [mk(1), mk(2), mk(3)]
    with serve(front(replica_lease_s=0.5)) as url, httpx.Client(base_url=url) as h, RefServerClient(url) as c:
        asyncio.run(_upload(url, group))
        first, samples = lease(h, "silent")
        assert [s.sample_id for s in samples] == [s.sample_id for s in group]
        assert all(s.text == "" and s.tool_calls == [] for s in samples)  # tokens only on the way out
        assert c.get_batch(10, 10**6, wait_s=0.2) is None  # nothing is ready while it is out
        second, again = lease(h, "live")  # waits until the first lease runs out
        assert second != first and [s.sample_id for s in again] == [s.sample_id for s in group]
        assert answer(h, second, marks(again), compute_s=0.25).status_code == 200
        late = answer(h, first, marks(samples, k=10))
        assert late.status_code == 409 and "is not out" in late.json()["detail"]
        got = c.get_batch(10, 10**6, wait_s=5)
        stats = c.stats()
    assert [s.sample_id for s in got] == [s.sample_id for s in group]
    assert [s.ref_logprobs for s in got] == marks(group)  # the live replica's answer, not the late one
    ref = stats["reference"]
    assert (ref["leases_expired"], ref["answers_late"], ref["leases_out"]) == (1, 1, 0)
    assert ref["replicas"]["silent"]["expired"] == 1 and ref["replicas"]["live"]["samples"] == 3
    assert ref["replicas"]["live"]["compute_s"] == 0.25
    assert stats["queue"]["samples_out"] == 3 and stats["queue"]["dropped_failed"] == 0


class LosesFirstAnswer(httpx.HTTPTransport):
    """The request reaches the server, but its first answer to `path` is lost on the way back."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.lost = path, 0

    def handle_request(self, request):
        r = super().handle_request(request)
        if request.url.path == self.path and not self.lost:
            self.lost += 1
            r.close()
            raise httpx.ReadTimeout("answer lost", request=request)
        return r


def test_a_lease_retried_after_its_answer_was_lost_is_the_same_lease(monkeypatch):
    """The client retries a read timeout; a second lease sent the first one's window nowhere until
    replica_lease_s ran out, and counted a lease against each of its samples (found in review)."""
    monkeypatch.setattr(reference_mod, "load_reference_model", no_model)
    group = [mk(1), mk(2), mk(3)]
    lossy = LosesFirstAnswer("/reference/lease")
    with serve(front(replica_lease_s=60)) as url, RefServerClient(url, transport=lossy) as c:
        asyncio.run(_upload(url, group))
        lease_id, samples = c.lease_window("r", 10**6, wait_s=5)
        assert lossy.lost == 1 and [s.sample_id for s in samples] == [s.sample_id for s in group]
        assert c.stats()["reference"]["leases_out"] == 1
        assert c.answer_lease(lease_id, marks(samples), compute_s=0.1) == {"completed": 3, "failed": 0}
        got = c.get_batch(10, 10**6, wait_s=5)
    assert [s.ref_logprobs for s in got] == marks(group)


WRONG = {
    "too few samples": lambda rows: encode_ref_logprobs(rows[:1]),
    "a logprob short": lambda rows: encode_ref_logprobs([rows[0], rows[1][:-1]]),
    "above 0": lambda rows: encode_ref_logprobs([rows[0], [0.5] * 5]),
    "not finite": lambda rows: encode_ref_logprobs([rows[0], [float("nan")] * 5]),
    "not a payload": lambda rows: b"not safetensors",
}


@pytest.mark.parametrize("case", WRONG)
def test_a_wrong_answer_is_refused_and_its_window_goes_back(case, monkeypatch):
    """Answers with the wrong number of samples or of logprobs, values the upload checks refuse, or
    garbage: 400, and the window is leased again, to be answered right."""
    monkeypatch.setattr(reference_mod, "load_reference_model", no_model)
    group = [mk(1, c=4), mk(2, c=5)]
    with serve(front()) as url, httpx.Client(base_url=url) as h, RefServerClient(url) as c:
        asyncio.run(_upload(url, group))
        lid, samples = lease(h)
        r = h.post(f"/reference/lease/{lid}", content=WRONG[case](marks(samples)),
                   headers={"Content-Type": CONTENT_TYPE})
        assert r.status_code == 400 and "goes back" in r.json()["detail"], r.text
        lid2, again = lease(h)
        assert [s.sample_id for s in again] == [s.sample_id for s in group]
        assert answer(h, lid2, marks(again)).status_code == 200
        got = c.get_batch(10, 10**6, wait_s=5)
        stats = c.stats()
    assert [s.ref_logprobs for s in got] == marks(group)
    assert stats["reference"]["answers_refused"] == 1 and stats["queue"]["dropped_failed"] == 0


def test_a_window_nobody_answers_is_dropped_and_counted(monkeypatch):
    """A window leased MAX_LEASES times without an answer is dropped and counted, not circulated for
    ever (a window that kills every replica that takes it); a sample a replica reports as failed is
    dropped and counted too, and the rest of its window delivered."""
    monkeypatch.setattr(reference_mod, "load_reference_model", no_model)
    with serve(front(replica_lease_s=0.2)) as url, httpx.Client(base_url=url) as h, RefServerClient(url) as c:
        asyncio.run(_upload(url, [mk(3)]))
        for _ in range(MAX_LEASES):
            _, samples = lease(h)  # never answered: each lease runs out, and the next waits for that
            assert [s.group_id for s in samples] == ["3"]
        deadline = time.monotonic() + 10
        while c.stats()["reference"]["leases_expired"] < MAX_LEASES:  # the last lease runs out: dropped
            assert time.monotonic() < deadline
            time.sleep(0.05)
        asyncio.run(_upload(url, [mk(4), mk(5)]))
        lid, samples = lease(h)
        assert [s.group_id for s in samples] == ["4", "5"]  # group 3 is gone
        assert answer(h, lid, [None, marks(samples)[1]]).json() == {"completed": 1, "failed": 1}
        got = c.get_batch(10, 10**6, wait_s=5)
        stats = c.stats()
    assert [s.group_id for s in got] == ["5"]
    q = stats["queue"]
    assert q["dropped_failed"] == 2 and q["samples"] == 0 and q["samples_in"] == q["samples_out"] + 2
    assert stats["reference"]["leases_expired"] == MAX_LEASES and stats["reference"]["failed_total"] == 2


def test_a_replica_needs_a_reference_to_compute(tmp_path):
    """beta = 0: the server has nothing to lease (409), and a replica refuses to start."""
    import subprocess

    with serve(create_app(config())) as url, httpx.Client(base_url=url) as h:
        r = h.post("/reference/lease", json={"replica_id": "r", "max_tokens": 100})
        assert r.status_code == 409 and "beta = 0" in r.json()["detail"]
    p = subprocess.run([sys.executable, "ref_server.py", "--replica-of", "http://127.0.0.1:9", "--set",
                        "grpo.beta=0"], capture_output=True, text=True, timeout=120,
                       cwd=str(__import__("procs").ROOT))
    assert p.returncode != 0 and "needs grpo.beta > 0" in p.stderr


def test_a_replicas_compute_time_counts_only_as_seconds(monkeypatch):
    """A replica's `compute_s` was taken as any float: NaN broke /stats for good and the next batch's
    encoding (its samples lost), negative ones ran the totals backwards (found in review)."""
    monkeypatch.setattr(reference_mod, "load_reference_model", no_model)
    with serve(front()) as url, httpx.Client(base_url=url) as h, RefServerClient(url) as c:
        asyncio.run(_upload(url, [mk(1)], [mk(2)]))
        for bad in (-5.0, 1e300):
            lid, samples = lease(h, max_tokens=1)
            assert answer(h, lid, marks(samples), compute_s=bad).status_code == 200
        got = c.get_batch(10, 10**6, wait_s=5)
        stats = c.stats()
    assert len(got) == 2 and stats["reference"]["compute_s_total"] == 0.0


def test_a_replica_configured_unlike_its_server_says_so_before_loading_a_model(monkeypatch):
    """A replica at another temperature (or model) than its server sent reference logprobs no check
    could tell from right ones; a wrong token was a traceback after the model had loaded (found in
    review). Both are one line now, before the model loads."""
    from test_ref_server import config as cfg_of
    from toolrl.refserver.replicas import run_replica

    monkeypatch.setattr(reference_mod, "load_reference_model", no_model)
    with serve(front(token="s3cret")) as url:
        for sets, says in ((["ref_server.token=wrong"], "refuses us"),
                           (["ref_server.token=s3cret", "rollout.temperature=1.0"], "temperature 0.7, this replica")):
            cfg = cfg_of(_extra=["grpo.beta=0.04", *sets])
            with pytest.raises(SystemExit, match=says):
                run_replica(cfg, url)
