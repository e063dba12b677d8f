"""Learner -> workers weight sync: push the full weights to every live worker, then tell the
reference server the new version.

Transport `http` streams safetensors buckets (toolrl.weightsync.http.push_weights) and works anywhere,
CPU included; `process_group` broadcasts on a group per worker (toolrl.weightsync.process_group), NCCL on
GPUs. A worker that fails is retried `sync_retries` times with backoff, then reported and
remembered: it is brought up to date at the next chance (`catch_up`), so a flaky or late worker
never silently keeps stale weights.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import time

from toolrl.config import Config
from toolrl.weightsync.http import WeightSyncError, push_weights

log = logging.getLogger("learner")


class WeightSync:
    def __init__(self, cfg: Config, ref):
        self.cfg = cfg
        self.ref = ref
        self.failures: dict[str, str] = {}  # worker id -> last error
        self.pushed: dict[tuple[str, str], int] = {}  # (id, url) -> version it confirmed loading
        self.last: dict = {}
        self.groups: dict[tuple[str, str], object] = {}  # (id, url) -> LearnerGroup (process_group transport)

    def _push_one(self, worker: dict, named, version: int) -> dict:
        lc = self.cfg.learner
        err = None
        for attempt in range(lc.sync_retries + 1):
            try:
                if lc.sync_transport == "process_group":
                    return self._broadcast(worker, named, version)
                return push_weights(worker["url"], named, version, token=self.cfg.rollout.token,
                                    bucket_mb=lc.sync_bucket_mb, timeout_s=lc.sync_timeout_s)
            except WeightSyncError as exc:
                err = exc
                log.warning("sync to %s failed (attempt %d/%d): %s", worker["id"], attempt + 1, lc.sync_retries + 1,
                            exc)
                time.sleep(min(5.0, 0.5 * 2 ** attempt))
        raise err  # type: ignore[misc]

    def _broadcast(self, worker: dict, named, version: int) -> dict:
        from toolrl.weightsync.process_group import LearnerGroup

        key, lc = (worker["id"], worker["url"]), self.cfg.learner
        try:
            if key not in self.groups:
                self.groups[key] = LearnerGroup(worker, lc.sync_host, token=self.cfg.rollout.token,
                                                timeout_s=lc.sync_timeout_s)
            return self.groups[key].push(named, version, drain_s=self.cfg.rollout.drain_timeout_s)
        except Exception as exc:
            self.groups.pop(key, None)  # out of step with the worker now: rebuild it at the next try
            raise exc if isinstance(exc, WeightSyncError) else WeightSyncError(f"{worker['url']}: {exc}") from None

    def push(self, named, version: int, workers: list[dict] | None = None) -> dict:
        """Push to the given (default: all live) workers in parallel; report who failed."""
        t0 = time.time()
        workers = self.ref.workers() if workers is None else workers
        ok, failed = {}, {}
        if workers:
            with cf.ThreadPoolExecutor(max_workers=min(8, len(workers))) as pool:
                futs = {pool.submit(self._push_one, w, named, version): w for w in workers}
                for fut in cf.as_completed(futs):
                    w = futs[fut]
                    try:
                        ok[w["id"]] = fut.result()
                        self.failures.pop(w["id"], None)
                        self.pushed[(w["id"], w["url"])] = version
                    except Exception as exc:  # reported, remembered, retried at the next catch-up
                        failed[w["id"]] = str(exc)
                        self.failures[w["id"]] = str(exc)
                        log.error("worker %s did not take version %d: %s", w["id"], version, exc)
        self.ref.set_version(version)
        self.last = {"version": version, "workers_ok": len(ok), "workers_failed": len(failed),
                     "sync_s": time.time() - t0,
                     "reload_s_max": max((a.get("reload_s", 0.0) for a in ok.values()), default=0.0)}
        return {**self.last, "failed": failed}

    def catch_up(self, state_fn, version: int) -> int:
        """Push the current weights to live workers that are behind (late joiners, earlier failures)."""
        live = self.ref.workers()
        keys = {(w["id"], w["url"]) for w in live}
        self.pushed = {k: v for k, v in self.pushed.items() if k in keys}  # forget workers that left
        self.groups = {k: g for k, g in self.groups.items() if k in keys}
        # The registry learns a worker's version from its next heartbeat; what we pushed counts now.
        behind = [w for w in live
                  if max(int(w.get("policy_version", 0)), self.pushed.get((w["id"], w["url"]), 0)) < version]
        if not behind:
            return 0
        log.info("bringing %d worker(s) up to version %d: %s", len(behind), version, [w["id"] for w in behind])
        res = self.push(state_fn(), version, workers=behind)
        return res["workers_ok"]
