"""The reference server under hostile or broken clients, for real (uvicorn in a thread, raw sockets
where a client misbehaves below HTTP): stalled bodies, memory the bound must see, nested JSON,
samples that would crash the learner, and a worker id taken over by another URL."""
import asyncio
import json
import math
import struct
import time
from collections import Counter

import httpx
import pytest

from procs import serve  # tests/ is on sys.path (conftest)
from test_ref_server import _upload, config, mk  # tests/refserver/ is on sys.path (pytest prepends it)
from toolrl.protocol import CONTENT_TYPE, SCHEMA_SAMPLES, WIRE_VERSION, ToolCall, encode_samples, hasher
from toolrl.refserver.app import create_app
from toolrl.refserver.client import (AsyncRefServerClient, RefServerClient, RefServerError, RefServerUnavailable,
                                     _outcome)


def _head(port: int, length: int) -> bytes:
    return (f"POST /upload HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {CONTENT_TYPE}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


async def _stall(port: int, length: int, send: int):
    """A client that sends the headers and `send` bytes of a `length`-byte body, then nothing."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(_head(port, length) + b"\0" * send)
    await w.drain()
    return r, w


RESET = b"connection reset"


async def _trickle(port: int) -> bytes:
    """A client that sends a byte every 0.2 s, forever: never idle, never done. Returns the answer, or
    RESET where the connection was reset: the server closes with the client's last bytes unread, and
    TCP then resets rather than closes (RFC 7230 6.6), which can discard the answer before it is read
    (seen once in the full suite under load)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(_head(port, 1 << 20))

    async def drip():
        try:
            while True:
                w.write(b"\0")
                await w.drain()
                await asyncio.sleep(0.2)
        except (ConnectionError, RuntimeError):
            pass

    dripping = asyncio.create_task(drip())
    try:
        return await r.read()
    except ConnectionResetError:
        return RESET
    finally:
        dripping.cancel()
        w.close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_stalled_uploads_neither_block_others_nor_hold_on():
    """Six clients that send headers and 100 bytes and stop, and one that trickles, must not keep a
    real upload waiting (the decode slots are not held while a body arrives), and each gets 408 and a
    closed connection at the body deadline, not before and not never."""
    deadline = 3.0
    with serve(create_app(config(body_timeout_s=deadline))) as url:
        async def main():
            t_sent = time.monotonic()
            stalled = [await _stall(_port(url), 1_000_000, 100) for _ in range(6)]
            trickler = asyncio.create_task(_trickle(_port(url)))
            await asyncio.sleep(0.3)  # all of them are inside /upload now, reading
            async with AsyncRefServerClient(url, retries=0, max_wait_s=5) as c:
                # well before the stalled ones' deadline (before the fix: not until they went away)
                answer = await asyncio.wait_for(c.upload([mk(1)]), deadline / 2)
            assert answer["accepted"] == 1
            # read() returns at EOF: the server must close these connections, not only answer them
            replies = await asyncio.gather(*[asyncio.wait_for(r.read(), deadline + 5) for r, _ in stalled],
                                           asyncio.wait_for(trickler, deadline + 5))
            waited = time.monotonic() - t_sent
            for _, w in stalled:
                w.close()
            return replies, waited

        replies, waited = asyncio.run(main())
        stats = httpx.get(f"{url}/stats").json()
    *stalled_replies, trickled = replies
    for reply in stalled_replies + ([] if trickled == RESET else [trickled]):
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"not complete within 3s" in reply
    assert deadline - 0.5 <= waited < deadline + 3
    assert stats["http"]["uploads_timed_out"] == 7 and stats["http"]["body_bytes_held"] == 0
    assert stats["queue"]["samples_in"] == 1


def test_bytes_of_unfinished_bodies_are_bounded():
    """Reading outside the decode slots must not make bodies unbounded: bytes held by bodies still
    arriving count against 4 x max_upload_bytes; past it an upload gets 503 (retry), and the bytes come
    back when the stalled bodies hit their deadline."""
    cfg = config(body_timeout_s=2, max_upload_bytes=20000)
    body = encode_samples([mk(1)])
    with serve(create_app(cfg)) as url, httpx.Client(base_url=url) as h:
        async def stall_and_upload():
            stalled = [await _stall(_port(url), 20000, 19900) for _ in range(4)]
            await asyncio.sleep(0.3)
            held = h.get("/stats").json()["http"]["body_bytes_held"]
            refused = h.post("/upload", content=body, headers={"Content-Type": CONTENT_TYPE})
            replies = await asyncio.gather(*[asyncio.wait_for(r.read(), 8) for r, _ in stalled])
            for _, w in stalled:
                w.close()
            return held, refused, replies

        held, refused, replies = asyncio.run(stall_and_upload())
        assert held == 4 * 19900 and 80000 - held < len(body)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "upload bodies held" in refused.json()["detail"]
        assert all(r.startswith(b"HTTP/1.1 408") for r in replies)
        assert h.post("/upload", content=body, headers={"Content-Type": CONTENT_TYPE}).status_code == 200
        stats = h.get("/stats").json()
    assert stats["http"]["uploads_busy"] == 1 and stats["http"]["body_bytes_held"] == 0
    assert stats["queue"]["samples_in"] == 1


def test_strings_count_against_the_byte_bound():
    """A sample's strings are held, at their stored size (4 bytes a character for emoji), so they count:
    a 1 MiB queue takes one sample carrying 600 KB of text, not two."""
    with serve(create_app(config(max_queue_bytes=1 << 20))) as url, httpx.Client(base_url=url) as h:
        big = [mk(1).model_copy(update={"text": "\U0001F600" * 150_000})]
        assert h.post("/upload", content=encode_samples(big)).status_code == 200
        assert h.get("/stats").json()["queue"]["bytes"] > 600_000
        r = h.post("/upload", content=encode_samples(big))
        assert r.status_code == 503 and "queue full" in r.json()["detail"]


def _payload(header: bytes) -> bytes:
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def _payload_with_meta(meta_json: str) -> bytes:
    """A well-framed samples payload (no tensors, a valid checksum) whose meta JSON is `meta_json`."""
    md = {"schema": SCHEMA_SAMPLES, "version": str(WIRE_VERSION), "meta": meta_json,
          "xxh3_64": hasher(meta_json, {}).hexdigest()}
    return _payload(json.dumps({"__metadata__": md}).encode())


def test_deeply_nested_json_is_refused_not_crashed():
    deep = "[" * 100_000
    uploads = {
        "safetensors header": _payload(b'{"__metadata__":' + deep.encode() + b"}"),
        "another header entry": _payload(b'{"x":' + deep.encode() + b"}"),
        "meta": _payload_with_meta('{"samples":' + deep + "]" * 100_000 + "}"),
        # deep but parseable: the sample schema refuses it
        "a sample field": _payload_with_meta('{"samples":[{"group_id":"g","rewards":' + "[" * 500 + "]" * 500 + "}]}"),
    }
    with serve(create_app(config())) as url, httpx.Client(base_url=url, timeout=30) as h:
        for name, body in uploads.items():
            r = h.post("/upload", content=body, headers={"Content-Type": CONTENT_TYPE})
            assert r.status_code == 400, (name, r.status_code, r.text[:300])
            assert "CorruptPayload" in r.json()["detail"], (name, r.text[:300])
        assert h.post("/workers", json={"id": "w1", "url": "http://127.0.0.1:1"}).status_code == 200
        for path in ["/workers", "/workers/w1/heartbeat", "/version", "/workers/resume"]:
            r = h.post(path, content=deep, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])
        # parseable, but deeper than anything the server keeps (and hands on to the learner's checkpoint)
        nested = json.loads('{"a":' * 40 + "1" + "}" * 40)
        for path, body in [("/workers", {"id": "w2", "url": "http://127.0.0.1:2", "capabilities": nested}),
                           ("/workers/w1/heartbeat", {"state": nested}),
                           ("/workers/resume", {"states": {"w1": nested}})]:
            r = h.post(path, json=body)
            assert r.status_code == 400 and "nested deeper" in r.json()["detail"], (path, r.text[:300])
        assert h.get("/health").status_code == 200 and h.get("/workers").status_code == 200
        stats = h.get("/stats").json()
    assert stats["http"]["uploads_rejected"] == len(uploads) and stats["queue"]["samples_in"] == 0


def _bad(**update):
    return mk(1).model_copy(update=update)  # mk: 3 prompt + 4 completion tokens, loss_mask [1, 1, 1, 0]


BAD_SAMPLES = [
    ("token_ids", _bad(completion_ids=[5, 6, 49152, 7])),  # tiny-random's vocabulary is 49152
    ("token_ids", _bad(prompt_ids=[-1, 5, 6])),
    ("length", _bad(prompt_ids=[7] * 4097)),  # 4096 positions
    ("advantage", _bad(advantage=1e30)),
    ("reward", _bad(reward=-1e7)),
    ("rewards", _bad(rewards={"correct": 1e7})),
    ("logprobs", _bad(logprobs=[-1e30, -1.0, -1.0, None])),
    ("logprobs", _bad(logprobs=[-1.0, 0.5, -1.0, None])),
    ("policy_version", _bad(policy_version=10**18)),
    ("group_id", _bad(group_id="g" * (1 << 20))),
    ("rewards", _bad(rewards={"r" * 65: 1.0})),
    ("rewards", _bad(rewards={f"r{i}": 0.0 for i in range(65)})),
    ("tool_calls", _bad(tool_calls=[ToolCall(code="", status="s" * 33, output="")])),
    ("tool_calls", _bad(tool_calls=[ToolCall(code="c" * ((1 << 20) + 1), status="ok", output="")])),
    ("text", _bad(text="x" * ((4 << 20) + 1))),
    ("sample_id", _bad(sample_id="first")),  # the upload's sample 0 is "first": one rollout sent twice
]


def test_samples_that_would_derail_the_learner_are_refused_without_a_reference_model():
    """beta = 0 (no reference model): every class of bad sample is still refused with 400 naming the
    sample and the field, counted, and nothing of its group is queued."""
    async def main(url):
        async with AsyncRefServerClient(url, retries=0, max_wait_s=5) as c:
            for field, bad in BAD_SAMPLES:
                with pytest.raises(RefServerError) as e:
                    await c.upload([mk(0).model_copy(update={"sample_id": "first"}), bad])
                assert e.value.status == 400 and f"sample 1: {field}" in e.value.detail, (field, e.value.detail)
            ok = mk(0).model_copy(update={"ref_logprobs": [-1.0] * 4})
            for ref in ([math.nan] * 4, [-1.0, -1.0, math.inf, -1.0], [1.0] * 4):
                with pytest.raises(RefServerError) as e:
                    await c.upload([ok, _bad(ref_logprobs=ref)])
                assert e.value.status == 400 and "sample 1: ref_logprobs" in e.value.detail
            return await c.upload([mk(2, version=3)])

    with serve(create_app(config())) as url, RefServerClient(url) as c:
        c.set_version(3)
        before = c.stats()
        answer = asyncio.run(main(url))
        got = c.get_batch(10, 10**6, wait_s=2)
        stats = c.stats()
    assert before["reference"]["enabled"] is False
    assert answer["accepted"] == 1 and [s.group_id for s in got] == ["2"]  # only the good upload came through
    assert stats["queue"]["samples_in"] == 1
    assert stats["http"]["uploads_rejected"] == len(BAD_SAMPLES) + 3
    assert stats["http"]["rejected_by_field"] == dict(Counter(f for f, _ in BAD_SAMPLES) + Counter(ref_logprobs=3))


def test_a_sample_from_a_policy_the_learner_has_not_announced_waits_or_is_refused():
    """A sample may not claim a newer policy than the learner's (it would never go stale). One or two
    versions ahead is a push in progress: 503, retry. Further ahead is refused. A server that has not
    heard the learner's version since it started answers 503 until it does; the learner's client repeats
    its version in every batch request, so a restarted server learns it without a push."""
    with serve(create_app(config())) as url, httpx.Client(base_url=url) as h:
        def up(version):
            return h.post("/upload", content=encode_samples([mk(version, version=version)]),
                          headers={"Content-Type": CONTENT_TYPE})

        assert up(0).status_code == 200
        r = up(7)
        assert r.status_code == 503 and "not announced yet" in r.json()["detail"] and r.headers["retry-after"]
        with RefServerClient(url) as c:
            c.version = 5  # as after set_version(5) against the server before it restarted
            c.get_batch(10, 10**6, wait_s=0)
        q = h.get("/stats").json()["queue"]
        assert q["learner_version"] == 5 and q["dropped_stale"] == 1  # learned, and applied: v0 is too old now
        assert up(5).status_code == 200
        for v in (6, 7):
            r = up(v)
            assert r.status_code == 503 and f"policy v{v}" in r.json()["detail"]
        r = up(8)
        assert r.status_code == 400
        assert "sample 0: policy_version: v8 is ahead of the learner's v5" in r.json()["detail"]
        assert h.post("/version", json={"version": 7}).status_code == 200
        assert up(7).status_code == 200
        stats = h.get("/stats").json()
    assert stats["http"]["uploads_ahead_of_learner"] == 3
    assert stats["http"]["rejected_by_field"] == {"policy_version": 1}
    assert stats["queue"]["samples_in"] == 3


def test_a_live_worker_cannot_be_hijacked_through_the_api():
    async def main(url):
        async with AsyncRefServerClient(url, retries=0) as a:
            await a.register("w1", "http://127.0.0.1:9001", {"gpus": 1}, 0)
            with pytest.raises(RefServerError) as e:
                await a.register("w1", "http://127.0.0.1:6666", {}, 0)
            assert e.value.status == 409 and "is live at http://127.0.0.1:9001" in e.value.detail
            assert await a.heartbeat("w1", 1)  # the real worker goes on
            with RefServerClient(url) as c:
                assert [(w["id"], w["url"]) for w in c.workers()] == [("w1", "http://127.0.0.1:9001")]
                await a.register("w1", "http://127.0.0.1:9001", {}, 0)  # restarted at the same URL: fine
                assert c.workers()[0]["url"] == "http://127.0.0.1:9001"
                await asyncio.sleep(1.6)  # it stops heartbeating and expires: now the id is free
                await a.register("w1", "http://127.0.0.1:9002", {}, 0)
                assert c.workers()[0]["url"] == "http://127.0.0.1:9002"

    with serve(create_app(config(worker_ttl_s=1.5))) as url:
        asyncio.run(main(url))


def test_408_and_503_are_retried_within_the_wait():
    """A body that did not arrive in time (408, a slow link) and a version not announced yet (503) are
    transient: the client retries them, up to max_wait_s for an upload, then says so."""
    assert _outcome(httpx.Response(408), None, (200,))[0] is None  # retried, not raised
    with serve(create_app(config())) as url:
        with pytest.raises(RefServerUnavailable, match="not accepted within"):
            asyncio.run(_upload(url, [mk(1, version=1)], max_wait_s=1.0))  # v1 never announced: 503


def test_nan_in_json_is_a_422_and_a_client_that_leaves_mid_upload_is_no_error(caplog):
    """`{"version": NaN}` was a 500 with two tracebacks: FastAPI's 422 echoed the NaN and could not be
    rendered. A worker that died mid-upload was an ERROR with a traceback (found in review)."""
    import socket

    from procs import free_port

    port = free_port()
    with serve(create_app(config()), port=port) as url, httpx.Client(base_url=url) as h:
        h.post("/workers", json={"id": "w1", "url": "http://127.0.0.1:1"})
        for path, body in (("/version", '{"version": NaN}'), ("/workers", '{"id": "w", "url": "http://a:1", '
                                                                          '"policy_version": Infinity}'),
                           ("/workers/w1/heartbeat", '{"policy_version": NaN}'), ("/grants", '{"worker_id": "w1", '
                                                                                           '"n": 1, "wait_s": NaN}')):
            r = h.post(path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"], (path, r.status_code, r.text[:200])
        with caplog.at_level("INFO"):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Type: " + CONTENT_TYPE.encode()
                      + b"\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000)
            s.close()  # gone with 99 KB still to send
            deadline = time.time() + 10
            while "client left during POST /upload" not in caplog.text and time.time() < deadline:
                time.sleep(0.1)
        assert h.get("/health").status_code == 200
    assert "client left during POST /upload" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text[-2000:]
