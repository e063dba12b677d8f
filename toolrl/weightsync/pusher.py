"""Learner -> workers weight sync: push the full weights to every live worker through the configured
transport (toolrl.weightsync.transport), then tell the reference server the new version.

A worker that fails is retried `sync_retries` times with backoff, then reported and
remembered: it is brought up to date at the next chance (`catch_up`), so a flaky or late worker
never silently keeps stale weights.

With `learner.sync_fanout` (http) the learner sends the update once, down a tree of the workers
(toolrl.weightsync.fanout), and learns every worker's outcome from the root's answer. A worker
that fails inside the tree is routed around by its parent and caught up later by a direct push;
if the root fails, the workers it did not report on are planned again and sent the update again,
at most `sync_retries` more times.

With `learner.sync_delta` (http), workers that confirmed the version the learner sent last get
this one as a delta from it (toolrl.weightsync.delta), directly or down a tree of their own; the
others get the full weights. A worker that refuses the delta or cannot apply it (`need_full`: it
does not hold the base after all, or the result did not match its checksum) gets the full weights
directly in the same sync. The learner keeps one copy of the weights for this.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from urllib.parse import urlsplit

from toolrl.config import Config
from toolrl.net import RetryPolicy
from toolrl.protocol import incarnation
from toolrl.weightsync.fanout import make_plans
from toolrl.weightsync.http import HttpTransport
from toolrl.weightsync.process_group import ProcessGroupTransport
from toolrl.weightsync.transport import Transport, WeightSyncError

log = logging.getLogger("learner")
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def trusted_workers(cfg: Config, workers: list[dict]) -> tuple[list[dict], list[dict]]:
    """(trusted, refused): the workers anything of the learner's side may send weights or the
    rollout token to. With a reference-server token only its holders can register, so every
    registered worker is trusted; without one anyone who reaches the reference server could
    register any URL, so only loopback and rollout.trusted_hosts are."""
    if cfg.ref_server.token:
        return list(workers), []
    allowed = LOOPBACK | set(cfg.rollout.trusted_hosts)
    ok = [w for w in workers if urlsplit(w["url"]).hostname in allowed]
    return ok, [w for w in workers if w not in ok]


def make_transport(cfg: Config) -> Transport:
    lc = cfg.learner
    if lc.sync_transport == "process_group":
        return ProcessGroupTransport(lc.sync_host, cfg.rollout.token, lc.sync_timeout_s, cfg.rollout.drain_timeout_s)
    return HttpTransport(cfg.rollout.token, lc.sync_bucket_mb, lc.sync_timeout_s, lc.sync_max_mb_s)



class WeightSync:
    def __init__(self, cfg: Config, ref, transport: Transport | None = None):
        self.cfg = cfg
        self.ref = ref
        self.transport = transport or make_transport(cfg)
        self.retry = RetryPolicy(retries=cfg.learner.sync_retries, base_s=0.5, cap_s=5.0)
        self.failures: dict[str, str] = {}  # worker id -> last error
        self.pushed: dict[tuple, int] = {}  # incarnation(w) -> version it confirmed loading
        self.last: dict = {}
        self.refused: set[str] = set()  # untrusted worker URLs, logged once

    def _push_one(self, worker: dict, named, version: int, delta: bool = False) -> dict:
        err = None
        for attempt in range(self.retry.retries + 1):
            try:  # a delta is tried once: whatever went wrong, the full weights will do
                return self.transport.push(worker, named, version, delta=True) if delta and not attempt \
                    else self.transport.push(worker, named, version)
            except WeightSyncError as exc:
                err = exc
                log.warning("sync to %s failed (attempt %d/%d): %s", worker["id"], attempt + 1,
                            self.retry.retries + 1, exc)
                if attempt < self.retry.retries:
                    time.sleep(self.retry.delay(attempt))
        raise err  # type: ignore[misc]

    def trusted(self, workers: list[dict]) -> list[dict]:
        """The workers the learner may send weights and the rollout token to (`trusted_workers`);
        the rest are logged once each and left out."""
        ok, refused = trusted_workers(self.cfg, workers)
        for w in refused:
            if w["url"] not in self.refused:
                self.refused.add(w["url"])
                log.error("not sending weights to worker %s at %s: the reference server takes registrations "
                          "without a token, and that host is not in rollout.trusted_hosts", w["id"], w["url"])
        return ok

    def push(self, named, version: int, workers: list[dict] | None = None, direct: bool = False) -> dict:
        """Push to the given (default: all live) workers, in parallel or down the fan-out tree (unless
        `direct`); report who failed."""
        t0 = time.time()
        # Announced first: a worker can finish a rollout under `version` as soon as it has loaded it
        # (an interrupted one resumes at once), and the reference server holds back (503) samples
        # newer than the version it knows.
        self.ref.set_version(version)
        workers = self.trusted(self.ref.workers() if workers is None else workers)
        egress = getattr(self.transport, "egress", None)
        sent0 = egress.sent if egress is not None else 0
        fresh = self._prepare(named, version, workers)
        try:
            deltas = fresh or []
            groups = [(g, d) for g, d in ((deltas, True), ([w for w in workers if w not in deltas], False)) if g]
            outcomes: dict[str, dict] = {}
            with cf.ThreadPoolExecutor(max_workers=max(1, len(groups))) as pool:  # deltas and full at once
                for got in pool.map(lambda gd: self._push_group(named, version, gd[0], gd[1], direct), groups):
                    outcomes.update(got)
            again = [w for w in deltas if (outcomes.get(w["id"]) or {}).get("need_full")]
            if again:
                log.warning("%d worker(s) refused the delta or could not apply it; sending them version %d whole: %s",
                            len(again), version, [w["id"] for w in again])
                outcomes.update(self._push_direct(named, version, again))
        finally:
            out = self.transport.release() if fresh is not None else None
        ok, failed = {}, {}
        for w in workers:
            a = outcomes.get(w["id"]) or {"error": "no outcome"}
            if "error" in a or a.get("version") != version or not a.get("loaded"):
                # reported, remembered, retried at the next catch-up
                failed[w["id"]] = self.failures[w["id"]] = a.get("error") or f"did not confirm version {version}: {a}"
                log.error("worker %s did not take version %d: %s", w["id"], version, failed[w["id"]])
            else:
                ok[w["id"]] = a
                self.failures.pop(w["id"], None)
                self.pushed[incarnation(w)] = version
        self.last = {"version": version, "workers_ok": len(ok), "workers_failed": len(failed),
                     "sync_s": time.time() - t0,
                     "reload_s_max": max((a.get("reload_s", 0.0) for a in ok.values()), default=0.0),
                     # how long the workers held the update back for rollouts in flight (interrupting
                     # them: milliseconds; draining them: until they finished)
                     "drain_s_max": max((a.get("drain_s", 0.0) for a in ok.values()), default=0.0),
                     "interrupted": sum(a.get("interrupted", 0) for a in ok.values())}
        if egress is not None:
            self.last["egress_bytes"] = egress.sent - sent0  # what left the learner for this push
        if out is not None:  # of which deltas, and what one full copy is
            self.last.update(delta_bytes=out.sent["delta"], copy_bytes=out.copy_bytes)
        return {**self.last, "failed": failed}

    def _prepare(self, named, version: int, workers: list[dict]) -> list[dict] | None:
        """Frame the update once for this sync (a transport that can: http) -> the workers to send it
        as a delta: those that confirmed the version the learner sent last, among those
        `learner.sync_delta` names (auto: remote ones; on: all). None: the transport frames nothing."""
        prepare = getattr(self.transport, "prepare", None)
        if prepare is None:
            return None
        mode = self.cfg.learner.sync_delta
        wants = [w for w in workers if mode == "on" or (mode == "auto" and urlsplit(w["url"]).hostname not in LOOPBACK)]
        try:
            base = prepare(named, version, keep=bool(wants))
        except Exception:  # deltas are an optimisation: the full weights still go out
            log.exception("could not prepare version %d's deltas; sending the full weights", version)
            return []
        return [w for w in wants if base is not None and self.pushed.get(incarnation(w)) == base]

    def _push_group(self, named, version: int, workers: list[dict], delta: bool, direct: bool) -> dict[str, dict]:
        fanout = self.cfg.learner.sync_fanout
        if fanout and not direct and len(workers) > 1:
            return self._push_tree(named, version, workers, fanout, delta)
        return self._push_direct(named, version, workers, delta)

    def _push_direct(self, named, version: int, workers: list[dict], delta: bool = False) -> dict[str, dict]:
        """The learner sends every worker the update itself. -> {id: its answer, or {"error"}}"""
        outcomes: dict[str, dict] = {}
        if workers:
            with cf.ThreadPoolExecutor(max_workers=min(8, len(workers))) as pool:
                futs = {pool.submit(self._push_one, w, named, version, delta): w for w in workers}
                for fut in cf.as_completed(futs):
                    try:
                        outcomes[futs[fut]["id"]] = fut.result()
                    except Exception as exc:
                        outcomes[futs[fut]["id"]] = {"error": str(exc)}
        return outcomes

    def _push_tree(self, named, version: int, workers: list[dict], fanout: int, delta: bool = False) -> dict[str, dict]:
        """The update once down a tree of `workers`; a root that fails takes no outcome with it for
        the workers below it, who are planned again without it (at most `sync_retries` more times)."""
        outcomes: dict[str, dict] = {}
        # workers that failed last time go last, as leaves: a flaky worker should carry no subtree
        left = sorted(workers, key=lambda w: w["id"] in self.failures)
        for attempt in range(self.retry.retries + 1):
            roots = make_plans(left, fanout)
            with cf.ThreadPoolExecutor(max_workers=len(roots)) as pool:
                send = (lambda r: self.transport.push_tree(r, named, version, delta=True)) if delta else \
                    (lambda r: self.transport.push_tree(r, named, version))
                for got in pool.map(send, roots):
                    outcomes.update(got)
            left = [w for w in left if w["id"] not in outcomes]
            if not left:
                break
            log.warning("the tree's root failed before reporting on %d worker(s); planning them again (%d/%d): %s",
                        len(left), attempt + 1, self.retry.retries + 1, [r.id for r in roots])
            if attempt < self.retry.retries:
                time.sleep(self.retry.delay(attempt))
        for w in left:
            outcomes[w["id"]] = {"error": f"not reached: the tree's root failed {self.retry.retries + 1} times"}
        return outcomes

    def behind(self, version: int) -> list[dict]:
        """Live workers that are behind `version` (late joiners, earlier failures); workers that left
        are forgotten (a run that sees thousands of workers come and go keeps none of them)."""
        registered = self.ref.workers()
        live = self.trusted(registered)
        lives, ids = {incarnation(w) for w in live}, {w["id"] for w in live}
        self.pushed = {k: v for k, v in self.pushed.items() if k in lives}
        self.failures = {k: v for k, v in self.failures.items() if k in ids}
        self.refused &= {w["url"] for w in registered}  # logged again if it registers again
        self.transport.forget({(w["id"], w["url"]) for w in live})
        # The registry learns a worker's version from its next heartbeat; what we pushed counts now.
        return [w for w in live
                if max(int(w.get("policy_version", 0)), self.pushed.get(incarnation(w), 0)) < version]

    def catch_up(self, state_fn, version: int, behind: list[dict] | None = None) -> int:
        """Push the current weights to the workers that are `behind` (default: those `behind(version)`
        finds now); `state_fn` is called only if there are any."""
        behind = self.behind(version) if behind is None else behind
        if not behind:
            return 0
        log.info("bringing %d worker(s) up to version %d: %s", len(behind), version, [w["id"] for w in behind])
        res = self.push(state_fn(), version, workers=behind, direct=True)  # a flaky worker relays to no one
        return res["workers_ok"]
