"""launch.sh's placement of the five processes, checked with --dry-run (nothing is started).

The GPU runs themselves need a multi-GPU node; this checks what each process would be given:
CUDA_VISIBLE_DEVICES for the reference server and each gen worker, deepspeed's --include for the
learner, from the config's `launch` section or the flags that override it."""
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU8 = "configs/gpu_qwen25_math_1p5b_gsm8k_8gpu.yaml"


def launch(*args, run_dir=None, visible=None):
    """launch.sh with CUDA_VISIBLE_DEVICES unset, or set to `visible` (a scheduler's allocation)."""
    cmd = ["bash", "launch.sh", *args]
    if run_dir is not None:
        cmd += ["--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def plan(*args, tmp_path, visible=None):
    """{process: (its CUDA_VISIBLE_DEVICES, '""' for empty, or None for unset; command)} from a dry
    run; nothing may be created."""
    run_dir = tmp_path / "run"
    out = launch(*args, "--dry-run", run_dir=run_dir, visible=visible)
    assert out.returncode == 0, out.stderr
    assert not run_dir.exists(), "a dry run created the run directory"
    procs = {}
    for line in out.stdout.splitlines()[1:]:
        m = re.match(r"\s+(\S+)\s+(?:CUDA_VISIBLE_DEVICES=(\S+)|\(CUDA_VISIBLE_DEVICES unset\))\s+(.*)$", line)
        assert m, line
        procs[m[1]] = (m[2], m[3])
    return procs


def test_eight_gpu_config_places_each_process(tmp_path):
    p = plan("--config", GPU8, tmp_path=tmp_path)
    assert set(p) == {"executor", "ref_server", "gen_worker_0", "gen_worker_1", "gen_worker_2", "learner"}
    assert p["executor"][0] == '""'  # model-written code never gets a GPU
    assert p["ref_server"][0] == "0"
    assert [p[f"gen_worker_{i}"][0] for i in range(3)] == ["1", "2", "3"]
    gpus, cmd = p["learner"]
    # deepspeed --include counts physical GPUs and sets each rank's device itself
    assert gpus is None and "--include localhost:4,5,6,7" in cmd and "learner.py" in cmd
    assert [re.search(r"--port (\d+)", p[f"gen_worker_{i}"][1])[1] for i in range(3)] == ["8300", "8301", "8302"]


def test_flags_override_the_config(tmp_path):
    p = plan("--config", GPU8, "--ref-gpu", "7", "--worker-gpus", "0,1", "--learner-gpus", "2,3,4,5", tmp_path=tmp_path)
    assert p["ref_server"][0] == "7"
    assert sorted(k for k in p if k.startswith("gen_worker")) == ["gen_worker_0", "gen_worker_1"]
    assert (p["gen_worker_0"][0], p["gen_worker_1"][0]) == ("0", "1")
    assert "--include localhost:2,3,4,5" in p["learner"][1]
    # every process is told the same placement, so run-dir config.yaml records it
    assert all("launch.worker_gpus=0,1" in cmd for _, cmd in p.values())


def test_cpu_default_and_cpu_workers_pinned(tmp_path):
    p = plan(tmp_path=tmp_path)  # configs/cpu_demo.yaml
    assert set(p) == {"executor", "ref_server", "gen_worker_0", "learner"}
    assert p["executor"][0] == '""' and all(p[k][0] is None for k in ("ref_server", "gen_worker_0", "learner"))
    # one CPU rank runs as itself: no launcher processes (launch.learner_launcher=auto)
    assert "python -u learner.py " in p["learner"][1] and "deepspeed" not in p["learner"][1]
    p = plan("--set", "launch.learner_launcher=deepspeed", tmp_path=tmp_path)
    assert "/deepspeed --num_gpus 1 --master_port 9200 learner.py " in p["learner"][1]
    p = plan("--workers", "2", tmp_path=tmp_path)
    assert "rollout.cpu_threads_bind=0" in p["gen_worker_0"][1] and "rollout.cpu_threads_bind=1" in p["gen_worker_1"][1]


def test_shared_gpus_only_when_asked(tmp_path):
    out = launch("--config", GPU8, "--learner-gpus", "3,4", "--dry-run")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "config error: launch: GPU [3] is given to both the gen workers and the learner; "
        "set launch.share_gpus=true if they fit together"]
    assert out.stdout == ""
    p = plan("--config", GPU8, "--learner-gpus", "3,4", "--share-gpus", tmp_path=tmp_path)
    assert p["gen_worker_2"][0] == "3" and "--include localhost:3,4" in p["learner"][1]
    # more workers than GPUs: round robin, only with share_gpus
    p = plan("--config", GPU8, "--workers", "5", "--share-gpus", tmp_path=tmp_path)
    assert [p[f"gen_worker_{i}"][0] for i in range(5)] == ["1", "2", "3", "1", "2"]


@pytest.mark.parametrize("args, needle", [
    (["--worker-gpus", "a,b"], "launch.worker_gpus='a,b': expected GPU ids like 1,2,3"),
    (["--ref-gpu", "-1"], "launch.ref_gpu=-1"),
    (["--learner-gpus", "4,4"], "GPU ids must be distinct"),
    (["--workers", "4"], "launch.workers=4 but launch.worker_gpus lists only 3 GPUs"),
])
def test_bad_placement_is_one_clear_error(args, needle):
    out = launch("--config", GPU8, *args, "--dry-run")
    assert out.returncode == 2, out.stdout
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stdout == ""


def test_partial_placement_puts_the_rest_on_the_cpu(tmp_path):
    # once any GPU is placed, a process given none must not land on some GPU 0 by default
    p = plan("--config", GPU8, "--ref-gpu", "", "--workers", "1", tmp_path=tmp_path)
    assert p["ref_server"][0] == '""'
    assert [k for k in p if k.startswith("gen_worker")] == ["gen_worker_0"] and p["gen_worker_0"][0] == "1"
    # without any placement, processes keep the allocation they were given (one GPU node, no flags)
    p = plan("--workers", "2", tmp_path=tmp_path, visible="3")
    assert [p[k][0] for k in ("ref_server", "gen_worker_0", "gen_worker_1", "learner")] == ["3"] * 4
    assert p["executor"][0] == '""'


def test_gpus_that_are_not_there_are_refused(tmp_path):
    """A real (not dry) start must refuse GPUs the node lacks before it starts anything: with a
    stand-in nvidia-smi that lists two GPUs, and with none on the PATH."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Fake (UUID: GPU-a)'\necho 'GPU 1: Fake (UUID: GPU-b)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    no_smi = tmp_path / "empty"
    no_smi.mkdir()
    for path, args, needle in [
        (f"{fake}:/usr/bin:/bin", ["--worker-gpus", "1", "--learner-gpus", "2"],
         "GPU 2 is assigned but nvidia-smi -L lists 2 GPU(s)"),
        (f"{no_smi}:/usr/bin:/bin", ["--worker-gpus", "0"], "nvidia-smi is not found"),
    ]:
        if path.startswith(str(no_smi)) and any(Path(d, "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
            continue  # a GPU node: nvidia-smi is in the system directories
        run_dir = tmp_path / "run"
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"PATH": path}
        proc = subprocess.Popen(["bash", "launch.sh", *args, "--run-dir", str(run_dir)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:  # it started the system after all: its trap stops everything
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
        assert proc.returncode == 2 and needle in err, err
        assert not run_dir.exists()


def test_ids_count_within_an_allocation(tmp_path):
    # a batch scheduler gave this job GPUs 4-7: id i is its i-th GPU, for CUDA_VISIBLE_DEVICES and
    # for deepspeed's --include alike (deepspeed drops CUDA_VISIBLE_DEVICES when --include is given)
    p = plan("--config", GPU8, "--ref-gpu", "0", "--worker-gpus", "1", "--learner-gpus", "2,3",
             tmp_path=tmp_path, visible="4,5,6,7")
    assert (p["ref_server"][0], p["gen_worker_0"][0]) == ("4", "5")
    assert "--include localhost:6,7" in p["learner"][1]
    out = launch("--config", GPU8, "--dry-run", visible="4,5,6,7")  # the config wants 8
    assert out.returncode == 2
    assert "GPU 4 is assigned but CUDA_VISIBLE_DEVICES=4,5,6,7 lists 4 GPU(s)" in out.stderr
    out = launch("--worker-gpus", "0", "--dry-run", visible="")  # set but empty: no GPU at all
    assert out.returncode == 2 and "lists 0 GPU(s)" in out.stderr
    out = launch("--config", GPU8, "--ref-gpu", "0", "--worker-gpus", "1", "--learner-gpus", "1", "--share-gpus",
                 "--dry-run", visible="GPU-aa,GPU-bb")
    assert out.returncode == 2 and "deepspeed --include needs GPU indices" in out.stderr


def test_learner_ranks_on_several_nodes(tmp_path):
    """--nnodes 2: node 0 runs the whole system with its learner ranks under torchrun, its reference
    server listening beyond loopback; node 1 runs only its learner ranks, the same torchrun with
    --node_rank 1, pointed at node 0's reference server, with ref/worker GPUs left to node 0."""
    shared = str(tmp_path / "run")  # plan() passes it as --run-dir (on a shared filesystem, for real)
    multi = ["--nnodes", "2", "--master-addr", "10.0.0.1"]
    p0 = plan(*multi, "--node-rank", "0", tmp_path=tmp_path)
    assert set(p0) == {"executor", "ref_server", "gen_worker_0", "learner"}
    ref = p0["ref_server"][1].split()
    assert ref[ref.index("--host") + 1] == "0.0.0.0"  # node 1's ranks pull their batches from it
    torchrun = ["--nnodes 2", "--nproc_per_node 1", "--master_addr 10.0.0.1", "--master_port 9200"]
    learner0 = p0["learner"][1]
    assert "/torchrun " in learner0 and "deepspeed" not in learner0 and "--node_rank 0" in learner0
    assert all(t in learner0 for t in torchrun) and f"--run-dir {shared}" in learner0
    assert "ref_server.url=http://127.0.0.1:8200" in learner0
    p1 = plan(*multi, "--node-rank", "1", "--master-port", "9999", tmp_path=tmp_path)
    assert list(p1) == ["learner_node1"]  # its log: RUN_DIR/logs/learner_node1.log
    gpus, learner1 = p1["learner_node1"]
    assert gpus is None and "--node_rank 1" in learner1 and "--master_port 9999" in learner1
    assert "ref_server.url=http://10.0.0.1:8200" in learner1 and f"--run-dir {shared}" in learner1
    assert learner1.split("learner.py")[0].replace("--node_rank 1", "--node_rank 0").replace("9999", "9200") == \
        learner0.split("learner.py")[0]  # the same torchrun on both nodes, but for the node rank
    # GPUs: one rank per learner GPU, which torchrun's ranks see as their only GPUs; node 1 lends
    # none of its GPUs to a reference model or workers (node 0 runs those), so all 8 can learn
    p0 = plan("--config", GPU8, *multi, tmp_path=tmp_path)
    assert p0["learner"][0] == "4,5,6,7" and "--nproc_per_node 4" in p0["learner"][1]
    assert (p0["ref_server"][0], p0["gen_worker_0"][0]) == ("0", "1")
    p1 = plan("--config", GPU8, *multi, "--node-rank", "1", "--learner-gpus", "0,1,2,3,4,5,6,7", tmp_path=tmp_path)
    assert p1["learner_node1"][0] == "0,1,2,3,4,5,6,7" and "--nproc_per_node 8" in p1["learner_node1"][1]


@pytest.mark.parametrize("args, needle", [
    (["--nnodes", "2", "--run-dir", "/shared/run"], "--nnodes 2 needs --master-addr"),
    (["--nnodes", "2", "--master-addr", "n0"], "--nnodes 2 needs --run-dir, the same on every node"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "n0", "--run-dir", "/r"],
     "--node-rank '2': expected 0 to 1"),
    (["--nnodes", "0"], "--nnodes '0': expected a number of learner nodes"),
    (["--master-addr", "n0"], "--master-addr and --master-port are for learner ranks on several nodes"),
    (["--nnodes", "2", "--master-addr", "n0", "--run-dir", "/r", "--master-port", "65536"], "--master-port '65536'"),
])
def test_bad_multi_node_flags_are_one_clear_error(args, needle):
    out = launch(*args, "--dry-run")
    assert out.returncode == 2, out.stdout
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stdout == ""


def test_resume_needs_a_checkpoint_and_a_fresh_run_never_starts_over_one(tmp_path):
    """--resume without a checkpoint trained from step 0 without a word; a fresh run in a directory
    with a checkpoint deleted it at its first save (found in review). Refused before anything starts,
    by launch.sh and by the learner itself."""
    from toolrl.learner.loop import check_checkpoint_dir

    run_dir = tmp_path / "run"
    out = launch("--config", "configs/cpu_tiny.yaml", "--resume", "--dry-run", run_dir=run_dir)
    assert out.returncode == 2 and "holds no checkpoint" in out.stderr
    out = launch("--config", "configs/cpu_tiny.yaml", "--resume", "--dry-run")  # a new timestamped directory
    assert out.returncode == 2 and "holds no checkpoint" in out.stderr
    with pytest.raises(SystemExit, match="holds no checkpoint"):
        check_checkpoint_dir(run_dir / "checkpoints", resume=True)
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step000003")
    out = launch("--config", "configs/cpu_tiny.yaml", "--dry-run", run_dir=run_dir)
    assert out.returncode == 2 and "add --resume to continue it" in out.stderr
    with pytest.raises(SystemExit, match=r"holds a checkpoint \(step000003\)"):
        check_checkpoint_dir(run_dir / "checkpoints", resume=False)
    assert launch("--config", "configs/cpu_tiny.yaml", "--resume", "--dry-run", run_dir=run_dir).returncode == 0
    check_checkpoint_dir(run_dir / "checkpoints", resume=True)


def test_paths_are_read_from_where_the_command_was_given(tmp_path):
    """launch.sh runs from the repository, so `--config my.yaml --run-dir myrun` given elsewhere
    looked for the config in the repository and would have put the run there (found in review)."""
    (tmp_path / "my.yaml").write_text((ROOT / "configs" / "cpu_tiny.yaml").read_text())
    out = subprocess.run(["bash", str(ROOT / "launch.sh"), "--config", "my.yaml", "--run-dir", "myrun", "--dry-run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"run directory {tmp_path / 'myrun'}" in out.stdout and f"--config {tmp_path / 'my.yaml'}" in out.stdout
    out = subprocess.run(["bash", str(ROOT / "launch.sh"), "--config", "configs/cpu_tiny.yaml", "--dry-run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)  # the repository's own
    assert out.returncode == 0 and "--config configs/cpu_tiny.yaml" in out.stdout, out.stderr
