"""Who the learner sends weights (and the rollout token) to."""
import logging

from toolrl.config import load_config
from toolrl.weightsync.pusher import WeightSync

WORKERS = [{"id": "local", "url": "http://127.0.0.1:8300", "policy_version": 0},
           {"id": "other-node", "url": "http://10.1.2.3:8300", "policy_version": 0},
           {"id": "named", "url": "http://gpu-node-7:8300", "policy_version": 0}]


class Registry:
    """The reference server's worker list as the pusher reads it."""

    def __init__(self):
        self.versions = []

    def workers(self):
        return [dict(w) for w in WORKERS]

    def set_version(self, v):
        self.versions.append(v)


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
    return WeightSync(cfg, Registry(), transport=t), t


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
