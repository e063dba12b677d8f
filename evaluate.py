"""evaluate.py: accuracy, pass@k, format and tool use through the tool-interleaved rollout engine.

    python evaluate.py --model M --task T --n-problems N --samples K --out FILE.json
        [--config CFG] [--set k=v ...] [--ks 1,5,10] [--temperature T] [--seed S] [--samples-out F.jsonl]

M: a built-in name (smollm2-135m-instruct), an HF id or path, or a run directory (its export).
T: arithmetic[:LEVEL or LO-HI] (held-out seed data.eval_seed unless --seed), gsm8k:PATH, math:PATH, jsonl:PATH,
   code:TASKS (the held-out split of data.source=code, e.g. code:humaneval; accuracy = all tests pass).
Needs the executor service at executor.url; if none answers, a private one is started.

    python evaluate.py score --task humaneval:HumanEval/0 --program FILE [--mode fraction|all]

scores one program (plain code, or a completion with a code fence) against a code task's tests
(humaneval:ID, mbpp:PATH#ID, apps:PATH#ID) and prints JSON with passed, total and reward.
"""
import argparse
import json
import sys
from pathlib import Path

from toolrl.config import add_config_args, config_from_args


def score_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="evaluate.py score",
                                     description="score one program against a task's tests")
    add_config_args(parser)
    parser.add_argument("--task", required=True, help="humaneval:HumanEval/0, mbpp:PATH#ID or apps:PATH#ID")
    parser.add_argument("--program", required=True,
                        help="a file with the code (or a completion with a fence); - for stdin")
    parser.add_argument("--mode", choices=["fraction", "all"],
                        help="reward: fraction of tests passed, or all-or-nothing")
    args = parser.parse_args(argv)
    if not args.config:
        args.config = "configs/cpu_demo.yaml"
    cfg = config_from_args(args)

    from toolrl.tasks import DataError
    from toolrl.worker.evaluate import score_program

    try:
        text = sys.stdin.read() if args.program == "-" else Path(args.program).read_text()
        res = score_program(cfg, args.task, text, args.mode or cfg.rewards.code_mode,
                            log=lambda m: print(m, file=sys.stderr))
    except (DataError, OSError) as exc:
        print(f"evaluate.py score: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(res))


def main() -> None:
    if sys.argv[1:2] == ["score"]:
        return score_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", default="arithmetic")
    parser.add_argument("--n-problems", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1, help="samples per problem (pass@k needs k)")
    parser.add_argument("--ks", default="1,5,10", help="comma-separated k for pass@k (k <= samples)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default rollout.temperature)")
    parser.add_argument("--seed", type=int, help="problem seed for generated tasks (default data.eval_seed)")
    parser.add_argument("--out", default="runs/eval.json")
    parser.add_argument("--samples-out", help="also write every rollout (text, rewards) to this jsonl file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    if not args.config:
        args.config = "configs/cpu_demo.yaml"
    cfg = config_from_args(args)

    from toolrl.tasks import DataError, load_task, task_seed
    from toolrl.worker.evaluate import evaluate, resolve_eval_model

    try:
        ks = sorted({int(k) for k in args.ks.split(",") if k.strip()})
        model = resolve_eval_model(args.model)
        problems = load_task(args.task, args.n_problems, task_seed(cfg.data, args.task, args.seed), cfg.data)
    except (ValueError, DataError, FileNotFoundError) as exc:
        print(f"evaluate.py: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    ks = [k for k in ks if k <= args.samples] or [1]
    updates = {"model": cfg.model.model_copy(update={"name": model})}
    if args.temperature is not None:
        updates["rollout"] = cfg.rollout.model_copy(update={"temperature": args.temperature})
    cfg = cfg.model_copy(update=updates)

    res = evaluate(cfg, problems, args.samples, ks, progress=not args.quiet, samples_out=args.samples_out)
    res.update(model=args.model, task=args.task, samples_per_problem=args.samples,
               temperature=cfg.rollout.temperature, prompt=cfg.prompt.system)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.model} on {args.task}: {res['n_problems']} problems x {args.samples} samples")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("accuracy", f"{res['accuracy']:.3f}")
    for k, v in res["pass_at_k"].items():
        table.add_row(f"pass@{k}", f"{v:.3f}")
    for key in ("format_rate", "code_written_rate", "code_executed_rate", "tool_calls_per_answer",
                "tool_error_rate", "mean_completion_tokens", "wall_s"):
        table.add_row(key, f"{res[key]:.3f}")
    Console(file=sys.stderr).print(table)
    print(json.dumps({k: res[k] for k in ("accuracy", "pass_at_k", "format_rate", "tool_calls_per_answer")}))


if __name__ == "__main__":
    main()
