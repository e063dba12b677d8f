"""The DeepSpeed learner on the tiny model, in-process on DeepSpeed's CPU accelerator."""
import math
import random

import pytest
import torch

from toolrl.config import load_config
from toolrl.logprobs import sample_logprobs
from toolrl.models import resolve_model
from toolrl.protocol import Sample
from procs import free_port  # tests/ is on sys.path (conftest)


@pytest.fixture(scope="module", autouse=True)
def dist_env():
    import os

    port = free_port()
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def make_cfg(*extra):
    return load_config("configs/cpu_tiny.yaml", ["learner.lr=2e-3", "grpo.beta=0", "learner.dtype=float32",
                                                 "logging.wandb_mode=disabled", *extra])


def make_trainer(*extra):
    from toolrl.learner.trainer import Trainer

    return Trainer(make_cfg(*extra), resolve_model("tiny-random"))


def batch(seed=0, n_groups=2, group=4, on_policy_model=None, tool_tokens=3):
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        for i in range(group):
            n = rng.randint(6, 14)
            mask = [1] * n
            for j in range(2, min(n, 2 + tool_tokens)):  # a span of tool output
                mask[j] = 0
            adv = 1.0 if i % 2 else -1.0
            out.append(Sample(prompt_ids=[rng.randint(0, 2000) for _ in range(6)],
                              completion_ids=[rng.randint(0, 2000) for _ in range(n)], loss_mask=mask,
                              logprobs=[-10.0 if m else None for m in mask], rewards={"correct": float(i % 2)},
                              reward=float(i % 2), advantage=adv, group_id=f"g{seed}-{g}"))
    if on_policy_model is not None:  # behaviour logprobs = the model's own: ratio starts at 1
        lps = sample_logprobs(on_policy_model, out, temperature=1.0)
        out = [s.model_copy(update={"logprobs": [lp if m else None for lp, m in zip(row, s.loss_mask)]})
               for s, row in zip(out, lps)]
    return out


def test_steps_reduce_the_loss_on_a_fixed_batch():
    tr = make_trainer()
    b = batch(0, on_policy_model=tr.module)
    losses = [tr.train_step(b)["loss"] for _ in range(4)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 1e-3, losses
    assert tr.step == 4 and tr.skipped_steps == 0


def test_masked_positions_get_no_gradient():
    """A masked final token (tool output) is only ever a target, never context: if it got any
    gradient, changing it would change the step. It must not."""
    a = make_trainer()
    b1 = batch(1, on_policy_model=a.module)
    b1 = [s.model_copy(update={"loss_mask": s.loss_mask[:-1] + [0], "logprobs": s.logprobs[:-1] + [None]})
          for s in b1]
    m1 = a.train_step(b1)
    b = make_trainer()
    b2 = [s.model_copy(update={"completion_ids": s.completion_ids[:-1] + [(s.completion_ids[-1] + 7) % 2000]})
          for s in b1]
    m2 = b.train_step(b2)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
    # the weights after the step do not depend on the masked logprob values either
    for (n1, p1), (n2, p2) in zip(a.export_state(), b.export_state()):
        assert n1 == n2 and torch.allclose(p1, p2, atol=1e-6)


def test_nonfinite_loss_and_gradients_never_reach_the_weights():
    tr = make_trainer()
    before = [t.clone() for _, t in tr.export_state()]
    bad = [s.model_copy(update={"logprobs": [(-1e30 if lp is not None else None) for lp in s.logprobs]})
           for s in batch(2)]  # exp(logp + 1e30) overflows: the loss is inf
    m = tr.train_step(bad)
    assert m["skipped_micro_batches"] == m["micro_batches"] and m["step_applied"] == 0.0
    # a finite loss whose gradient is NaN: DeepSpeed's overflow check must skip the step
    p = tr.module.model.embed_tokens.weight
    h = p.register_hook(lambda g: g * float("nan"))
    try:
        m = tr.train_step(batch(3))
    finally:
        h.remove()
    assert m["step_applied"] == 0.0 and tr.skipped_steps == 2
    for t0, (_, t1) in zip(before, tr.export_state()):
        assert torch.equal(t0, t1)
    m = tr.train_step(batch(4))  # and it keeps training afterwards
    assert m["step_applied"] == 1.0


def test_resume_reproduces_the_next_step(tmp_path):
    a = make_trainer()
    a.train_step(batch(5))
    a.version = 3
    a.save_checkpoint(tmp_path)
    expected = a.train_step(batch(6))["loss"]
    b = make_trainer()
    assert b.load_checkpoint(tmp_path)
    assert (b.step, b.version) == (1, 3)
    assert b.train_step(batch(6))["loss"] == pytest.approx(expected, rel=1e-6)


def test_teacher_and_self_sft_terms():
    tr = make_trainer("grpo.w_teacher=0.5", "grpo.w_self=0.25")
    b = batch(7)
    teacher = b[0].model_copy(update={"source": "teacher", "group_id": "teacher-0"})
    m = tr.train_step(b + [teacher])
    assert m["sft_samples_teacher"] == 1
    assert m["sft_samples_self"] == 2  # one successful sample chosen per group
    assert m["loss_sft_teacher"] > 0 and m["loss_sft_self"] > 0
    assert m["loss"] == pytest.approx(m["loss_grpo"] + 0.5 * m["loss_sft_teacher"] + 0.25 * m["loss_sft_self"])


@pytest.mark.parametrize("loss_type", ["token", "sequence"])
def test_samples_with_no_loss_are_not_computed_and_the_step_is_unchanged(loss_type):
    """Policy samples with advantage 0 (no KL, no entropy term) and samples whose only role has
    weight 0 are left out of the forward/backward; the weights after the step are the same as when
    every sample is computed."""
    b = batch(8)
    b = [s.model_copy(update={"advantage": 0.0}) if i % 4 < 2 else s for i, s in enumerate(b)]
    b.append(b[1].model_copy(update={"source": "teacher", "group_id": "teacher-0"}))  # w_teacher 0: no role
    sets = (f"grpo.loss_type={loss_type}", "grpo.entropy_coef=0")
    a, full = make_trainer(*sets), make_trainer(*sets)
    full._contributes = lambda s, role: True
    ma, mf = a.train_step(b), full.train_step(b)
    assert ma["samples_no_signal"] == 5 and mf["samples_no_signal"] == 0
    assert ma["loss"] == pytest.approx(mf["loss"], rel=1e-5, abs=1e-7)
    for (n1, p1), (n2, p2) in zip(a.export_state(), full.export_state()):
        assert n1 == n2 and torch.allclose(p1, p2, atol=1e-6), n1
    assert not torch.equal(a.export_state()[0][1], make_trainer(*sets).export_state()[0][1])  # it did train


def test_lora_sync_merges_the_adapter(tmp_path):
    tr = make_trainer("learner.lora.enabled=true", "learner.lora.r=4")
    base = dict(make_trainer().export_state())
    for _ in range(2):
        tr.train_step(batch(8))
    merged = dict(tr.export_state())
    assert set(merged) == set(base)  # plain HF names: no lora_ tensors, no peft prefixes
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], base[q])  # the adapter is merged in
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    out = tr.export_hf(tmp_path / "export")
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.allclose(m.state_dict()[q], merged[q], atol=1e-6)


def test_time_budget_stops_before_a_step_that_would_overrun_it():
    from toolrl.learner.trainer import out_of_time

    assert not out_of_time(None, 1e9, 1e9)
    assert not out_of_time(600, 0, 0)  # the first step always runs
    assert not out_of_time(600, 400, 150)
    assert out_of_time(600, 500, 150)
    tr = make_trainer()
    assert tr.all_agree(True) and not tr.all_agree(False)  # one rank: its own answer


RANK_MAIN = """
import json, os, sys
sys.path[:0] = ["tests", "tests/learner"]
from test_trainer import batch, make_cfg
from toolrl.models import resolve_model
from toolrl.learner.trainer import Trainer

rank = int(os.environ["RANK"])
tr = Trainer(make_cfg("learner.micro_batch_tokens=64", "learner.zero_stage=2"), resolve_model("tiny-random"))
sig = lambda: [float(t.double().abs().sum()) for _, t in tr.export_state()]
before = sig()
m = [tr.train_step(batch(10 + rank, n_groups=1 if rank == 0 else 3)) for _ in range(2)]
print(json.dumps({"micro": [x["micro_batches"] for x in m], "applied": [x["step_applied"] for x in m],
                  "before": before, "after": sig()}))
"""


def test_two_ranks_with_unequal_micro_batches_step_together(tmp_path):
    """Two learner ranks (DeepSpeed ZeRO-2 over gloo) whose batches split into different numbers of
    micro-batches: ZeRO-2 reduces gradients inside every backward pass, so unequal counts pair
    mismatched collectives (without the padding a rank aborts). Both must finish, apply both steps,
    and agree on the weights."""
    import json
    import os
    import subprocess
    import sys

    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        with open(tmp_path / f"rank{rank}.out", "w") as out, open(tmp_path / f"rank{rank}.log", "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-c", RANK_MAIN], env=env, stdout=out, stderr=err))
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            p.kill()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.out").read_text().strip().splitlines()[-1]) for r in range(2))
    assert r0["micro"][0] < r1["micro"][0]  # the premise: rank 1 has more micro-batches
    assert r0["applied"] == r1["applied"] == [1.0, 1.0]
    assert r0["before"] == r1["before"] and r0["after"] != r0["before"]
    assert r0["after"] == pytest.approx(r1["after"], rel=1e-6)


def test_zero3_steps_as_zero2_does_and_exports_whole_weights():
    """ZeRO-3 partitions the parameters: a step must still match ZeRO-2's, and export_state (what a
    sync pushes and a checkpoint exports) must gather whole tensors, not a rank's empty shard."""
    a, b = make_trainer("learner.zero_stage=2"), make_trainer("learner.zero_stage=3")
    start = dict(a.export_state())
    fixed = batch(8, on_policy_model=a.module)
    la = [a.train_step(fixed)["loss"] for _ in range(2)]
    lb = [b.train_step(fixed)["loss"] for _ in range(2)]
    assert lb == pytest.approx(la, rel=1e-5)
    ea, eb = a.export_state(), b.export_state()
    assert [n for n, _ in ea] == [n for n, _ in eb]
    for (n, ta), (_, tb) in zip(ea, eb):
        assert ta.shape == tb.shape and ta.numel() > 0, n
        update = (ta - start[n]).abs().max().item()
        assert update > 1e-4, n  # every tensor moved...
        # ...by the same step: measured differences are at most 1% of the update (Adam divides
        # near-zero gradients, whose last bits differ between the stages' reduction orders)
        assert (ta - tb).abs().max().item() <= 0.05 * update, n
