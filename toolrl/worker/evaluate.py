"""evaluate.py: accuracy, pass@k, format and tool use through the tool-interleaved rollout engine.

    python evaluate.py --model M --task T --n-problems N --samples K --out FILE.json
        [--config CFG] [--set k=v ...] [--ks 1,5,10] [--temperature T] [--seed S] [--samples-out F.jsonl]

M: a built-in name (smollm2-135m-instruct), an HF id or path, or a run directory (its export).
--temperature: 0 decodes greedily (one answer a problem); default eval.temperature (the demo's: 0), else
   rollout.temperature.
T: arithmetic[:LEVEL or LO-HI][@KINDS] (held-out seed data.eval_seed unless --seed; KINDS: kind names or
   taught, free, all, verbs, commas, comma-separated, e.g. arithmetic:1-3@free), gsm8k:PATH, math:PATH, jsonl:PATH,
   code:TASKS (the held-out split of data.source=code, e.g. code:humaneval; accuracy = all tests pass;
   code:prepared:DIR the test side a prepared split wrote, toolrl.tasks.code.prepare),
   pycode[:LEVEL or LO-HI] (generated function-writing problems, the held-out side of their split).
Needs the executor service at executor.url; if none answers, a private one is started.

    python evaluate.py score --task humaneval:HumanEval/0 --program FILE [--mode fraction|all]

scores one program (plain code, or a completion with a code fence) against a code task's tests
(humaneval:ID, mbpp:PATH#ID, apps:PATH#ID) and prints JSON with passed, total and reward.
"""
import argparse
import asyncio
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from toolrl.config import Config, add_config_args, config_from_args
from toolrl.executor.client import ExecutorClient, ExecutorError
from toolrl.executor.local import ExecutorRefused, executor_available
from toolrl.format import extract_code
from toolrl.metrics import decoding
from toolrl.models import resolve_run_model, run_config
from toolrl.tasks import DataError, Problem, load_task, task_seed
from toolrl.tasks.code.judge import TestSpec, complete_program, run_tests
from toolrl.tasks.code.loaders import find_task
from toolrl.worker.agent import Agent, EvaluationUnscored


async def run_eval(cfg: Config, problems: list[Problem], samples_per_problem: int, ks: list[int],
                   progress: bool = True, samples_out: str | None = None) -> dict:
    """evaluate.py: an agent with a private engine for the model in cfg, then Agent.evaluate (the same
    code a live gen worker runs for the learner's in-run evaluations). `samples_out`: a jsonl file
    that gets every rollout's text and scores, to read what the model actually wrote."""
    by_id = {p.id: p for p in problems}
    agent = Agent(cfg, "eval")
    correct = [0.0, 0]
    dump = None
    if samples_out:
        Path(samples_out).parent.mkdir(parents=True, exist_ok=True)
        dump = open(samples_out, "w")
    try:
        with tqdm(total=len(problems), desc="eval", unit="problem", disable=not progress) as bar:
            def on_problem(pid, group):
                correct[0] += sum(s.rewards.get("correct", 0.0) for s in group)
                correct[1] += len(group)
                bar.update(1)
                bar.set_postfix(acc=f"{correct[0] / max(1, correct[1]):.3f}")
                for s in group if dump else ():
                    p = by_id[pid]
                    dump.write(json.dumps({"id": pid, "level": p.level, "kind": p.meta.get("kind"),
                                           "question": p.question, "answer": p.answer,
                                           "text": s.text, "rewards": s.rewards, "stop_reason": s.stop_reason,
                                           "tool_calls": len(s.tool_calls)}) + "\n")

            return await agent.evaluate(problems, samples_per_problem, ks, cfg.eval.concurrency, on_problem,
                                        temperature=cfg.eval.temperature)
    finally:
        if dump:
            dump.close()
        await agent.aclose()


def evaluate(cfg: Config, problems: list[Problem], samples_per_problem: int, ks: list[int],
             progress: bool = True, samples_out: str | None = None) -> dict:
    with executor_available(cfg) as cfg2:
        return asyncio.run(run_eval(cfg2, problems, samples_per_problem, ks, progress, samples_out))


def score_program(cfg: Config, task_id: str, text: str, mode: str = "fraction", log=print) -> dict:
    """`evaluate.py score`: run one program (a file's text, or a completion with a code fence)
    against one task's tests in the executor service."""
    problem = find_task(task_id)
    spec = TestSpec.from_json(problem.answer)
    code = complete_program(extract_code(text) if "```" in text or "</think>" in text else text, spec)
    with executor_available(cfg, log) as c2, ExecutorClient(c2.executor.url, token=c2.executor.token) as ex:
        res = run_tests(ex, [code], [spec], per_test_timeout_s=cfg.rewards.code_test_timeout_s,
                        max_timeout_s=c2.executor.max_timeout_s)[0]  # the rewards' budget
    return {"task": task_id, "passed": res.passed, "total": res.total, "reward": res.reward(mode),
            "status": res.status, "detail": res.detail}


def score_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="evaluate.py score",
                                     description="score one program against a task's tests")
    add_config_args(parser)
    parser.add_argument("--task", required=True,
                        help="humaneval:HumanEval/0, mbpp:PATH[@SPLIT]#ID or apps:PATH[@SPLIT]#ID")
    parser.add_argument("--program", required=True,
                        help="a file with the code (or a completion with a fence); - for stdin")
    parser.add_argument("--mode", choices=["fraction", "all"],
                        help="reward: fraction of tests passed, or all-or-nothing")
    args = parser.parse_args(argv)
    if not args.config:
        args.config = "configs/cpu_demo.yaml"
    cfg = config_from_args(args)

    try:
        text = sys.stdin.read() if args.program == "-" else Path(args.program).read_text()
        res = score_program(cfg, args.task, text, args.mode or cfg.rewards.code_mode,
                            log=lambda m: print(m, file=sys.stderr))
    except (DataError, OSError, ExecutorRefused) as exc:
        print(f"evaluate.py score: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except ExecutorError as exc:  # the executor's failure says nothing of the program: no score, not 0
        print(f"evaluate.py score: not scored: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps(res))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["score"]:
        return score_main(argv[1:])
    parser = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", help="default: the config's eval.task")
    parser.add_argument("--n-problems", type=int, help="default: the config's eval.n_problems")
    parser.add_argument("--samples", type=int, help="samples per problem (pass@k needs k); default eval.samples")
    parser.add_argument("--ks", default="1,5,10", help="comma-separated k for pass@k (k <= samples)")
    parser.add_argument("--temperature", type=float,
                        help="0 = greedy; default eval.temperature, else rollout.temperature")
    parser.add_argument("--seed", type=int, help="problem seed for generated tasks (default eval.seed, else "
                                                 "data.eval_seed)")
    parser.add_argument("--out", default="runs/eval.json")
    parser.add_argument("--samples-out", help="also write every rollout (text, rewards) to this jsonl file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if not args.config:  # a run's export: its run's config (prompt, limits, task); else the demo's
        try:
            args.config = run_config(resolve_run_model(args.model)) or "configs/cpu_demo.yaml"
        except FileNotFoundError:
            args.config = "configs/cpu_demo.yaml"  # the model's error is reported below
    cfg = config_from_args(args)
    # what the command line leaves out comes from the config's eval section, as the learner's evaluations
    args.task = args.task or cfg.eval.task
    args.n_problems = cfg.eval.n_problems if args.n_problems is None else args.n_problems
    args.samples = cfg.eval.samples if args.samples is None else args.samples
    args.seed = cfg.eval.seed if args.seed is None else args.seed

    try:
        ks = sorted({int(k) for k in args.ks.split(",") if k.strip()})
        for name, v in (("--n-problems", args.n_problems), ("--samples", args.samples), *(("--ks", k) for k in ks)):
            if v < 1:
                raise ValueError(f"{name} {v}: must be at least 1")
        model = resolve_run_model(args.model)
        problems = load_task(args.task, args.n_problems, task_seed(cfg.data, args.task, args.seed), cfg.data)
    except (ValueError, DataError, FileNotFoundError) as exc:
        print(f"evaluate.py: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    temperature = cfg.eval.temperature if args.temperature is None else args.temperature
    if temperature is not None and temperature < 0:
        print(f"evaluate.py: --temperature must be 0 (greedy) or more, not {temperature}", file=sys.stderr)
        raise SystemExit(2)
    if temperature == 0 and args.samples > 1:
        if args.temperature is not None:
            print(f"evaluate.py: greedy decoding (--temperature 0) gives every sample the same answer: --samples "
                  f"{args.samples} needs --temperature above 0", file=sys.stderr)
            raise SystemExit(2)
        temperature = None  # the config's greedy is for one answer; pass@k samples as training does
        print(f"evaluate.py: {args.samples} samples a problem at the rollout temperature {cfg.rollout.temperature} "
              f"(the config's eval.temperature 0 is greedy: one answer)", file=sys.stderr)
    if dropped := [k for k in ks if k > args.samples]:  # pass@k needs k samples per problem
        print(f"evaluate.py: pass@{', pass@'.join(map(str, dropped))} left out: they need --samples "
              f"{max(dropped)} or more (--samples is {args.samples})", file=sys.stderr)
    ks = [k for k in ks if k <= args.samples] or [1]
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": model}),
                                 "eval": cfg.eval.model_copy(update={"temperature": temperature})})

    try:
        res = evaluate(cfg, problems, args.samples, ks, progress=not args.quiet, samples_out=args.samples_out)
    except EvaluationUnscored as exc:
        print(f"evaluate.py: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except ExecutorRefused as exc:
        print(f"evaluate.py: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    res.update(model=args.model, task=args.task, samples_per_problem=args.samples, prompt=cfg.prompt.system)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))

    table = Table(title=f"{args.model} on {args.task}: {res['n_problems']} problems x {args.samples} samples, "
                        f"{decoding(res['temperature'])}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("accuracy", f"{res['accuracy']:.3f}")
    for k, v in res["pass_at_k"].items():
        table.add_row(f"pass@{k}", f"{v:.3f}")
    for key in ("format_rate", "code_written_rate", "code_executed_rate", "tool_calls_per_answer",
                "tool_error_rate", "mean_completion_tokens", "wall_s"):
        table.add_row(key, f"{res[key]:.3f}")
    for name, part in [*res.get("by_kind_set", {}).items(), *res.get("by_kind", {}).items()]:  # arithmetic
        table.add_row(f"accuracy, {name}", f"{part['accuracy']:.3f} ({part['n_samples']})")
        if "applied" in part:  # a·b ± c kinds: the sign the answers applied to c
            table.add_row(f"  sign applied, {name}", "  ".join(f"{k} {v:.2f}" for k, v in part["applied"].items()))
        if "verb_reading" in part:
            table.add_row("  verb reading, free (P(minus|loss) - P(minus|gain))", f"{part['verb_reading']:.3f}")
        if "commas_copied" in part:
            table.add_row(f"  programs copying 1,250-style numbers, {name}", f"{part['commas_copied']:.3f}")
    Console(file=sys.stderr).print(table)
    print(json.dumps({k: res[k] for k in ("accuracy", "pass_at_k", "format_rate", "tool_calls_per_answer")}))

