"""gen_worker.py: vLLM rollouts with the Python tool loop, scored and uploaded, with live weight updates.

    python gen_worker.py --config configs/cpu_demo.yaml [--set executor.url=...]
    python gen_worker.py --config CFG --rollout-only --num-prompts N --out FILE.jsonl

As a service it registers with the reference server, uploads scored groups (waiting when the
server is full) and serves POST /update_weights, GET /health and GET /stats. With --rollout-only
it writes scored samples to a JSONL file and needs no reference server.
"""
import argparse
import asyncio
import json

from toolrl.config import add_config_args, config_from_args
from toolrl.net import add_bind_args, setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gen_worker.py", description=__doc__.splitlines()[0])
    add_config_args(parser)
    add_bind_args(parser, "rollout")
    parser.add_argument("--worker-id", help="unique id in the registry (default host-pid)")
    parser.add_argument("--public-url", help="URL the learner uses to reach this worker")
    parser.add_argument("--max-groups", type=int,
                        help="stop producing after this many groups (keeps serving updates and probes)")
    parser.add_argument("--rollout-only", action="store_true", help="write samples to --out; no ref server")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts (groups) in --rollout-only mode")
    parser.add_argument("--out", default="runs/rollouts.jsonl", help="JSONL output of --rollout-only")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    setup_logging("gen_worker")

    from toolrl.worker.rewards import check_reward_config
    from toolrl.worker.service import GenWorker, rollout_only, run_service  # after parsing: --help stays fast

    try:  # a misspelt reward: one line now, not a traceback from the agent once the engine is up
        check_reward_config(cfg)
    except ValueError as exc:
        raise SystemExit(f"gen_worker.py: config error: {exc}") from None

    if args.rollout_only:
        async def run():
            worker = GenWorker(cfg, worker_id=args.worker_id or "rollout-only")
            try:
                return await rollout_only(worker, args.num_prompts, args.out)
            finally:
                await worker.aclose()

        print(json.dumps(asyncio.run(run())))
        return

    host = args.host or cfg.rollout.host
    port = args.port or cfg.rollout.port
    asyncio.run(run_service(cfg, args.worker_id, host, port, args.public_url, args.max_groups))

