"""The learner's command line: arguments, config, logging, then the loop (toolrl.learner.loop). How to
launch it (deepspeed, torchrun on one or several nodes, srun, plain python) is in learner.py's docstring."""
import argparse
import time
from pathlib import Path

from toolrl.config import add_config_args, config_from_args
from toolrl.net import setup_logging


def main(argv: list[str] | None = None) -> None:
    started = time.time()  # learner.run_budget_s counts the whole run, imports and start-up included
    parser = argparse.ArgumentParser(prog="learner.py", description="The DeepSpeed GRPO learner: it pulls batches, "
                                     "takes steps, checkpoints, and pushes weights back to every worker.")
    add_config_args(parser)
    parser.add_argument("--run-dir", help="checkpoints, export and logs go here (default: from the config)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by deepspeed
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    setup_logging("learner")

    from toolrl.learner.loop import run  # after parsing: --help stays fast (torch, DeepSpeed)

    run(cfg, Path(args.run_dir) if args.run_dir else None, args.resume, started)
