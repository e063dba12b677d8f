"""The fan-out tree for HTTP weight updates: its plan, and what a worker reports back up it.

With `learner.sync_fanout: k` the learner sends each bucket of an update once, to one root
worker, and every worker relays each bucket to at most k children while it loads it itself
(toolrl.weightsync.relay). The plan travels with every bucket as the `X-Toolrl-Fanout` header:
the receiving worker's subtree (its children, theirs, ...), the hop timeout, the egress cap each
relay obeys and a tag naming the sender's stream of this update (docs/WIRE_FORMAT.md). The
learner puts only the workers it trusts in a plan, so weights and the rollout token reach no
one else.

The answer to the last bucket carries, under "tree", the outcome of every worker below the one
answering: its own answer, or {"error"}. The learner learns every worker's outcome from the
root's one answer.
"""
from __future__ import annotations

import json
import secrets
from typing import Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PLAN_HEADER = "X-Toolrl-Fanout"
# uvicorn (h11) refuses request heads over 16 KiB; the rest of the head fits in what is left.
# About 150 workers with short ids and URLs per tree; the learner splits larger sets (make_plans).
MAX_PLAN_BYTES = 12 << 10
MAX_DEPTH = 16  # levels below the receiving worker
MAX_CHILDREN = 64


class PlanError(ValueError):
    """A fan-out plan that cannot be used (a worker answers 400 and receives nothing)."""


class PlanNode(BaseModel):
    """A worker in the tree and the workers it relays to."""
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=200)
    url: str = Field(max_length=500, pattern=r"^https?://[^\s/?#]+[^\s?#]*$")
    children: list[PlanNode] = Field(default_factory=list, max_length=MAX_CHILDREN)

    def walk(self) -> Iterator[PlanNode]:
        """This node, then every node below it."""
        yield self
        for c in self.children:
            yield from c.walk()

    def below(self) -> Iterator[PlanNode]:
        for c in self.children:
            yield from c.walk()

    @property
    def height(self) -> int:
        """Hops from this worker down to its deepest descendant (0: a leaf)."""
        return 1 + max(c.height for c in self.children) if self.children else 0


class FanoutPlan(BaseModel):
    """What a worker is told with each bucket: whom to relay the update to, and how."""
    model_config = ConfigDict(extra="forbid")
    tag: str = Field(min_length=8, max_length=64)  # the sender's stream of this update (receiver.Update.tag)
    timeout_s: float = Field(gt=0, le=3600)  # every hop's timeout: learner.sync_timeout_s
    max_mb_s: float | None = Field(None, gt=0)  # each relay's egress cap: learner.sync_max_mb_s
    children: list[PlanNode] = Field(default_factory=list, max_length=MAX_CHILDREN)

    @model_validator(mode="after")
    def _check(self) -> FanoutPlan:
        ids = [n.id for c in self.children for n in c.walk()]
        if len(set(ids)) != len(ids):
            raise ValueError("a worker appears twice in the plan")
        if self.height > MAX_DEPTH:
            raise ValueError(f"the plan is {self.height} levels deep, over the limit of {MAX_DEPTH}")
        return self

    @property
    def height(self) -> int:
        """Hops from the receiving worker down to its deepest descendant."""
        return 1 + max(c.height for c in self.children) if self.children else 0

    def header(self) -> str:
        return self.model_dump_json(exclude_none=True)


def plan_for(node: PlanNode, timeout_s: float, max_mb_s: float | None) -> FanoutPlan:
    """The plan to send `node` with each bucket: its subtree, under a fresh tag for this sender's stream."""
    return FanoutPlan(tag=secrets.token_hex(8), timeout_s=timeout_s, max_mb_s=max_mb_s, children=node.children)


def parse_plan(raw: str) -> FanoutPlan:
    """The plan from the `X-Toolrl-Fanout` header, or PlanError with the first problem."""
    if len(raw) > MAX_PLAN_BYTES:
        raise PlanError(f"the plan is {len(raw)} bytes, over the limit of {MAX_PLAN_BYTES}")
    try:
        return FanoutPlan.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "plan"
        raise PlanError(f"{where}: {first['msg']}") from None


def make_plans(workers: list[dict], fanout: int) -> list[PlanNode]:
    """Workers ({"id", "url"}) as complete `fanout`-ary trees, filled breadth first in the order
    given: the first workers carry the subtrees, so put the dependable ones first. One tree unless
    its plan would not fit in a header; then as few as fit (the learner sends one copy to each root)."""
    if fanout < 1:
        raise ValueError(f"fanout must be at least 1, got {fanout}")
    for n_trees in range(1, len(workers) + 1):
        roots = [_tree(workers[i::n_trees], fanout) for i in range(n_trees)]
        # 200: room for the tag, the timeout and the cap beside the children
        if all(len(json.dumps([c.model_dump() for c in r.children], separators=(",", ":"))) + 200 <= MAX_PLAN_BYTES
               for r in roots):
            return roots
    return []


def _tree(workers: list[dict], fanout: int) -> PlanNode:
    nodes = [PlanNode(id=w["id"], url=w["url"].rstrip("/")) for w in workers]
    for i, n in enumerate(nodes):
        n.children = nodes[fanout * i + 1:fanout * i + 1 + fanout]
    return nodes[0]


def reported_below(node: PlanNode, tree) -> dict[str, dict]:
    """What a worker reported (its answer's "tree") about the workers in its subtree, and nothing else."""
    if not isinstance(tree, dict):
        return {}
    return {n.id: tree[n.id] for n in node.below() if isinstance(tree.get(n.id), dict)}


def outcomes_of(node: PlanNode, answer: dict) -> dict[str, dict]:
    """Every outcome in `node`'s subtree from its answer to the last bucket: its own answer, and one
    per worker below it ({"error"} for a worker it did not report on)."""
    reported = reported_below(node, answer.get("tree"))
    out = {node.id: {k: v for k, v in answer.items() if k != "tree"}}
    for n in node.below():
        out[n.id] = reported.get(n.id) or {"error": f"{node.id} reported no outcome for it"}
    return out
