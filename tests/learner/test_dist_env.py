"""The launcher's environment read into one rank description (toolrl.learner.dist_env): torchrun,
DeepSpeed's launcher, Slurm's srun, or none; inconsistent ones refused with one clear line."""
import pytest

from toolrl.learner.dist_env import DistEnv, DistEnvError, collective_timeout, export, first_host, read, setup

TORCHRUN_NODE1 = {  # what torchrun --nnodes 2 --node_rank 1 --nproc_per_node 4 gives its second local rank
    "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "MASTER_ADDR": "node0", "MASTER_PORT": "9200", "TORCHELASTIC_RUN_ID": "none"}
SRUN_TASK = {  # srun --nodes 4 --ntasks-per-node 2: task 5, the second on the job's third node
    "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_STEP_NODELIST": "gpu[07-09,12]", "SLURM_NTASKS": "12"}


def test_torchrun_on_the_second_node():
    d = read(TORCHRUN_NODE1)
    assert d == DistEnv(rank=5, world_size=8, local_rank=1, master_addr="node0", master_port=9200,
                        local_world_size=4, node_rank=1, launcher="torchrun")


def test_deepspeeds_launcher():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    d = read(env)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size, d.node_rank, d.launcher) == (1, 2, 1, 2, 0,
                                                                                                 "deepspeed")


def test_an_srun_task_is_mapped_and_exported_for_env_rendezvous():
    env = dict(SRUN_TASK)
    d = setup(env)
    # the step's task count, not the job's (SLURM_NTASKS 12: the job also runs other steps)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size, d.node_rank) == (5, 8, 1, 2, 2)
    assert (d.master_addr, d.master_port, d.launcher) == ("gpu07", 29500, "slurm")  # the step's first node
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07", "MASTER_PORT": "29500",
        "LOCAL_SIZE": "2"}
    again = read(env)  # exported: a second read (another Trainer in the process) agrees
    assert (again.rank, again.world_size, again.local_rank, again.master_addr) == (5, 8, 1, "gpu07")
    # an explicit MASTER_ADDR/PORT wins over the node list
    d = read({**SRUN_TASK, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "7000"})
    assert (d.master_addr, d.master_port) == ("10.1.2.3", 7000)


def test_a_rank_set_by_a_launcher_wins_over_slurm():
    """torchrun started by srun (one task per node): torchrun's ranks, not the task's."""
    d = read({**SRUN_TASK, **TORCHRUN_NODE1})
    assert (d.rank, d.world_size, d.launcher) == (5, 8, "torchrun")
    d = read({**SRUN_TASK, **TORCHRUN_NODE1, "RANK": "6"})
    assert d.rank == 6


def test_no_launcher_is_one_rank():
    d = read({})
    assert (d.rank, d.world_size, d.local_rank, d.master_addr, d.launcher) == (0, 1, 0, "127.0.0.1", "single")
    assert 0 < d.master_port < 65536
    # a batch script's own environment (no srun step) is not a world of SLURM_NTASKS ranks
    d = read({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n[1-4]"})
    assert (d.rank, d.world_size, d.launcher) == (0, 1, "single")
    env = {"LOCAL_SIZE": "7"}
    export(read({}), env)  # ranks per node unknown: LOCAL_SIZE left alone, everything else written
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["LOCAL_SIZE"] == "7"


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[07-09,12]", "gpu07"), ("node3", "node3"), ("a-1,b-2", "a-1"), ("x[3,1]", "x3"),
    ("rack1-n[001-004],rack2-n[001-004]", "rack1-n001"), ("10.0.0.5", "10.0.0.5")])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     "rank 2 is outside the world of 2 ranks"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size 0"),
    ({"RANK": "-1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "rank -1"),
    ({"RANK": "0"}, "WORLD_SIZE is not set but RANK is"),
    ({"WORLD_SIZE": "2"}, "RANK is not set but WORLD_SIZE is"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "LOCAL_RANK is not set"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a"}, "MASTER_PORT is not set"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "99999"},
     "MASTER_PORT=99999 is not a port number"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "a",
      "MASTER_PORT": "1"}, "local rank 2 with 2 ranks on this node"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "a",
      "MASTER_PORT": "1"}, "4 ranks on this node in a world of 2"),
    ({k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_NODELIST"}, "MASTER_ADDR or SLURM_STEP_NODELIST"),
    ({k: v for k, v in SRUN_TASK.items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID is not set"),
    ({**SRUN_TASK, "SLURM_PROCID": "8"}, "rank 8 is outside the world of 8 ranks"),
])
def test_an_inconsistent_environment_is_one_clear_error(env, needle):
    with pytest.raises(DistEnvError) as e:
        setup(dict(env))
    assert needle in str(e.value), str(e.value)


def test_the_collective_timeout_covers_rank_0s_longest_work_alone_unless_the_user_set_one():
    from datetime import timedelta

    from toolrl.config import load_config

    cfg = load_config("configs/cpu_demo.yaml", ["eval.timeout_s=1800", "learner.batch_timeout_s=600",
                                                "learner.sync_timeout_s=120", "learner.sync_retries=3"])
    assert collective_timeout(cfg, env={}) == timedelta(seconds=300 + 1800 + 600 + 2 * 4 * 120 + 300)
    short = load_config("configs/cpu_demo.yaml", ["eval.timeout_s=10", "learner.batch_timeout_s=10",
                                                  "learner.sync_timeout_s=10", "learner.sync_retries=0"])
    assert collective_timeout(short, env={}) == timedelta(minutes=10)  # never below DeepSpeed's own
    assert collective_timeout(cfg, env={"DEEPSPEED_TIMEOUT": "45"}) == timedelta(minutes=45)
