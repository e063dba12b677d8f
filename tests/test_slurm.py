"""configs/slurm.sbatch's dry run: each node's role and commands, with the config and launch.sh's
placement validated, without Slurm (nothing is started)."""
import os
import re
import subprocess

from procs import ROOT  # tests/ is on sys.path (conftest)


def dry_run(**env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TOOLRL_"))}
    full.update(env)
    return subprocess.run(["bash", "configs/slurm.sbatch", "--dry-run"], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=300)


def test_the_dry_run_gives_every_node_its_role():
    p = dry_run()
    assert p.returncode == 0, p.stderr
    out = p.stdout
    nodes = re.findall(r"^== (node-\d): (.*)$", out, re.M)
    assert nodes == [("node-0", "head (learner node 0)"), ("node-1", "learner node 1"),
                     ("node-2", "gen workers"), ("node-3", "gen workers")]
    head, learner1, workers = out.split("== node-1")[0], out.split("== node-1")[1].split("== node-2")[0], \
        out.split("== node-2")[1]
    # node 0: the reference server for every node (all interfaces, GPU 0), learner ranks on the rest
    assert re.search(r"ref_server\s+CUDA_VISIBLE_DEVICES=0 .* --host 0\.0\.0\.0", head)
    assert "--nnodes 2 --node_rank 0 --nproc_per_node 7 --master_addr node-0" in head
    assert "gen_worker" not in head and "learner.sync_fanout=2" in head  # one copy leaves node 0 per sync
    # node 1: as many learner ranks, meeting node 0
    assert "--nnodes 2 --node_rank 1 --nproc_per_node 7 --master_addr node-0" in learner1
    assert "ref_server.url=http://node-0:8200" in learner1 and "ref_server.py" not in learner1
    # worker nodes: an executor of their own, and one gen worker per GPU registered with node 0
    ids = re.findall(r"--worker-id (\S+)", workers)
    assert len(ids) == 16 and len(set(ids)) == 16
    assert workers.count("executor_service.py") == 2
    for line in workers.splitlines():
        if "gen_worker.py" in line:
            assert "ref_server.url=http://node-0:8200" in line and "executor.url=http://127.0.0.1:8100" in line
            gpu, port, host = re.search(r"CUDA_VISIBLE_DEVICES=(\d) .*--port (\d+) --public-url http://([\w-]+):\2",
                                        line).groups()
            assert int(port) == 8300 + int(gpu) and line.endswith(f"--worker-id {host}-{gpu}")


def test_the_reference_model_on_the_cpu_leaves_every_gpu_to_the_learner():
    p = dry_run(REF_GPU="", LEARNER_NODES="1")
    assert p.returncode == 0, p.stderr
    assert re.search(r'ref_server\s+CUDA_VISIBLE_DEVICES=""', p.stdout)
    assert "deepspeed --include localhost:0,1,2,3,4,5,6,7" in p.stdout  # one learner node: no torchrun
    assert len(re.findall(r"^== node-\d: gen workers$", p.stdout, re.M)) == 3


def test_reference_replicas_take_the_chosen_gpus_of_every_worker_node_behind_a_front():
    """REF_REPLICAS=0: GPU 0 of every worker node runs a reference replica of node 0's server instead
    of a gen worker; node 0's server becomes a front that loads no model, so its GPU goes to the learner."""
    p = dry_run(REF_REPLICAS="0")
    assert p.returncode == 0, p.stderr
    head, workers = p.stdout.split("== node-1")[0], p.stdout.split("== node-2")[1]
    assert re.search(r'ref_server\s+CUDA_VISIBLE_DEVICES="" .*--set ref_server\.local_reference=false', head)
    assert "--nproc_per_node 8" in head
    replicas = [line for line in workers.splitlines() if "ref_server.py" in line]
    assert len(replicas) == 2  # one on each worker node
    for line in replicas:
        assert re.search(r"^\s*CUDA_VISIBLE_DEVICES=0 \S+ ref_server\.py --replica-of http://node-0:8200 "
                         r"--replica-id node-[23]-ref0 .*--set ref_server\.device=cuda:0$", line), line
    gen = re.findall(r"CUDA_VISIBLE_DEVICES=(\d) \S+ gen_worker\.py", workers)
    assert sorted(gen) == sorted([str(g) for g in range(1, 8)] * 2)


def test_bad_settings_are_one_clear_error(tmp_path):
    p = dry_run(LEARNER_NODES="4")
    assert p.returncode == 2 and "at least one node must run gen workers" in p.stderr
    p = dry_run(REF_GPU="9")
    assert p.returncode == 2 and "REF_GPU '9'" in p.stderr
    p = dry_run(REF_REPLICAS="0", REF_GPU="0")  # a front loads no model: its GPU would sit idle
    assert p.returncode == 2 and "leave REF_GPU empty" in p.stderr
    p = dry_run(REF_REPLICAS="0,1,2,3,4,5,6,7")
    assert p.returncode == 2 and "leaves no GPU of a worker node to gen workers" in p.stderr
    beta0 = tmp_path / "beta0.yaml"
    beta0.write_text((ROOT / "configs/gpu_qwen25_math_1p5b_gsm8k_8gpu.yaml").read_text() + "\ngrpo:\n  beta: 0\n")
    p = dry_run(REF_REPLICAS="0", CONFIG=str(beta0))
    assert p.returncode == 2 and "beta 0 does not use" in p.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs/gpu_qwen25_math_1p5b_gsm8k_8gpu.yaml").read_text() + "\nrollout:\n  nonsense: 1\n")
    p = dry_run(CONFIG=str(bad))
    assert p.returncode != 0 and "nonsense" in p.stderr
