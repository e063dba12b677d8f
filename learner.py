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

Each step: wait for a batch from the reference server (catching late workers up meanwhile), one GRPO
step, every `sync_every` steps push the weights to all live workers and announce the new policy
version, every `checkpoint_every` steps save an exact-resume checkpoint. The loop reads top to
bottom in toolrl/learner/loop.py; the objective is toolrl/grpo.py.
"""
from toolrl.learner.main import main

if __name__ == "__main__":
    main()
