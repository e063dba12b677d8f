"""The DeepSpeed learner on the tiny model, in-process on DeepSpeed's CPU accelerator."""
import math
import random
from datetime import timedelta

import pytest
import torch

from toolrl.config import load_config
from toolrl.learner.dist_env import collective_timeout
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
    # its process group's collectives outwait what rank 0 does alone (the held-out evaluation, 30 min
    # by default, while the other ranks wait): DeepSpeed's 10-minute default ended every rank
    gloo = torch.distributed.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert gloo.options._timeout == collective_timeout(make_cfg(), env={}) > timedelta(minutes=30)
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


def test_a_nonfinite_last_micro_batch_is_skipped_and_the_rest_of_the_step_applies():
    """ZeRO-2 reduces gradients only in the accumulation boundary's backward: when the micro-batch
    skipped is the last, the step must still apply the others', exactly as if the bad group had
    carried no signal (counted in the normalisers, never run)."""
    from toolrl.learner.batching import micro_batches

    def group(gid, n, seed, logprob=-8.0, advantage=1.0):
        rng = random.Random(seed)
        prompt = [rng.randint(0, 2000) for _ in range(6)]
        return [Sample(prompt_ids=prompt, completion_ids=[rng.randint(0, 2000) for _ in range(n)], loss_mask=[1] * n,
                       logprobs=[logprob] * n, rewards={"correct": float(i)}, reward=float(i),
                       advantage=advantage * (1 if i else -1), group_id=gid) for i in range(2)]
    good = group("a", 8, 1)
    bad = group("b", 20, 2, logprob=-1e30)  # exp(logp + 1e30) overflows: this micro-batch's loss is inf
    silent = group("b", 20, 2, advantage=0.0)
    sets = ("learner.micro_batch_tokens=64", "learner.zero_stage=2", "grpo.entropy_coef=0")
    assert [[s.group_id for s in mb] for mb in micro_batches(good + bad, 64, True)] == [["a", "a"], ["b", "b"]]
    x, y = make_trainer(*sets), make_trainer(*sets)
    mx, my = x.train_step(good + bad), y.train_step(good + silent)
    assert (mx["skipped_micro_batches"], mx["step_applied"], my["step_applied"]) == (1, 1.0, 1.0)
    for (n1, p1), (n2, p2) in zip(x.export_state(), y.export_state()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_a_grad_norm_deepspeed_did_not_measure_is_nan_not_zero():
    m = make_trainer("learner.zero_stage=0").train_step(batch(9))  # ZeRO-0 in fp32: not measured
    assert m["step_applied"] == 1.0 and math.isnan(m["grad_norm"])


def test_resume_reproduces_the_next_step(tmp_path):
    a = make_trainer()
    a.train_step(batch(5))
    a.version = 3
    a.save_checkpoint(tmp_path)
    expected = a.train_step(batch(6))["loss"]
    b = make_trainer()
    assert b.load_checkpoint(tmp_path) is not None
    assert (b.step, b.version) == (1, 3)
    assert b.train_step(batch(6))["loss"] == pytest.approx(expected, rel=1e-6)


def test_only_the_newest_checkpoints_are_kept(tmp_path, capsys):
    """learner.keep_checkpoints: older checkpoints are deleted once a new one is written, and the
    newest still resumes."""
    tr = make_trainer("learner.keep_checkpoints=2")
    for i in range(3):
        tr.train_step(batch(i))
        tr.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step000002", "step000003"]
    assert (tmp_path / "latest").read_text().strip() == "step000003"
    assert make_trainer().load_checkpoint(tmp_path) is not None
    # one that cannot be deleted (a link: rmtree refuses to follow it) is reported, and the run goes on
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.txt").write_text("x")
    (tmp_path / "step000000").symlink_to(tmp_path / "elsewhere")
    capsys.readouterr()
    tr.train_step(batch(3))
    tr.save_checkpoint(tmp_path)
    assert "could not delete the old checkpoint" in capsys.readouterr().out
    assert (tmp_path / "elsewhere" / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step000000", "step000003", "step000004"]
    every = make_trainer("learner.keep_checkpoints=null")
    for i in range(3):
        every.train_step(batch(i))
        every.save_checkpoint(tmp_path / "all")
    assert len(list((tmp_path / "all").glob("step*"))) == 3
    one = make_trainer("learner.keep_checkpoints=1")  # the demo's: only the newest, and it resumes
    for i in range(2):
        one.train_step(batch(i))
        one.save_checkpoint(tmp_path / "one")
    assert [p.name for p in (tmp_path / "one").glob("step*")] == ["step000002"]
    assert make_trainer().load_checkpoint(tmp_path / "one") is not None


def state_of(tr):
    """Weights, Adam's moments and the LR: everything a step depends on besides the data."""
    opt = tr.engine.optimizer.optimizer if hasattr(tr.engine.optimizer, "optimizer") else tr.engine.optimizer
    moments = [v.detach().clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return dict(tr.export_state()), moments, tr.lr()


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """fp32 on CPU: stopped at step 2 and resumed, a run is the uninterrupted run at step 4: the
    weights, the optimizer's moments, the LR schedule's position (warmup then cosine decay) and the
    teacher weight's decay, which the loop keeps in the checkpoint's run state."""
    from toolrl.learner.schedules import TeacherWeight
    from toolrl.metrics import batch_stats

    sets = ("learner.steps=4", "learner.warmup_steps=2", "learner.lr_schedule=cosine", "grpo.w_teacher=1.0",
            "teacher.decay_at_accuracy=0.8")
    data = [batch(20 + i) for i in range(4)]
    data = [b + [b[1].model_copy(update={"source": "teacher", "group_id": f"t{i}"})] for i, b in enumerate(data)]

    def steps(tr, tw, bs):
        out = []
        for b in bs:
            out.append(tw.value)
            tr.train_step(b, w_teacher=tw.value)
            tw.update(batch_stats(b, 0)["accuracy"])
        return out

    a = make_trainer(*sets)
    tw_a = TeacherWeight(a.cfg)
    weights_a = steps(a, tw_a, data)
    first = make_trainer(*sets)
    tw_first = TeacherWeight(first.cfg)
    steps(first, tw_first, data[:2])
    first.save_checkpoint(tmp_path, {"teacher_weight": tw_first.state_dict(), "train_elapsed_s": 12.5})
    resumed = make_trainer(*sets)
    run_state = resumed.load_checkpoint(tmp_path)
    assert resumed.step == 2 and run_state["train_elapsed_s"] == 12.5
    tw_r = TeacherWeight(resumed.cfg)
    tw_r.load_state_dict(run_state["teacher_weight"])
    assert steps(resumed, tw_r, data[2:]) == weights_a[2:] and weights_a[2] < 1.0  # the decay went on
    (wa, ma, lra), (wr, mr, lrr) = state_of(a), state_of(resumed)
    assert lra == lrr and len(ma) == len(mr) > 0
    for n in wa:
        assert torch.allclose(wa[n], wr[n], rtol=0, atol=1e-6), n
    for x, y in zip(ma, mr):
        assert torch.allclose(x, y, rtol=0, atol=1e-6)


def test_the_lr_decay_can_span_the_time_budget():
    """lr_decay_over "time": progress is the larger of steps done and the budget's fraction used, and
    the step after set_time_used trains at that LR (Adam's first update moves a weight by the LR)."""
    from toolrl.config import ConfigError
    from toolrl.learner.schedules import lr_lambda

    sets = ("learner.steps=100", "learner.lr_schedule=linear", "learner.time_budget_s=100",
            "learner.lr_decay_over=time")
    used = [0.0]
    f = lr_lambda(make_cfg(*sets), lambda: used[0])
    assert f(10) == pytest.approx(0.9)  # steps ahead of time
    used[0] = 0.5
    assert f(10) == pytest.approx(0.5) and f(60) == pytest.approx(0.4)
    used[0] = 1.2
    assert f(10) == 0.0  # past the budget: the decay is over, never negative
    assert lr_lambda(make_cfg(*sets[:-1]), lambda: 0.5)(10) == pytest.approx(0.9)  # over steps: time ignored
    with pytest.raises(ConfigError, match="needs learner.time_budget_s"):
        make_cfg("learner.lr_decay_over=time")
    tr = make_trainer(*sets)
    before = {n: p.detach().clone() for n, p in tr.module.named_parameters()}
    tr.set_time_used(0.75)
    out = tr.train_step(batch(40))
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in tr.module.named_parameters())
    assert moved == pytest.approx(2e-3 * 0.25, rel=1e-2) and out["lr"] == pytest.approx(2e-3 * 0.25)


def test_the_teacher_weight_decays_with_the_accuracy_ema():
    from toolrl.learner.schedules import TeacherWeight

    tw = TeacherWeight(make_cfg("grpo.w_teacher=0.5", "teacher.decay_at_accuracy=0.8", "teacher.ema=0.5"))
    assert tw.value == 0.5  # no accuracy seen yet
    tw.update(0.4)
    assert tw.value == pytest.approx(0.5 * (1 - 0.4 / 0.8))
    tw.update(0.8)  # ema 0.5 * 0.4 + 0.5 * 0.8 = 0.6
    assert tw.value == pytest.approx(0.5 * (1 - 0.6 / 0.8))
    tw.update(1.0)
    tw.update(1.0)
    assert tw.value == 0.0  # past decay_at_accuracy: never negative
    again = TeacherWeight(tw_cfg := make_cfg("grpo.w_teacher=0.5", "teacher.decay_at_accuracy=null"))
    again.update(1.0)
    assert again.value == 0.5 and tw_cfg.teacher.decay_at_accuracy is None  # no decay configured


def test_the_lr_schedule_warms_up_then_decays_per_learner_step():
    from toolrl.learner.schedules import lr_lambda

    cfg = make_cfg("learner.steps=10", "learner.warmup_steps=2", "learner.lr_schedule=cosine")
    f = lr_lambda(cfg)
    assert [f(s) for s in range(3)] == pytest.approx([0.5, 1.0, 1.0])
    assert f(6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))  # half way through the decay
    assert f(10) == pytest.approx(0.0, abs=1e-12)
    lin = lr_lambda(make_cfg("learner.steps=10", "learner.lr_schedule=linear"))
    assert [lin(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    # a batch of two updates in two mini-batches takes four optimizer steps, all at its step's LR
    four = lr_lambda(make_cfg("learner.steps=10", "learner.warmup_steps=2", "grpo.updates_per_batch=2",
                              "grpo.mini_batches=2"))
    assert [four(s) for s in range(9)] == pytest.approx([0.5] * 4 + [1.0] * 5)
    tr = make_trainer("learner.steps=10", "learner.warmup_steps=2", "grpo.updates_per_batch=2")
    lrs = [tr.train_step(batch(30 + i))["lr"] for i in range(3)]
    assert lrs == pytest.approx([1e-3, 2e-3, 2e-3])  # the LR each batch trained at: warmup 1/2, then 2/2
    # a batch of one group makes one mini-batch, not grpo.mini_batches: the schedule still counts batches
    tr = make_trainer("learner.steps=10", "learner.warmup_steps=4", "grpo.mini_batches=2")
    lrs = [tr.train_step(batch(40 + i, n_groups=1))["lr"] for i in range(4)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1.5e-3, 2e-3])


def test_a_step_raises_positive_advantage_tokens_and_lowers_negative_ones():
    """One real step, GRPO alone, on-policy: every sample's generated tokens become more likely where
    its advantage is positive and less likely where it is negative (a flipped sign fails this)."""
    tr = make_trainer("learner.lr=1e-3")
    b = batch(40, on_policy_model=tr.module)
    before = sample_logprobs(tr.module, b, temperature=1.0)
    tr.train_step(b)
    after = sample_logprobs(tr.module, b, temperature=1.0)
    for s, x, y in zip(b, before, after):
        gen = [i for i, m in enumerate(s.loss_mask) if m]
        change = sum(y[i] - x[i] for i in gen)
        assert change * s.advantage > 0, (s.advantage, change)


def test_the_entropy_bonus_raises_entropy():
    """With zero advantages the only gradient is the entropy term's: a step must raise the mean
    entropy of the sampled positions (a reversed sign lowers it)."""
    def entropy_after(coef):
        tr = make_trainer("learner.lr=1e-2", f"grpo.entropy_coef={coef}")
        b = [s.model_copy(update={"advantage": 0.0}) for s in batch(41, on_policy_model=tr.module)]
        first = tr.train_step(b)["entropy"]
        return first, tr.train_step(b)["entropy"]

    e0, e1 = entropy_after(0.5)
    assert e1 > e0 + 1e-4


def test_the_first_on_policy_step_has_ratio_one_in_fp32():
    tr = make_trainer()
    m = tr.train_step(batch(42, on_policy_model=tr.module))
    assert abs(m["ratio_max"] - 1) < 1e-4 and abs(m["ratio_min"] - 1) < 1e-4 and m["clip_frac"] == 0.0


def test_several_updates_per_batch_clip_against_pi_old():
    """updates_per_batch 2 with tis_cap: two optimizer steps on the batch; the first is the single-
    update step (ratio 1 against pi_old, which equals the current weights), the second is taken
    against pi_old kept from the first (ratios move, and clip-higher can act)."""
    one = make_trainer("grpo.tis_cap=2.0", "learner.lr=5e-2")
    two = make_trainer("grpo.tis_cap=2.0", "learner.lr=5e-2", "grpo.updates_per_batch=2")
    b = batch(43, on_policy_model=one.module)
    m1, m2 = one.train_step(b), two.train_step(b)
    assert m1["optimizer_steps"] == 1 and m2["optimizer_steps"] == 2
    assert m1["ratio_min"] == pytest.approx(1.0, abs=1e-5) and m1["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert m1["clip_frac"] == 0.0
    assert m2["ratio_max"] > 1.01 and m2["ratio_min"] < 0.99 and m2["clip_frac"] > 0


@pytest.mark.parametrize("mode", [[], ["grpo.tis_cap=2.0"]], ids=["no-correction", "tis"])
def test_the_first_of_several_updates_is_the_one_update_step_exactly_and_costs_no_extra_pass(mode):
    """The first optimizer step of updates_per_batch 2 is bit for bit the step of updates_per_batch 1,
    and a 2-update step runs exactly twice the forwards of a 1-update step: pi_old comes from the
    first update's own forward, never from a pass of its own (bench/learner.py's
    second_update_ratio rests on this)."""
    one = make_trainer(*mode, "learner.lr=5e-2")
    two = make_trainer(*mode, "learner.lr=5e-2", "grpo.updates_per_batch=2")
    b = batch(47, on_policy_model=one.module)
    forwards = {id(one): 0, id(two): 0}
    first: dict = {}
    for tr in (one, two):
        logprobs, step = tr._logprobs, tr._optimizer_step

        def counted(*a, _tr=tr, _f=logprobs):
            forwards[id(_tr)] += 1
            return _f(*a)

        def stepped(*a, _tr=tr, _f=step):
            _f(*a)
            if _tr is two and not first:
                first.update({n: t.clone() for n, t in two.export_state()})

        tr._logprobs, tr._optimizer_step = counted, stepped
    m1, m2 = one.train_step(b), two.train_step(b)
    assert m1["optimizer_steps"] == 1 and m2["optimizer_steps"] == 2
    assert forwards[id(one)] >= 1 and forwards[id(two)] == 2 * forwards[id(one)]
    after_one = dict(one.export_state())
    assert first.keys() == after_one.keys()
    for n, t in after_one.items():
        assert torch.equal(first[n], t), n


def test_mini_batches_take_pi_old_from_before_the_first_update():
    """Two mini-batches in one update: the second mini-batch's ratios are against the weights before
    the first mini-batch's step (so they already move), not against the weights it meets."""
    tr = make_trainer("grpo.tis_cap=2.0", "learner.lr=5e-2", "grpo.mini_batches=2")
    m = tr.train_step(batch(44, n_groups=2, on_policy_model=tr.module))
    assert m["optimizer_steps"] == 2 and (m["ratio_max"] > 1.0 + 1e-3 or m["ratio_min"] < 1.0 - 1e-3)


def test_overlong_filtering_leaves_truncated_samples_out_of_the_grpo_term():
    b = batch(45)
    cut = [s.model_copy(update={"stop_reason": "length"}) if i % 4 == 0 else s for i, s in enumerate(b)]
    a, kept = make_trainer("grpo.mask_truncated=true"), make_trainer("grpo.mask_truncated=true")
    m = a.train_step(cut)
    kept.train_step([s for i, s in enumerate(b) if i % 4 != 0])  # the same step without them
    assert m["truncated_masked"] == 2
    wa, wk = dict(a.export_state()), dict(kept.export_state())
    for n in wa:
        assert torch.allclose(wa[n], wk[n], rtol=0, atol=1e-6), n


def test_dynamic_sampling_keeps_only_groups_with_signal():
    from toolrl.learner.batching import with_signal

    b = batch(46, n_groups=3)
    flat = [s.model_copy(update={"reward": 1.0}) if s.group_id.endswith("-1") else s for s in b]
    teacher = flat[4].model_copy(update={"source": "teacher"})  # of the flat group: kept for its SFT term
    kept, dropped = with_signal(flat + [teacher])
    assert dropped == 4 and {s.group_id for s in kept if s.source == "policy"} == {b[0].group_id, b[8].group_id}
    assert teacher in kept


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


def test_lora_syncs_leave_the_frozen_base_weights_exactly_as_they_were_in_bf16():
    """PEFT's merge_adapter/unmerge_adapter in place, in bf16, moved the base weights at every sync."""
    tr = make_trainer("learner.lora.enabled=true", "learner.lora.r=4", "learner.dtype=bfloat16", "learner.lr=2e-2")
    q = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    frozen = tr.module.state_dict()[q].clone()
    assert frozen.dtype == torch.bfloat16
    for i in range(3):
        tr.train_step(batch(20 + i))
        merged = dict(tr.export_state())
    assert torch.equal(tr.module.state_dict()[q], frozen)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], frozen)  # the adapter is in the export


def test_time_budget_stops_before_a_step_that_would_overrun_it():
    from toolrl.learner.schedules import out_of_time

    assert not out_of_time(None, 1e9, 1e9)
    assert not out_of_time(600, 0, 0)  # the first step always runs
    assert not out_of_time(600, 400, 150)
    assert out_of_time(600, 500, 150)
    # learner.run_budget_s: the final evaluation's time after the step counts too
    assert not out_of_time(600, 300, 150, after_s=150) and out_of_time(600, 300, 150, after_s=151)
    tr = make_trainer()
    assert tr.all_agree(True) and not tr.all_agree(False)  # one rank: its own answer


RANK_MAIN = """
import json, os, sys
from pathlib import Path
sys.path[:0] = [os.getcwd(), "tests", "tests/learner"]  # the script lies elsewhere: this checkout first
from safetensors.torch import save_file
from test_trainer import batch, make_cfg
from toolrl.models import resolve_model
from toolrl.learner.dist_env import DistEnvError, check_shared_dir
from toolrl.learner.trainer import Trainer

out = Path(sys.argv[1])
tr = Trainer(make_cfg("learner.micro_batch_tokens=64", "learner.zero_stage=2"), resolve_model("tiny-random"))
rank = tr.rank
sig = lambda: [float(t.double().abs().sum()) for _, t in tr.export_state()]
before = sig()
shares = [batch(10 + 10 * s + rank, n_groups=1 if rank == 0 else 3) for s in range(2)]
m = [tr.train_step(b) for b in shares]
from toolrl.learner.loop import whole_batch
whole = whole_batch(shares[-1], tr.world_size)  # what rank 0 logs: every rank's samples
if rank == 0:
    save_file(dict(tr.export_state()), str(out / "weights.safetensors"))
acc = 0.25 if rank == 0 else 0.75
check_shared_dir(out / "shared")  # one machine: every rank sees it
try:
    check_shared_dir(out / f"own{rank}", wait_s=0.5)  # as if each rank had its own disk
    blind = None
except DistEnvError as exc:
    blind = str(exc)
d = tr.dist
(out / f"rank{rank}.json").write_text(json.dumps({
    "micro": [x["micro_batches"] for x in m], "applied": [x["step_applied"] for x in m],
    "loss": [x["loss"] for x in m], "tokens": [x["train_tokens"] for x in m], "entropy": [x["entropy"] for x in m],
    "before": before, "after": sig(),
    "mean_acc": tr.all_mean(acc, 4 if rank == 0 else 12), "blind": blind, "seen": tr.samples_seen,
    "whole": sorted({s.group_id for s in whole}),
    "dist": [d.rank, d.world_size, d.local_rank, d.local_world_size, d.node_rank, d.launcher,
             os.environ["LOCAL_SIZE"]]}))
tr.close()
"""


def launch_ranks(out, nnodes: int, script: str = RANK_MAIN, timeout_s: float = 300) -> dict[int, dict]:
    """Two learner ranks (gloo) started the way a cluster starts them: one torchrun with both ranks
    (nnodes=1), or two torchruns of one rank each with --node_rank 0 and 1 meeting at 127.0.0.1
    (nnodes=2, two "nodes" on this machine), each running `script` with `out` as its argument.
    Each rank's report (out/rank{r}.json) by rank. RANK_MAIN (ZeRO-2) also writes
    out/weights.safetensors on rank 0."""
    import json
    import os
    import re
    import subprocess
    import sys

    from procs import ROOT

    out.mkdir(parents=True, exist_ok=True)
    main = out / "rank_main.py"
    main.write_text(script)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node",
                str(2 // nnodes), "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a native abort prints each thread's Python stack into the log
    for attempt in (1, 2):
        procs = []
        for node in range(nnodes):
            with open(out / f"node{node}.log", "w") as log:
                procs.append(subprocess.Popen([*torchrun, "--node_rank", str(node), str(main), str(out)], cwd=ROOT,
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            for p in procs:
                p.wait(timeout=timeout_s)
        finally:  # torchrun stops its ranks on SIGTERM (they run in sessions of their own: a kill orphans them)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
        logs = [(out / f"node{node}.log").read_text() for node in range(nnodes)]
        # One retry, only when the first rank to fail died natively (abort, segfault, bus error): a
        # rank died of signal 6 on a CI machine once in ~30 suites (the kept log did not say where).
        # A Python error or a wrong value fails at once, and so does a native crash that repeats.
        crashed = [re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", log, re.S) for log in logs]
        if attempt == 1 and any(m and m.group(1) in ("-6", "-7", "-11") for m in crashed):
            print("a rank crashed natively; launching once more. The first attempt's logs:\n" + "\n".join(logs))
            torchrun[torchrun.index("--master_port") + 1] = str(free_port())
            continue
        break
    for node, p in enumerate(procs):
        assert p.returncode == 0, logs[node][-6000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}


@pytest.fixture(scope="module")
def one_node_two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_node")
    return launch_ranks(out, nnodes=1), out / "weights.safetensors"


@pytest.mark.serial  # two ranks, a core each: 44 s alone, 88 s beside two busy cores
def test_two_ranks_with_unequal_shares_step_as_one_rank_on_the_whole_batch(one_node_two_ranks):
    """Two learner ranks on one node, one with 1 group and one with 3, so their shares differ in
    samples, tokens and micro-batches: both must finish and apply both steps (ZeRO-2 reduces inside
    every backward, so unequal micro-batch counts are padded), and the weights must be those of one
    rank stepping on the whole batch: the loss is normalised by the whole batch's counts, not
    averaged over the ranks' own means. The teacher weight's accuracy is agreed the same way."""
    from safetensors.torch import load_file

    (r0, r1), weights = one_node_two_ranks[0].values(), one_node_two_ranks[1]
    assert r0["applied"] == r1["applied"] == [1.0, 1.0]
    assert r0["before"] == r1["before"] and r0["after"] != r0["before"]
    assert r0["after"] == pytest.approx(r1["after"], rel=1e-6)
    assert r0["mean_acc"] == r1["mean_acc"] == pytest.approx((0.25 * 4 + 0.75 * 12) / 16)
    assert r0["seen"] == r1["seen"] == 2 * (4 + 12)  # samples trained by all ranks, on every rank
    assert r0["whole"] == ["g20-0", "g21-0", "g21-1", "g21-2"] and r1["whole"] == ["g21-0", "g21-1", "g21-2"]

    one = make_trainer("learner.micro_batch_tokens=64", "learner.zero_stage=2")
    start = dict(one.export_state())
    logged = [one.train_step(batch(10 + 10 * s, n_groups=1) + batch(11 + 10 * s, n_groups=3)) for s in range(2)]
    # what the step logs is the whole batch's on every rank (it was each rank's own share: rank 0's
    # loss a fraction of the batch's, its tokens and entropy its own; found in review)
    for r in (r0, r1):
        assert r["tokens"] == [x["train_tokens"] for x in logged]
        assert r["micro"][0] > 0 and r["micro"] == r0["micro"]
        assert r["loss"] == pytest.approx([x["loss"] for x in logged], rel=1e-4)
        assert r["entropy"] == pytest.approx([x["entropy"] for x in logged], rel=1e-4)
    two = load_file(str(weights))
    for n, t1 in one.export_state():
        update = (t1 - start[n]).abs().max().item()
        assert update > 1e-4, n
        assert (t1 - two[n]).abs().max().item() <= 1e-2 * update, n


@pytest.mark.serial  # two ranks, a core each: 44 s alone, 88 s beside two busy cores
def test_two_nodes_of_one_rank_step_as_one_node_of_two_ranks(one_node_two_ranks, tmp_path):
    """Learner ranks on several nodes: two torchrun launches of one rank each (--nnodes 2,
    --node_rank 0 and 1, rendezvous at 127.0.0.1, gloo) take the same two steps on the same shares
    as one launch of two ranks. Each rank reads its place from torchrun's environment (global rank,
    node, local rank 0 on its node, and DeepSpeed's LOCAL_SIZE 1, so no shared-memory all-reduce
    across nodes), and a directory that is not the same for every rank is refused on all of them."""
    from safetensors.torch import load_file

    single, single_weights = one_node_two_ranks
    multi = launch_ranks(tmp_path, nnodes=2)
    # where each rank thinks it is: [rank, world, local rank, ranks on its node, node, launcher, LOCAL_SIZE]
    assert [single[r]["dist"] for r in range(2)] == [[0, 2, 0, 2, 0, "torchrun", "2"], [1, 2, 1, 2, 0, "torchrun", "2"]]
    assert [multi[r]["dist"] for r in range(2)] == [[0, 2, 0, 1, 0, "torchrun", "1"], [1, 2, 0, 1, 1, "torchrun", "1"]]
    for r in range(2):
        assert multi[r]["micro"] == single[r]["micro"] and multi[r]["applied"] == [1.0, 1.0]
        assert multi[r]["loss"] == pytest.approx(single[r]["loss"], rel=1e-6, abs=1e-9)
        assert multi[r]["after"] == pytest.approx(single[r]["after"], rel=1e-6)
        assert multi[r]["mean_acc"] == single[r]["mean_acc"]
        assert "is not shared: rank 1 on" in multi[r]["blind"]  # rank 1 cannot see rank 0's file
    a, b = load_file(str(single_weights)), load_file(str(tmp_path / "weights.safetensors"))
    assert a.keys() == b.keys()
    start = dict(make_trainer().export_state())
    for n in a:
        assert (a[n] - start[n]).abs().max().item() > 1e-4, n  # it trained...
        assert torch.allclose(a[n], b[n], rtol=0, atol=1e-6), n  # ...to the same weights


MINI_MAIN = """
import json, os, sys
from pathlib import Path
sys.path[:0] = [os.getcwd(), "tests", "tests/learner"]
from safetensors.torch import save_file
from test_trainer import MINI_SETS, batch, make_cfg
from toolrl.models import resolve_model
from toolrl.learner.trainer import Trainer

out = Path(sys.argv[1])
tr = Trainer(make_cfg(*MINI_SETS), resolve_model("tiny-random"))
m = [tr.train_step(batch(10 + 10 * s + tr.rank, n_groups=1 if tr.rank == 0 else 3)) for s in range(2)]
if tr.rank == 0:
    save_file(dict(tr.export_state()), str(out / "weights.safetensors"))
(out / f"rank{tr.rank}.json").write_text(json.dumps({"steps": [x["optimizer_steps"] for x in m],
                                                     "applied": [x["step_applied"] for x in m]}))
tr.close()
"""
MINI_SETS = ("learner.micro_batch_tokens=64", "learner.zero_stage=2", "grpo.mini_batches=2",
             "grpo.updates_per_batch=2", "grpo.tis_cap=2.0", "learner.lr=5e-3")


@pytest.mark.serial  # two ranks, a core each: 44 s alone, 88 s beside two busy cores
def test_two_ranks_cut_unequal_shares_into_the_same_mini_batches(tmp_path, monkeypatch):
    """Several updates per batch in mini-batches on two ranks with unequal shares (1 group against
    3): the rank with one group has nothing for the second mini-batch, yet every optimizer step is
    collective, so it joins the other's steps with empty pieces (before, it took 2 steps to the
    other's 4 and the run hung). Mini-batch k is the union of the ranks' k-th pieces, so the weights
    must be those of one rank stepping on those unions, pi_old and the truncated IS weight included."""
    from safetensors.torch import load_file

    from toolrl.learner.batching import split_mini_batches

    ranks = launch_ranks(tmp_path, nnodes=1, script=MINI_MAIN, timeout_s=150)
    assert ranks[0]["steps"] == ranks[1]["steps"] == [4, 4] and ranks[0]["applied"] == [1.0, 1.0]
    one = make_trainer(*MINI_SETS)
    start = dict(one.export_state())
    for s in range(2):
        cuts = [split_mini_batches(share, 2) for share in (batch(10 + 10 * s, n_groups=1),
                                                             batch(11 + 10 * s, n_groups=3))]
        assert [len(c) for c in cuts] == [1, 2]  # the premise: rank 0 has no second piece
        unions = [cuts[0][0] + cuts[1][0], cuts[1][1]]
        monkeypatch.setattr("toolrl.learner.trainer.split_mini_batches", lambda samples, n, u=unions: list(u))
        one.train_step([x for u in unions for x in u])
    two = load_file(str(tmp_path / "weights.safetensors"))
    for n, t1 in one.export_state():
        update = (t1 - start[n]).abs().max().item()
        assert update > 1e-4, n
        assert (t1 - two[n]).abs().max().item() <= 1e-2 * update, n


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


def test_without_the_grpo_term_its_per_token_figures_are_not_made_up():
    """w_grpo 0 (the proof's SFT arm): entropy, KL, clip fraction and ratios were logged as 0 and 1,
    read off the curves as measured (found in review). NaN, as grad_norm where it was not measured."""
    tr = make_trainer("grpo.w_grpo=0", "grpo.w_teacher=1")
    b = batch(5)
    b = b + [b[1].model_copy(update={"source": "teacher", "group_id": "t0"})]
    m = tr.train_step(b)
    assert m["loss_sft_teacher"] > 0
    for key in ("kl", "entropy", "clip_frac", "ratio_mean", "ratio_max", "ratio_min"):
        assert math.isnan(m[key]), key
    m = make_trainer().train_step(batch(5))
    assert m["entropy"] > 0 and math.isfinite(m["ratio_max"]) and math.isfinite(m["kl"])


def test_a_resume_trains_at_the_configs_lr_and_weight_decay(tmp_path):
    """DeepSpeed restores the optimizer's groups and the scheduler's base LRs as saved: a resume with
    --set learner.lr=... kept training at the old LR while warmup and steps followed the new config
    (found in review)."""
    first = make_trainer()
    first.train_step(batch(3))
    first.save_checkpoint(tmp_path)
    sets = ("learner.lr=1e-4", "learner.weight_decay=0.1")
    resumed = make_trainer(*sets)
    resumed.load_checkpoint(tmp_path)
    fresh = make_trainer(*sets)
    fresh.step = resumed.step
    fresh._apply_lr()
    assert resumed.lr() == pytest.approx(fresh.lr()) and resumed.lr() != pytest.approx(first.lr())
    groups = resumed.scheduler.optimizer.param_groups
    assert all(g["weight_decay"] == 0.1 for g in groups)
    assert resumed.train_step(batch(4))["lr"] == pytest.approx(fresh.train_step(batch(4))["lr"])


def test_a_broken_checkpoint_says_which_and_what_else_there_is(tmp_path):
    """An empty `latest` gave a bare AssertionError and a truncated file torch's zip error, with no
    word of the older checkpoint beside it (found in review)."""
    tr = make_trainer("learner.keep_checkpoints=2")
    for seed in (1, 2):
        tr.train_step(batch(seed))
        tr.save_checkpoint(tmp_path)
    assert (tmp_path / "latest").read_text().strip() == "step000002"
    states = next((tmp_path / "step000002").glob("*model_states.pt"))
    states.write_bytes(states.read_bytes()[:1000])  # cut short, as by a kill mid-save
    with pytest.raises(SystemExit, match=r"step000002 cannot be loaded .*there: step000001"):
        make_trainer().load_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("")
    with pytest.raises(SystemExit, match="names nothing, which is not a checkpoint"):
        make_trainer().load_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("step000001")  # as the message says
    resumed = make_trainer()
    resumed.load_checkpoint(tmp_path)
    assert resumed.step == 1


def test_mis_masked_tokens_count_the_batch_not_every_pass_over_it():
    """With updates_per_batch 2 every masked token was counted twice (found in review). Behaviour
    logprobs of -30 against the tiny model's about -11: every ratio is far over 3, so token_mask
    masks every GRPO token on both passes, and the count is the batch's."""
    fix = ["grpo.vllm_importance_sampling_correction=true", "grpo.vllm_importance_sampling_mode=token_mask"]
    b = [s.model_copy(update={"logprobs": [-30.0 if m else None for m in s.loss_mask]}) for s in batch(5)]
    grpo_tokens = sum(sum(s.loss_mask) for s in b)
    one = make_trainer(*fix).train_step(b)
    two = make_trainer(*fix, "grpo.updates_per_batch=2").train_step(b)
    assert one["mis_masked_tokens"] == two["mis_masked_tokens"] == grpo_tokens



def test_an_old_checkpoint_another_rank_removed_first_is_no_error(tmp_path):
    """Ranks on one shared disk remove the same old checkpoint at once: what another rank removed
    first was a warning each time, and could stop a rank's removal half-way (multi-rank runs)."""
    from toolrl.learner.trainer import remove_tree

    remove_tree(tmp_path / "step000001")  # another rank removed all of it: no error
    (tmp_path / "step000002" / "a").mkdir(parents=True)
    (tmp_path / "step000002" / "a" / "shard.pt").write_bytes(b"x")
    remove_tree(tmp_path / "step000002")
    assert not (tmp_path / "step000002").exists()

