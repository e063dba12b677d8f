"""Who the learner sends weights (and the rollout token) to."""
import logging

from toolrl.config import load_config
from toolrl.weightsync.pusher import WeightSync
from toolrl.worker.standin import FixedRegistry

WORKERS = [{"id": "local", "url": "http://127.0.0.1:8300", "policy_version": 0},
           {"id": "other-node", "url": "http://10.1.2.3:8300", "policy_version": 0},
           {"id": "named", "url": "http://gpu-node-7:8300", "policy_version": 0}]


class Recorder:
    name = "record"

    def __init__(self):
        self.sent = []

    def push(self, worker, named, version):
        self.sent.append(worker["id"])
        return {"version": version, "loaded": True}

    def forget(self, live):
        pass


def sync(*sets):
    cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled", "rollout.token=secret", *sets])
    t = Recorder()
    return WeightSync(cfg, FixedRegistry(WORKERS), transport=t), t


def test_an_open_registry_gets_weights_to_loopback_and_trusted_hosts_only(caplog):
    s, t = sync()
    with caplog.at_level(logging.ERROR, logger="learner"):
        res = s.push([], 1)
        s.push([], 2)
    assert sorted(t.sent) == ["local", "local"] and res["workers_ok"] == 1
    refused = [r for r in caplog.records if "not sending weights" in r.message]
    assert len(refused) == 2  # each untrusted URL logged once, not at every push
    assert s.catch_up(lambda: [], 3) == 1 and t.sent[-1] == "local"
    s, t = sync("rollout.trusted_hosts=[gpu-node-7]")
    s.push([], 1)
    assert sorted(t.sent) == ["local", "named"]


def test_with_a_registry_token_every_registered_worker_is_trusted():
    s, t = sync("ref_server.token=reg-secret")
    s.push([], 1)
    assert sorted(t.sent) == ["local", "named", "other-node"]


def test_the_end_of_run_probe_sends_the_rollout_token_to_trusted_workers_only(tmp_path):
    """launch.sh's report probes every registered worker with the rollout token: an open registry's
    worker on a host nobody trusted is listed, not asked (127.0.0.2 is reachable, but not trusted)."""
    import http.server
    import threading

    from toolrl.learner.report import probe_workers
    from toolrl.net import free_port

    seen = []

    class Capture(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(500)
            self.end_headers()

        def log_message(self, *a):
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.2", port), Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled", "rollout.token=secret"])
        rows = probe_workers(cfg, [{"id": "squatter", "url": f"http://127.0.0.2:{port}", "policy_version": 3}],
                             tmp_path / "export")
    finally:
        server.shutdown()
    assert seen == []
    assert [(r["id"], r["policy_version"]) for r in rows] == [("squatter", 3)]
    assert "untrusted" in rows[0]["probe_skipped"]


def test_the_reference_server_knows_a_version_before_any_worker_loads_it():
    """A worker can upload a sample of the new version as soon as it has loaded it (an interrupted
    rollout resumes at once), and the reference server holds back samples newer than the version it
    knows: the version is announced before the first worker gets it, even if every push fails."""
    registry = FixedRegistry(WORKERS[:1])
    seen = []

    class Watching(Recorder):
        def push(self, worker, named, version):
            seen.append(list(registry.versions))
            return {"error": "down"} if version == 2 else super().push(worker, named, version)

    cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled", "rollout.token=secret"])
    s = WeightSync(cfg, registry, transport=Watching())
    s.push([], 1)
    s.push([], 2)
    assert seen == [[1], [1, 2]] and registry.versions == [1, 2]


def test_a_worker_restarted_under_its_id_and_url_is_caught_up():
    """launch.sh restarts a worker as worker-$i on the same port: it registers again empty, but the
    learner's record of what it pushed (keyed by id and URL) said it held the last version, so it was
    never caught up and produced from its base weights until the next sync (found in review)."""
    first = {"id": "worker-0", "url": "http://127.0.0.1:8300", "policy_version": 0, "registered_at": 100.0}
    reg = FixedRegistry([first])
    cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled"])
    t = Recorder()
    s = WeightSync(cfg, reg, transport=t)
    s.push([], 7)
    assert s.behind(7) == []  # its heartbeat has not said 7 yet; what was pushed counts
    reg.list = [{**first, "registered_at": 250.0}]  # the same id and URL, a new life, empty
    assert [w["id"] for w in s.behind(7)] == ["worker-0"]



def test_workers_that_left_are_forgotten(caplog):
    """What the learner remembers of each worker (its last failure, the version it confirmed, an
    untrusted URL already logged) goes when the worker leaves the registry: a long run's workers
    come and go, and a record of each would grow without end."""
    reg = FixedRegistry([dict(w) for w in WORKERS])

    class FailingOne(Recorder):
        def push(self, worker, named, version):
            return {"error": "down"} if worker["id"] == "flaky" else super().push(worker, named, version)

    cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled", "rollout.token=secret"])
    s = WeightSync(cfg, reg, transport=FailingOne())
    reg.list.append({"id": "flaky", "url": "http://127.0.0.1:8301", "policy_version": 0})
    s.push([], 1)
    assert set(s.failures) == {"flaky"} and len(s.pushed) == 1 and len(s.refused) == 2
    reg.list = [w for w in reg.list if w["id"] == "local"]
    assert s.behind(1) == []
    assert s.failures == {} and len(s.pushed) == 1 and s.refused == set()
    reg.list = [dict(w) for w in WORKERS]  # the untrusted ones come back: logged again, once
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="learner"):
        s.behind(1)
        s.behind(1)
    assert sum("not sending weights" in r.message for r in caplog.records) == 2
