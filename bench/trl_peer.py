"""The TRL side of bench/e2e_vs_trl.py: GRPOTrainer (transformers generation) on the problems the
bench wrote, for a wall-clock budget. Runs in the peer's own virtualenv (bench/.venv-trl) and imports
only torch, transformers, datasets, trl and bench/peer_reward.py (which loads toolrl/format.py as one
file), never the toolrl package.

    bench/.venv-trl/bin/python bench/trl_peer.py --model DIR --problems FILE.jsonl --out DIR --budget-s S
        [--prompts-per-step 4] [--group-size 4] [--max-new-tokens 256] [--temperature 0.8] [--lr 1e-5]
        [--warmup-steps 1] [--weights '{"correct": 1.0, "format": 0.2}'] [--bf16 | --no-bf16]
        [--gradient-checkpointing | --no-gradient-checkpointing] [--seed 0]

The problems file has one row per problem, in the order toolrl's gen worker draws them: the prompt as
token ids (toolrl's chat template and prefill) and as text, and the answer. TRL gets the text, and
this script checks TRL tokenises it back to the same ids, so both systems see the same prompts.

Training stops at the end of the first step that ends at or past --budget-s seconds after training
began (the peer gets at least as much time as the run it is compared with). Written to --out:
steps.jsonl (per step: wall times, generation and learner seconds, tokens, every sample's reward),
logs.jsonl (TRL's own logs), export/ (the final policy as a Hugging Face directory) and summary.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

T_PROCESS = time.time()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_reward import score  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--problems", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, required=True)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup-steps", type=int, default=1)
    ap.add_argument("--epsilon", type=float, default=0.2)
    ap.add_argument("--epsilon-high", type=float, default=0.28)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--weights", default='{"correct": 1.0, "format": 0.2}')
    ap.add_argument("--prefill", default="<think>\n")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                    help="TRL's default is on (slower, less memory)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    weights = json.loads(args.weights)
    rows = [json.loads(line) for line in Path(args.problems).read_text().splitlines() if line.strip()]
    tok = AutoTokenizer.from_pretrained(args.model)
    for r in rows[:32]:  # TRL tokenises a text prompt itself: it must give the ids toolrl's worker uses
        ids = tok(text=r["prompt"])["input_ids"]
        if ids != r["prompt_ids"]:
            raise SystemExit(f"trl_peer: TRL would tokenise problem {r['id']} differently from toolrl "
                             f"({len(ids)} against {len(r['prompt_ids'])} tokens): the prompts would not be equal")
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"], "prompt_tokens": len(r["prompt_ids"])}
                              for r in rows])

    clock = {"gen_s": 0.0, "gen_score_s": 0.0, "rewards": [], "completion_tokens": [], "prompt_tokens": [],
             "correct": []}

    def reward(prompts, completions, answer, completion_ids=None, prompt_tokens=None, **_):
        totals = []
        for text, gold in zip(completions, answer):
            comps, total = score(args.prefill + text, gold, weights)
            totals.append(total)
            clock["correct"].append(comps.get("correct", 0.0))
        clock["rewards"] += totals
        clock["completion_tokens"] += [len(c) for c in completion_ids or []]
        clock["prompt_tokens"] += list(prompt_tokens or [])
        return totals

    config = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=args.bf16, seed=args.seed,
        per_device_train_batch_size=args.prompts_per_step * args.group_size, gradient_accumulation_steps=1,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=args.warmup_steps,
        weight_decay=0.0, max_grad_norm=args.grad_clip, max_steps=args.max_steps,
        beta=0.0, num_iterations=1, epsilon=args.epsilon, epsilon_high=args.epsilon_high, loss_type="dapo",
        scale_rewards="group", gradient_checkpointing=args.gradient_checkpointing,
        shuffle_dataset=False, logging_steps=1, save_strategy="no", report_to="none",
        dataloader_num_workers=0, disable_tqdm=True,
    )

    class Budget(TrainerCallback):
        """Per-step records, and the stop once the budget is used."""

        def __init__(self):
            self.t0 = self.t_step = None
            self.f = open(out / "steps.jsonl", "w")
            self.logs = open(out / "logs.jsonl", "w")

        def on_train_begin(self, a, state, control, **kw):
            self.t0 = time.time()

        def on_step_begin(self, a, state, control, **kw):
            self.t_step = time.time()
            clock.update(gen_s=0.0, gen_score_s=0.0, rewards=[], completion_tokens=[], prompt_tokens=[], correct=[])

        def on_step_end(self, a, state, control, **kw):
            now = time.time()
            step_s = now - self.t_step
            rewards, g = clock["rewards"], args.group_size
            groups = [rewards[i:i + g] for i in range(0, len(rewards), g)]
            # samples whose advantage is not zero (TRL trains every sample all the same)
            signal = sum(1 for grp in groups for r in grp if abs(r - sum(grp) / len(grp)) > 1e-9)
            rec = {"step": state.global_step, "t_start": self.t_step, "t_end": now, "step_s": step_s,
                   "gen_s": clock["gen_s"], "gen_score_s": clock["gen_score_s"],
                   "learner_s": step_s - clock["gen_score_s"], "samples": len(rewards),
                   "completion_tokens": sum(clock["completion_tokens"]), "prompt_tokens": sum(clock["prompt_tokens"]),
                   "signal_samples": signal, "zero_std_groups": sum(1 for grp in groups if max(grp) == min(grp)),
                   "reward_mean": sum(rewards) / max(1, len(rewards)),
                   "accuracy": sum(clock["correct"]) / max(1, len(clock["correct"])), "rewards": rewards}
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()
            print(f"step {state.global_step} {step_s:.1f}s (generation {clock['gen_s']:.1f}s, learner "
                  f"{rec['learner_s']:.1f}s) reward {rec['reward_mean']:.3f} acc {rec['accuracy']:.2f} "
                  f"tokens {rec['completion_tokens']}", flush=True)
            if now - self.t0 >= args.budget_s:
                control.should_training_stop = True

        def on_log(self, a, state, control, logs=None, **kw):
            self.logs.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")
            self.logs.flush()

    budget = Budget()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[budget])

    def timed(fn, key):
        def wrapper(*a, **kw):
            t = time.time()
            try:
                return fn(*a, **kw)
            finally:
                clock[key] += time.time() - t
        return wrapper

    # generation alone, and generation with scoring and advantages (the rest of a step is the learner's)
    trainer._generate_single_turn = timed(trainer._generate_single_turn, "gen_s")
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "gen_score_s")
    print(f"trl_peer: torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 {args.bf16}, gradient "
          f"checkpointing {args.gradient_checkpointing}; {len(rows)} problems; budget {args.budget_s:.0f}s", flush=True)
    t_ready = time.time()
    trainer.train()
    t_end = time.time()
    trainer.save_model(str(out / "export"))
    tok.save_pretrained(str(out / "export"))
    summary = {"steps": trainer.state.global_step, "startup_s": t_ready - T_PROCESS,
               "train_start": budget.t0, "train_end": t_end, "train_s": t_end - budget.t0,
               "export": str(out / "export"), "save_s": time.time() - t_end,
               "versions": {"torch": torch.__version__, "trl": __import__("trl").__version__,
                            "transformers": __import__("transformers").__version__}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
