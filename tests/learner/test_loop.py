"""The learner's loop (toolrl/learner/loop.py) in-process, against a real reference server fed by hand:
what the loop itself decides about a batch, apart from the trainer's step."""
import asyncio
import json
import random
import sys
from pathlib import Path


from toolrl.config import load_config
from toolrl.protocol import Sample
from toolrl.refserver.app import create_app
from toolrl.refserver.client import AsyncRefServerClient

sys.path.insert(0, str(Path(__file__).parent.parent / "refserver"))
from test_ref_server import serve  # noqa: E402
from test_trainer import dist_env  # noqa: E402,F401  (the in-process DeepSpeed rank)


def group(tag: str, rewards: list[float]) -> list[Sample]:
    """One prompt's group; its advantages are what the worker would compute (zero when flat)."""
    rng = random.Random(tag)
    prompt = [rng.randrange(1, 2000) for _ in range(6)]
    mean = sum(rewards) / len(rewards)
    out = []
    for r in rewards:
        ids = [rng.randrange(1, 2000) for _ in range(8)]
        out.append(Sample(prompt_ids=prompt, completion_ids=ids, loss_mask=[1] * 8, logprobs=[-7.0] * 8,
                          rewards={"correct": r}, reward=r, advantage=r - mean, group_id=tag))
    return out


async def upload(url: str, groups: list[list[Sample]]) -> None:
    async with AsyncRefServerClient(url) as c:
        for g in groups:
            await c.upload(g)


def test_dynamic_sampling_in_the_loop_draws_past_flat_groups(tmp_path):
    """grpo.dynamic_sampling through the loop: the first draw is two groups without reward variance,
    left out; the loop draws again (within max_draws) and trains on the two groups with signal only,
    and the step's metrics say so."""
    from toolrl.learner.loop import run

    cfg = load_config("configs/cpu_tiny.yaml", [
        "logging.wandb_mode=disabled", "learner.dtype=float32", "grpo.beta=0", "learner.steps=1",
        "learner.batch_samples=8", "learner.batch_tokens=100000", "learner.checkpoint_every=0",
        "learner.batch_timeout_s=60", "eval.before_after=false", "ref_server.flow_control=false",
        "ref_server.batch_wait_s=1", "grpo.dynamic_sampling=true", "grpo.max_draws=3"])
    flat = [group("flat-0", [1.0] * 4), group("flat-1", [0.0] * 4)]
    signal = [group("sig-0", [1.0, 0.0, 0.0, 1.0]), group("sig-1", [0.0, 1.0, 1.0, 1.0])]
    with serve(create_app(cfg)) as url:
        asyncio.run(upload(url, flat + signal))  # first in, first out: the flat groups come first
        run(cfg.model_copy(update={"ref_server": cfg.ref_server.model_copy(update={"url": url})}),
            tmp_path, resume=False)
    rows = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    m = rows[0]
    assert (m["samples_drawn"], m["dynamic_sampling_dropped"], m["samples"]) == (16, 8, 8)
    assert m["samples_no_signal"] == 0
