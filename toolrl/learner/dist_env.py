"""Who this learner process is among the ranks, from the environment its launcher gave it.

Launchers describe a rank in different words; this module reads them into one `DistEnv`, checks it,
and exports the variables torch.distributed (`env://`) and DeepSpeed read:

| launcher                  | rank         | world size           | local rank      | rendezvous                   |
|---------------------------|--------------|----------------------|-----------------|------------------------------|
| torchrun, deepspeed, any  | RANK         | WORLD_SIZE           | LOCAL_RANK      | MASTER_ADDR, MASTER_PORT     |
| Slurm `srun` (no RANK)    | SLURM_PROCID | SLURM_STEP_NUM_TASKS | SLURM_LOCALID   | MASTER_ADDR, else the first  |
|                           |              |                      |                 | host of SLURM_STEP_NODELIST; |
|                           |              |                      |                 | MASTER_PORT, else 29500      |
| none (`python learner.py`)| 0            | 1                    | 0               | 127.0.0.1, a free port       |

A RANK in the environment wins over Slurm's variables (torchrun started inside an srun step sets
it). Slurm's are read only inside an srun step (SLURM_STEP_NUM_TASKS set): a batch script's own
SLURM_NTASKS counts the job's tasks, not this process's peers. Ranks per node (torchrun's
LOCAL_WORLD_SIZE, deepspeed's LOCAL_SIZE, Slurm's SLURM_STEP_TASKS_PER_NODE) only decide
DeepSpeed's LOCAL_SIZE, which turns its shared-memory all-reduce on when every rank is on one node.
The node's rank (GROUP_RANK, CROSS_RANK, NODE_RANK or SLURM_NODEID) is for logs only.
"""
from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Mapping, MutableMapping

DEFAULT_PORT = 29500  # torch's and DeepSpeed's default rendezvous port


class DistEnvError(ValueError):
    """The launcher's environment does not describe a valid rank."""


@dataclass(frozen=True)
class DistEnv:
    rank: int  # global: 0 talks to the reference server and the workers
    world_size: int
    local_rank: int  # on this node: per-node files (/dev/shm) and the device
    master_addr: str
    master_port: int
    local_world_size: int | None = None  # ranks on this node, when the launcher says
    node_rank: int | None = None
    launcher: str = "env"  # torchrun | deepspeed | slurm | env | single

    def describe(self) -> str:
        node = "" if self.node_rank is None else f" node {self.node_rank}"
        return (f"rank {self.rank}/{self.world_size} (local {self.local_rank}{node}) via {self.launcher}, "
                f"rendezvous {self.master_addr}:{self.master_port}")


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise DistEnvError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistEnvError(f"{name}={raw!r} is not an integer") from None


def _opt_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            return _int(env, name)
    return None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[07-09,12],cpu3' -> 'gpu07' (zero padding kept)."""
    m = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise DistEnvError(f"cannot read a host from the Slurm node list {nodelist!r}")
    prefix, ranges = m[1], m[2]
    return prefix if ranges is None else prefix + re.split(r"[-,]", ranges)[0]


def _tasks_per_node(spec: str) -> int | None:
    """SLURM_STEP_TASKS_PER_NODE ('4(x2)', '4', '2,1'): the count when every node runs the same."""
    counts = {m[1] for m in re.finditer(r"(\d+)(?:\(x\d+\))?", spec)}
    return int(counts.pop()) if len(counts) == 1 else None


def read(env: Mapping[str, str] | None = None) -> DistEnv:
    """This process's place among the ranks (see the module's table); DistEnvError if it is inconsistent."""
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise DistEnvError(f"{missing[0]} is not set but {'WORLD_SIZE' if missing[0] == 'RANK' else 'RANK'} is: "
                               "a launcher sets both")
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK", 0 if world <= 1 else None)
        local_world = _opt_int(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE")
        node = _opt_int(env, "GROUP_RANK", "CROSS_RANK", "NODE_RANK")
        launcher = ("torchrun" if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env
                    else "deepspeed" if "CROSS_RANK" in env else "env")
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS")
        local = _int(env, "SLURM_LOCALID")
        local_world = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
        node = _opt_int(env, "SLURM_NODEID")
        launcher = "slurm"
        addr = env.get("MASTER_ADDR") or (first_host(env["SLURM_STEP_NODELIST"])
                                          if env.get("SLURM_STEP_NODELIST") else "")
        port = env.get("MASTER_PORT") or str(DEFAULT_PORT)
    else:
        rank, world, local, local_world, node, launcher = 0, 1, 0, None, None, "single"
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if world < 1:
        raise DistEnvError(f"world size {world} (from {launcher}'s environment) must be at least 1")
    if not 0 <= rank < world:
        raise DistEnvError(f"rank {rank} is outside the world of {world} ranks (0..{world - 1})")
    if local < 0:
        raise DistEnvError(f"local rank {local} is negative")
    if local_world is not None and not (local < local_world <= world):
        raise DistEnvError(f"local rank {local} with {local_world} ranks on this node in a world of {world}: "
                           "inconsistent")
    if world > 1 and not addr:
        hint = " or SLURM_STEP_NODELIST" if launcher == "slurm" else ""
        raise DistEnvError(f"MASTER_ADDR{hint} is not set: {world} ranks need the address of rank 0's node")
    if world > 1 and not port:
        raise DistEnvError(f"MASTER_PORT is not set: {world} ranks need the port of rank 0's rendezvous")
    if not port:  # one rank: its own rendezvous, on a port nothing else holds
        from toolrl.net import free_port  # lazy: this module is imported before anything heavy

        port = str(free_port())
    try:
        port_n = int(port)
    except ValueError:
        raise DistEnvError(f"MASTER_PORT={port!r} is not a port number") from None
    if not 0 < port_n < 65536:
        raise DistEnvError(f"MASTER_PORT={port_n} is not a port number")
    return DistEnv(rank=rank, world_size=world, local_rank=local, master_addr=addr or "127.0.0.1",
                   master_port=port_n, local_world_size=local_world, node_rank=node, launcher=launcher)


def export(d: DistEnv, env: MutableMapping[str, str] | None = None) -> None:
    """Write `d` as the variables torch.distributed's env:// and DeepSpeed read."""
    env = os.environ if env is None else env
    env.update(RANK=str(d.rank), WORLD_SIZE=str(d.world_size), LOCAL_RANK=str(d.local_rank),
               MASTER_ADDR=d.master_addr, MASTER_PORT=str(d.master_port))
    if d.local_world_size is not None:  # DeepSpeed's shm all-reduce: on only when LOCAL_SIZE == WORLD_SIZE
        env["LOCAL_SIZE"] = str(d.local_world_size)


def setup(env: MutableMapping[str, str] | None = None) -> DistEnv:
    """read() then export(): call before DeepSpeed initialises the process group."""
    d = read(env)
    export(d, env)
    return d


def check_shared_dir(path: str | Path, what: str = "checkpoint directory", wait_s: float = 5.0) -> None:
    """Every rank must see the files rank 0 writes under `path` (DeepSpeed's checkpoints: rank 0
    writes `latest` and the model states, each rank its own ZeRO shard, and a resume reads them
    all on every rank). Collective; a no-op with one rank. Raises DistEnvError on every rank,
    naming the ranks and hosts that cannot see it, when the directory is not shared."""
    import secrets

    import torch.distributed as dist  # lazy: read() and export() run before torch is imported

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = Path(path) / f".toolrl-shared-{token[0]}"
    if rank == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(socket.gethostname())
    dist.barrier()
    deadline = time.time() + wait_s  # a network filesystem may show a new file a moment late
    while not (seen := marker.exists()) and time.time() < deadline:
        time.sleep(0.2)
    views: list = [None] * world
    dist.all_gather_object(views, (rank, socket.gethostname(), seen))
    dist.barrier()
    if rank == 0:
        marker.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}" for r, host, ok in views if not ok]
    if blind:
        raise DistEnvError(f"the {what} {path} is not shared: {', '.join(blind)} cannot see a file rank 0 wrote "
                           "there. Learner ranks on several nodes need it on a filesystem every node mounts at "
                           "the same path (DeepSpeed's checkpoints are written and read by every rank)")


def collective_timeout(cfg, env: Mapping[str, str] | None = None) -> timedelta:
    """How long a rank waits in a collective: longer than rank 0 can work alone while the others
    wait in their next one. Rank 0 alone runs the held-out evaluation (up to 300 s to find a worker,
    then eval.timeout_s), waits for its batch (learner.batch_timeout_s) and pushes the weights
    (learner.sync_timeout_s a request, tried sync_retries + 1 times; a second round for workers that
    need them whole). DeepSpeed's default of 10 minutes ended every rank of a multi-rank run in the
    middle of a long evaluation (found in an audit). DEEPSPEED_TIMEOUT (minutes), when set, is the
    user's choice and wins. A rank that dies ends gloo's collectives at once (its sockets close);
    across nodes under NCCL, a dead or hung rank is seen only after this long."""
    env = os.environ if env is None else env
    if env.get("DEEPSPEED_TIMEOUT"):
        return timedelta(minutes=int(env["DEEPSPEED_TIMEOUT"]))
    alone = (min(300.0, cfg.eval.timeout_s) + cfg.eval.timeout_s + cfg.learner.batch_timeout_s
             + 2 * (cfg.learner.sync_retries + 1) * cfg.learner.sync_timeout_s)
    return timedelta(seconds=max(600.0, alone + 300.0))
