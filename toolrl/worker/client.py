"""The gen worker's HTTP API, as others call it (toolrl.worker.app serves it)."""
from __future__ import annotations

import httpx

from toolrl.config import Config
from toolrl.net import auth_headers
from toolrl.protocol import incarnation


def evaluate_on_worker(cfg: Config, workers: list[dict], version: int, pushed: dict | None = None) -> dict:
    """The learner's in-run evaluation: a live worker holding policy `version` (as the registry, or
    the learner's own record of what it pushed, says) runs the `eval` section's problems with its
    engine. Raises RuntimeError when no worker holds it or the request fails."""
    pushed = pushed or {}
    holding = [w for w in workers
               if int(w.get("policy_version", -1)) == version or pushed.get(incarnation(w)) == version]
    if not holding:
        raise RuntimeError(f"no live worker holds policy version {version} "
                           f"(workers: {[(w['id'], w.get('policy_version')) for w in workers]})")
    w, e = holding[0], cfg.eval
    body = {"task": e.task, "n_problems": e.n_problems, "samples": e.samples, "ks": e.ks, "seed": e.seed,
            "concurrency": e.concurrency, "temperature": e.temperature}
    try:
        r = httpx.post(f"{w['url']}/evaluate", json=body, headers=auth_headers(cfg.rollout.token), timeout=e.timeout_s)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"evaluation on worker {w['id']} failed: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        raise RuntimeError(f"evaluation on worker {w['id']} failed: HTTP {r.status_code}: {r.text[:300]}")
    res = r.json()
    if res.get("policy_version") != version or res.get("policy_version_end") != version:
        raise RuntimeError(f"worker {w['id']} evaluated versions {res.get('policy_version')}-"
                           f"{res.get('policy_version_end')}, not {version} alone")
    res["worker_id"] = w["id"]
    return res
