import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from toolrl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.model.name and cfg.learner.steps >= 0


def test_keys_other_services_rely_on():
    cfg = load_config(ROOT / "configs/cpu_tiny.yaml")
    assert cfg.executor.url.startswith("http://127.0.0.1")
    assert cfg.ref_server.url.startswith("http://127.0.0.1")
    assert cfg.model.name == "tiny-random"
    assert cfg.learner.steps == 3


def test_override_types_and_nesting():
    cfg = load_config(ROOT / "configs/cpu_tiny.yaml",
                      ["learner.lr=1e-6", "grpo.tis_cap=2", "learner.lora.enabled=true", "model.name=foo/bar",
                       "rewards.weights={correct: 1.0}"])
    assert cfg.learner.lr == pytest.approx(1e-6)
    assert cfg.grpo.tis_cap == 2.0
    assert cfg.learner.lora.enabled is True
    assert cfg.model.name == "foo/bar"
    assert cfg.rewards.weights == {"correct": 1.0}


@pytest.mark.parametrize("override, needle", [
    ("learner.lrr=1e-6", "unknown key 'learner.lrr'"),
    ("learner.grad_accum=4", "unknown key 'learner.grad_accum'"),  # never read, so removed
    ("nosuch.key=1", "unknown key 'nosuch'"),
    ("learner.steps=-3", "learner.steps=-3"),
    ("learner.steps=many", "learner.steps='many'"),
    ("grpo.loss_type=mean", "grpo.loss_type='mean'"),
    ("learner.sync_transport=nccl", "learner.sync_transport='nccl'"),  # it is process_group (NCCL on GPU)
    ("learner.lr", "expected key=value"),
    ("learner.lr.x=1", "learner.lr is not a section"),
])
def test_bad_override_is_one_clear_error(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/cpu_tiny.yaml", [override])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    bad.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_cross_field_check():
    with pytest.raises(ConfigError, match="data.level"):
        load_config(None, ["data.level=5", "data.max_level=2"])
    with pytest.raises(ConfigError, match=r"grpo.downsample_to \(4\) must be below rollout.group_size \(4\)"):
        load_config(None, ["grpo.downsample_to=4", "rollout.group_size=4"])
    with pytest.raises(ConfigError, match="downsample_to"):
        load_config(None, ["grpo.downsample_to=1", "rollout.group_size=4"])
    assert load_config(None, ["grpo.downsample_to=4", "rollout.group_size=8"]).grpo.downsample_to == 4
    with pytest.raises(ConfigError, match=r"rollout.max_total_tokens \(4096\) is above model.max_model_len \(2048\)"):
        load_config(None, ["rollout.max_total_tokens=4096", "model.max_model_len=2048"])
    with pytest.raises(ConfigError, match="eval.temperature 0 .greedy. gives every sample the same answer"):
        load_config(None, ["eval.temperature=0", "eval.samples=4"])
    assert load_config(None, ["eval.temperature=0"]).eval.temperature == 0
    with pytest.raises(ConfigError, match="eval.temperature"):
        load_config(None, ["eval.temperature=-0.5"])


def test_cli_print_and_error():
    ok = subprocess.run([sys.executable, "config.py", "--config", "configs/cpu_tiny.yaml", "--set", "learner.lr=3e-6",
                         "--print"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    printed = yaml.safe_load(ok.stdout)
    assert printed["learner"]["lr"] == pytest.approx(3e-6)
    assert printed["model"]["name"] == "tiny-random"
    bad = subprocess.run([sys.executable, "config.py", "--config", "configs/cpu_tiny.yaml", "--set", "learner.lrr=1",
                          "--print"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    lines = bad.stderr.strip().splitlines()
    assert lines == ["config error: unknown key 'learner.lrr' (value 1)"]
    assert bad.stdout == ""


def test_launch_placement():
    cfg = load_config(ROOT / "configs/gpu_qwen25_math_1p5b_gsm8k_8gpu.yaml")
    assert (cfg.launch.ref_gpu, cfg.launch.worker_gpus, cfg.launch.learner_gpus) == (0, [1, 2, 3], [4, 5, 6, 7])
    assert cfg.launch.workers == 3  # one per worker GPU when not given
    cfg = load_config(None, ["launch.worker_gpus=2,5", "launch.learner_gpus=0"])  # the flags' form
    assert cfg.launch.worker_gpus == [2, 5] and cfg.launch.learner_gpus == [0] and cfg.launch.workers == 2
    assert load_config(None).launch.workers == 1 and load_config(None).launch.worker_gpus == []
    # fewer workers than worker GPUs leaves the last ones idle (and free for others); more must share
    few = load_config(None, ["launch.worker_gpus=1,2,3", "launch.workers=1", "launch.learner_gpus=2"])
    assert few.launch.workers == 1
    with pytest.raises(ConfigError, match="launch.workers=4 but launch.worker_gpus lists only 3 GPUs"):
        load_config(None, ["launch.worker_gpus=1,2,3", "launch.workers=4"])
    shared = load_config(None, ["launch.worker_gpus=1,2,3", "launch.workers=4", "launch.share_gpus=true"])
    assert shared.launch.workers == 4
    with pytest.raises(ConfigError, match=r"GPU \[0\] is given to both the reference model and the learner"):
        load_config(None, ["launch.ref_gpu=0", "launch.learner_gpus=0,1"])
    shared = load_config(None, ["launch.ref_gpu=0", "launch.learner_gpus=0,1", "launch.share_gpus=true"])
    assert shared.launch.learner_gpus == [0, 1]
    # what launch.sh writes to RUN_DIR/config.yaml loads again unchanged
    again = load_config(None, [f"launch={yaml.safe_dump(cfg.launch.model_dump(), default_flow_style=True).strip()}"])
    assert again.launch == cfg.launch


def test_cli_get_for_shell():
    out = subprocess.run([sys.executable, "config.py", "--config", "configs/gpu_qwen25_math_1p5b_gsm8k_8gpu.yaml",
                          "--get", "launch.learner_gpus", "--get", "launch.ref_gpu", "--get", "rollout.port",
                          "--set", "launch.ref_gpu=null"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n") == ["4,5,6,7", "", "8300", ""]


def test_auto_dtype_is_bf16_only_where_the_machine_computes_it_natively():
    from toolrl.models import cpu_flags, cpu_has_bf16, native_bf16, resolve_dtype

    zen3 = "flags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n"
    zen4 = "flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 avx512_vnni\n"
    spr = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"
    assert [cpu_has_bf16(t) for t in (zen3, zen4, spr)] == [False, True, True]
    assert not cpu_has_bf16("flags : avx512_bf16x avx512bw")  # whole flags only
    assert [cpu_flags(t) for t in (zen3, zen4, spr)] == [["avx2"], ["avx2", "avx512f", "avx512_bf16"],
                                                        ["avx2", "avx512f", "amx_bf16"]]
    assert cpu_flags("flags : avx512fp16 avx2x") == []  # whole flags only
    for name in ("bfloat16", "float32", "float16"):
        assert resolve_dtype(name) == name
    assert resolve_dtype("auto") == ("bfloat16" if native_bf16() else "float32")
    for path in ("cpu_demo.yaml", "cpu_code.yaml"):  # the CPU recipes let the machine choose
        cfg = load_config(ROOT / "configs" / path)
        assert cfg.model.dtype == cfg.learner.dtype == "auto"


def test_tokens_come_from_the_environment_and_a_set_wins(monkeypatch):
    monkeypatch.setenv("TOOLRL_REF_SERVER_TOKEN", "from-env")
    monkeypatch.setenv("TOOLRL_EXECUTOR_TOKEN", "ex-env")
    cfg = load_config("configs/cpu_tiny.yaml", ["executor.token=from-set"])
    assert (cfg.ref_server.token, cfg.executor.token, cfg.rollout.token) == ("from-env", "from-set", None)


def test_tokens_never_reach_a_written_config():
    from toolrl.config import dump_config, redacted

    cfg = load_config("configs/cpu_tiny.yaml", ["executor.token=ex-secret", "rollout.token=ro-secret"])
    text = dump_config(cfg)
    assert "secret" not in text and text.count("token: '***'") == 2
    assert redacted(cfg)["ref_server"]["token"] is None and cfg.executor.token == "ex-secret"  # not changed


def test_setting_one_key_of_a_mapping_keeps_its_other_keys():
    """rewards.weights.correct=2 with no file (or a file without rewards.weights) replaced the whole
    default mapping with {correct: 2}, dropping format and tool."""
    assert load_config(None, ["rewards.weights.correct=2"]).rewards.weights == {"correct": 2.0, "format": 0.1,
                                                                              "tool": 0.1}
    assert load_config(None, ["rewards.weights={correct: 3}"]).rewards.weights == {"correct": 3.0}  # whole: as given


@pytest.mark.parametrize("bad", ["rewards.weights.correct=.nan", "grpo.beta=.inf", "learner.lr=nan",
                                 "rewards.schedule.format={start: 0, end: -.inf, steps: 3}"])
def test_nan_and_inf_are_refused(bad):
    """A NaN reward weight made every advantage NaN and every micro-batch's loss skipped without an
    error (found in review)."""
    with pytest.raises(ConfigError, match="finite number"):
        load_config("configs/cpu_tiny.yaml", [bad])


def test_a_runs_config_yaml_reads_back_with_its_tokens_from_the_environment(tmp_path, monkeypatch):
    """inference.py and evaluate.py answer with the run's own config (RUN_DIR/config.yaml: prompt,
    limits) for a run's export; its tokens were written as *** and must read back as unset, the
    environment's (tokens.env) taking their place (found in review: a code run's model was asked
    with the demo's arithmetic prompt)."""
    from toolrl.config import dump_config
    from toolrl.models import run_config

    cfg = load_config("configs/cpu_code.yaml", ["executor.token=s3cret", "rollout.token=r0ll"])
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg))
    assert "s3cret" not in (run / "config.yaml").read_text()
    assert run_config(str(run / "export")) == str(run / "config.yaml") and run_config(str(run)) is None
    monkeypatch.delenv("TOOLRL_EXECUTOR_TOKEN", raising=False)
    monkeypatch.setenv("TOOLRL_ROLLOUT_TOKEN", "from-env")
    back = load_config(run_config(str(run / "export")))
    assert back.executor.token is None and back.rollout.token == "from-env"
    assert back.prompt.system == cfg.prompt.system == "code" and back.rollout == cfg.rollout.model_copy(
        update={"token": "from-env"})


def test_sequence_mask_needs_an_upper_bound():
    """exp of a long sequence's summed log-ratio overflowed to inf: a loss of -inf, the micro-batch
    skipped, only a counter said so (found in review)."""
    sets = ["grpo.vllm_importance_sampling_correction=true", "grpo.vllm_importance_sampling_mode=sequence_mask",
            "grpo.vllm_importance_sampling_clip_min=0.5"]
    with pytest.raises(ConfigError, match="unbounded without it"):
        load_config("configs/cpu_tiny.yaml", [*sets, "grpo.vllm_importance_sampling_clip_max=null"])
    load_config("configs/cpu_tiny.yaml", [*sets, "grpo.vllm_importance_sampling_clip_max=3"])
    load_config("configs/cpu_tiny.yaml", [*sets[:2], "grpo.vllm_importance_sampling_mode=token_mask",
                                          "grpo.vllm_importance_sampling_clip_max=null", sets[2]])


def test_groups_of_one_cannot_train_grpo():
    """Every group of one has zero advantage: GRPO learned nothing, without a word (found in review)."""
    with pytest.raises(ConfigError, match="group_size 1 gives every group zero reward variance"):
        load_config("configs/cpu_tiny.yaml", ["rollout.group_size=1"])
    load_config("configs/cpu_tiny.yaml", ["rollout.group_size=1", "grpo.w_grpo=0", "grpo.w_teacher=1"])
