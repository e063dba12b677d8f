"""The fan-out tree without processes: its plan (shape, header, what a worker refuses), what the
learner makes of the outcomes it gets back, the egress cap, and the config that turns it on.
(tests/weightsync/test_fanout_tree.py sends real updates down trees of real receivers.)"""
import json
import threading
import time

import pytest

from toolrl.config import ConfigError, load_config
from toolrl.weightsync.egress import MIB, Egress
from toolrl.weightsync.fanout import (MAX_DEPTH, MAX_PLAN_BYTES, PlanError, PlanNode, make_plans,
                                      outcomes_of, parse_plan, plan_for)
from toolrl.protocol import incarnation
from toolrl.weightsync.pusher import WeightSync
from toolrl.worker.standin import FixedRegistry


def _workers(n, url="http://127.0.0.1:{port}"):
    return [{"id": f"w{i}", "url": url.format(port=8300 + i, i=i), "policy_version": 0} for i in range(n)]


def _shape(node: PlanNode):
    return {node.id: [_shape(c) for c in node.children]} if node.children else node.id


def test_a_tree_is_filled_breadth_first_so_its_depth_grows_with_the_log_of_its_size():
    (root,) = make_plans(_workers(8), 2)
    assert _shape(root) == {"w0": [{"w1": [{"w3": ["w7"]}, "w4"]}, {"w2": ["w5", "w6"]}]}
    assert root.height == 3
    (chain,) = make_plans(_workers(4), 1)
    assert _shape(chain) == {"w0": [{"w1": [{"w2": ["w3"]}]}]}
    assert [make_plans(_workers(n), 2)[0].height for n in (1, 2, 4, 8, 16, 32)] == [0, 1, 2, 3, 4, 5]


def test_a_plan_too_big_for_one_header_is_split_into_as_few_trees_as_fit():
    (root,) = make_plans(_workers(100), 4)  # 100 workers with short URLs fit one header
    assert len(list(root.walk())) == 100
    many = _workers(300, url="http://gpu-node-{i}.cluster.example.org:{port}")
    roots = make_plans(many, 4)
    assert 1 < len(roots) < 5
    assert sorted(n.id for r in roots for n in r.walk()) == sorted(w["id"] for w in many)
    for r in roots:  # each root's plan goes in one header, and the workers accept it
        header = plan_for(r, 120.0, 50.0).header()
        assert len(header) <= MAX_PLAN_BYTES
        assert parse_plan(header).children == r.children


def _plan(**kw):
    (root,) = make_plans(_workers(5), 2)
    return {**plan_for(root, 30.0, None).model_dump(exclude_none=True), **kw}


def _deep(levels):
    node = {"id": "leaf", "url": "http://127.0.0.1:1", "children": []}
    for i in range(levels - 1):
        node = {"id": f"n{i}", "url": "http://127.0.0.1:1", "children": [node]}
    return [node]


@pytest.mark.parametrize("raw, needle", [
    ("{not json", "Invalid JSON"),
    (json.dumps(_plan(extra=1)), "extra: Extra inputs are not permitted"),
    (json.dumps(_plan(tag=None)), "tag"),
    (json.dumps(_plan(timeout_s=0)), "timeout_s"),
    (json.dumps(_plan(children=[{"id": "a", "url": "file:///etc/passwd"}])), "children.0.url"),
    (json.dumps(_plan(children=[{"id": "a", "url": "http://h:1"}, {"id": "a", "url": "http://h:2"}])),
     "a worker appears twice"),
    (json.dumps(_plan(children=_deep(MAX_DEPTH + 1))), f"over the limit of {MAX_DEPTH}"),
    (json.dumps(_plan(children=[{"id": f"w{i}", "url": "http://h:1"} for i in range(65)])), "at most 64"),
    (json.dumps(_plan(children=[{"id": "x" * 190, "url": f"http://h:{i}"} for i in range(64)])), "over the limit of"),
])
def test_a_worker_refuses_a_plan_it_cannot_use_with_the_reason(raw, needle):
    with pytest.raises(PlanError, match=needle):
        parse_plan(raw)


def test_the_deepest_plan_allowed_is_accepted():
    assert parse_plan(json.dumps(_plan(children=_deep(MAX_DEPTH)))).height == MAX_DEPTH


def test_outcomes_name_every_worker_of_the_subtree_and_no_other():
    (root,) = make_plans(_workers(4), 2)  # w0 -> w1 (-> w3), w2
    answer = {"version": 3, "loaded": True, "tree": {"w1": {"version": 3, "loaded": True},
                                                     "w2": {"error": "unreachable"},
                                                     "elsewhere": {"version": 3, "loaded": True}}}
    out = outcomes_of(root, answer)
    assert out == {"w0": {"version": 3, "loaded": True}, "w1": {"version": 3, "loaded": True},
                   "w2": {"error": "unreachable"}, "w3": {"error": "w0 reported no outcome for it"}}


def test_egress_counts_every_byte_and_holds_its_cap_across_threads():
    free = Egress()
    assert free.take(5 * MIB) == 0 and free.sent == 5 * MIB
    capped = Egress(max_mb_s=16)
    t0 = time.monotonic()

    def send():
        for _ in range(4):
            capped.pace(MIB)
    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    took = time.monotonic() - t0
    assert capped.sent == 8 * MIB
    assert 7 / 16 - 0.02 <= took < 1.5  # 8 MiB at 16 MiB/s; the first chunk goes at once


def test_fanout_is_an_http_option():
    cfg = load_config("configs/cpu_tiny.yaml", ["learner.sync_fanout=2", "learner.sync_max_mb_s=100"])
    assert cfg.learner.sync_fanout == 2 and cfg.learner.sync_max_mb_s == 100
    assert load_config("configs/cpu_tiny.yaml").learner.sync_fanout == 0  # default: direct pushes
    with pytest.raises(ConfigError, match="sync_transport: http only"):
        load_config("configs/cpu_tiny.yaml", ["learner.sync_transport=process_group", "learner.sync_fanout=2"])
    with pytest.raises(ConfigError, match="sync_fanout"):
        load_config("configs/cpu_tiny.yaml", ["learner.sync_fanout=-1"])


class FakeTree:
    """push_tree as the HTTP transport answers it, for workers that are `dead` (a dead root reports
    nothing; a dead worker inside the tree is reported failed by its parent, whose relay serves its
    children), and a record of the direct pushes."""

    def __init__(self, dead=()):
        self.dead, self.roots, self.direct = set(dead), [], []

    def push_tree(self, root: PlanNode, named, version):
        self.roots.append(_shape(root))
        if root.id in self.dead:
            return {root.id: {"error": "connection refused"}}
        return {n.id: {"error": "gone"} if n.id in self.dead else {"version": version, "loaded": True}
                for n in root.walk()}

    def push(self, worker, named, version):
        self.direct.append(worker["id"])
        return {"version": version, "loaded": True}

    def forget(self, live):
        pass


def _sync(transport, workers, *sets):
    cfg = load_config("configs/cpu_tiny.yaml", ["logging.wandb_mode=disabled", "learner.sync_fanout=2", *sets])
    return WeightSync(cfg, FixedRegistry(workers), transport=transport)


def test_the_learner_records_each_worker_of_the_tree_and_plans_again_without_a_failed_root():
    t = FakeTree(dead={"w0", "w2"})
    s = _sync(t, _workers(5), "learner.sync_retries=1")
    res = s.push([], 7)
    # w0 was the root and reported nothing: the other four were planned again, under w1 (w2, dead
    # inside the tree, was reported by its parent, whose relay served w4 instead)
    assert t.roots == [{"w0": [{"w1": ["w3", "w4"]}, "w2"]}, {"w1": [{"w2": ["w4"]}, "w3"]}]
    assert res["workers_ok"] == 3 and sorted(res["failed"]) == ["w0", "w2"]
    assert sorted(s.failures) == ["w0", "w2"] and s.pushed[incarnation(_workers(5)[1])] == 7
    t.dead.clear()
    s.push([], 8)  # the workers that failed go last: they carry no subtree
    assert t.roots[-1] == {"w1": [{"w3": ["w0", "w2"]}, "w4"]}
    assert s.catch_up(lambda: [], 9) == 5 and sorted(t.direct) == [f"w{i}" for i in range(5)]  # direct


def test_re_planning_after_failed_roots_is_bounded():
    t = FakeTree(dead={"w0", "w1", "w2", "w3"})
    s = _sync(t, _workers(5), "learner.sync_retries=2", "learner.sync_fanout=1")
    res = s.push([], 1)
    assert len(t.roots) == 3 and res["workers_ok"] == 0
    assert res["failed"]["w4"] == "not reached: the tree's root failed 3 times"
    assert not t.direct


def test_fanout_zero_pushes_to_every_worker_directly():
    t = FakeTree()
    s = _sync(t, _workers(3), "learner.sync_fanout=0")
    assert s.push([], 1)["workers_ok"] == 3
    assert sorted(t.direct) == ["w0", "w1", "w2"] and not t.roots
