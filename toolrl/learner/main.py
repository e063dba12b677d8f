"""learner.py: the DeepSpeed GRPO learner. It pulls batches, takes steps, checkpoints, and pushes
weights back to every worker.

    deepspeed --num_gpus N learner.py --config CFG [--set k=v ...] [--run-dir DIR] [--resume]
    torchrun --nproc_per_node N learner.py ...     (also works; on a CPU: --num_gpus 1)
    torchrun --nnodes M --node_rank R --master_addr NODE0 --master_port P --nproc_per_node N learner.py ...
    srun --ntasks T python learner.py ...          (one task per rank; MASTER_ADDR: the step's first node)
    python learner.py ...                          (one rank, no launcher)

Each rank reads its place from its launcher's environment (toolrl/learner/dist_env.py); global rank 0
alone talks to the reference server and the workers. Ranks on several nodes need --run-dir (or
learner.checkpoint_dir) on a filesystem every node mounts at the same path: every rank writes and
reads the checkpoints.
"""
import argparse
from pathlib import Path

from toolrl.config import add_config_args, config_from_args
from toolrl.net import setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="learner.py", description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("--run-dir", help="checkpoints, export and logs go here (default: from the config)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by deepspeed
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    setup_logging("learner")

    from toolrl.learner.loop import run  # after parsing: --help stays fast (torch, DeepSpeed)

    run(cfg, Path(args.run_dir) if args.run_dir else None, args.resume)
