"""Issue 25's GRPO proof: a warm start, then arm (a) teacher-SFT on the taught kinds only and arm (b)
GRPO on every kind, both from the warm start's weights at the same budget (configs/cpu_grpo_proof_*.yaml)."""
import itertools
import random
import re
from pathlib import Path

from toolrl.config import load_config
from toolrl.tasks import get_task, load_task, problem_stream
from toolrl.tasks.arithmetic import KIND_GROUPS, TAUGHT_KINDS

FREE = set(KIND_GROUPS["commas"])  # the proof's teacher-free kinds

ROOT = Path(__file__).resolve().parent.parent
CFG = {arm: ROOT / f"configs/cpu_grpo_proof_{arm}.yaml" for arm in ("warm", "sft", "grpo")}


def kinds_trained(cfg) -> set[str]:
    return {p.meta["kind"] for p in itertools.islice(problem_stream(cfg.data, "w0"), 70)}


def kinds_taught(cfg) -> set[str]:
    teach = get_task("arithmetic").teacher(cfg.teacher)
    probs = load_task("arithmetic:1-3@all", 50, 0, cfg.data)
    return {p.meta["kind"] for p in probs if teach(p, random.Random(0)) is not None}


def test_both_arms_start_from_the_warm_start_with_equal_budgets_and_one_held_out_set():
    warm, sft, grpo = (load_config(CFG[a]) for a in ("warm", "sft", "grpo"))
    run_dir = re.search(r"--config configs/cpu_grpo_proof_warm.yaml --run-dir (\S+)", CFG["warm"].read_text())[1]
    assert sft.model.name == grpo.model.name == f"{run_dir}/export"
    assert sft.learner.time_budget_s == grpo.learner.time_budget_s <= 1800 - 300  # start-up and evaluations on top
    assert sft.learner.steps * 25 > sft.learner.time_budget_s and grpo.learner.steps * 25 > grpo.learner.time_budget_s
    for section in ("eval", "prompt"):
        assert getattr(sft, section) == getattr(grpo, section) == getattr(warm, section)
    assert sft.data.eval_seed == grpo.data.eval_seed and sft.rollout.temperature == grpo.rollout.temperature
    held_out = load_task(sft.eval.task, sft.eval.n_problems, 0, sft.data)
    assert {p.meta["kind"] for p in held_out} == set(TAUGHT_KINDS[:3]) | FREE
    for arm in ("sft", "grpo"):  # one documented command each
        assert f"./launch.sh --config configs/cpu_grpo_proof_{arm}.yaml --run-dir " in CFG[arm].read_text()
        assert "--set data.seed=N" in CFG[arm].read_text()


def test_only_arm_b_ever_trains_on_the_teacher_free_kinds_and_never_from_the_teacher():
    warm, sft, grpo = (load_config(CFG[a]) for a in ("warm", "sft", "grpo"))
    taught_here = set(TAUGHT_KINDS[:3])  # levels 1-3
    for cfg in (warm, sft):  # teacher-SFT only, on the taught kinds: the policy's own samples carry no loss
        assert kinds_trained(cfg) == kinds_taught(cfg) == taught_here
        assert cfg.grpo.w_grpo == cfg.grpo.w_self == cfg.grpo.beta == cfg.grpo.entropy_coef == 0
    assert kinds_trained(grpo) == taught_here | FREE and grpo.grpo.w_grpo > 0
    assert kinds_taught(grpo) == taught_here
