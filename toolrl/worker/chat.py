"""inference.py: ask a trained model a question and watch the tool loop: its code, the output, the answer.

    python inference.py "A shop sells 128 boxes of 36 pens. How many pens?"
    python inference.py                      # an interactive chat (or one question per line on stdin)
    python inference.py --examples           # a few built-in examples
    python inference.py --model runs/RUN     # a run directory (its export), a built-in name, an HF id or path

The default model is the latest export under runs/, else SmolLM2-135M-Instruct. Code runs in the
executor service at executor.url; if none answers, a private one is started. The engine's own logs
go to a file (--log); --verbose shows them instead.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

from rich.console import Console

from toolrl.config import Config, add_config_args, config_from_args
from toolrl.executor.local import ExecutorRefused, executor_available
from toolrl.format import extract_answer
from toolrl.models import latest_export, resolve_run_model, run_config
from toolrl.worker.agent import Agent

EXAMPLES = [
    "A farmer plants 47 rows of apple trees with 38 trees in each row. How many trees does the farmer plant?",
    "A warehouse receives 314 crates with 27 bottles in each crate. It already holds 905 bottles. "
    "How many bottles are in the warehouse now?",
    "A bakery bakes 236 trays with 418 rolls on each tray and sells 51234 rolls. How many rolls are left?",
]
QUIT = {"exit", "quit", ":q"}


@contextlib.contextmanager
def engine_output_to(log_path: Path | None):
    """Yields the console the user reads. With a log path, everything else written to this process's
    stdout and stderr (vLLM's start-up and shutdown logs, progress bars, C-level warnings, also from
    its child processes) goes to that file instead: redirected at the file descriptors, since vLLM
    configures its loggers and spawns workers that write to fds 1 and 2 directly."""
    if log_path is None:
        yield Console(highlight=False)
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "a") as log, os.fdopen(os.dup(saved[0]), "w") as user:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield Console(file=user, highlight=False)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def questions_from_user(console: Console):
    """Questions typed at a prompt on a terminal; from a pipe, one per line."""
    interactive = sys.stdin.isatty()
    if interactive:
        console.print("[dim]Ask a question (empty line, exit or Ctrl-D to quit).[/]")
    while True:
        try:
            line = console.input("[bold cyan]question>[/] ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            return
        if not interactive and not line:
            return
        q = line.strip()
        if (interactive and not q) or q.lower() in QUIT:
            return
        if q:
            yield q


async def chat(cfg: Config, questions, console: Console) -> int:
    t0 = time.time()
    with console.status("starting the engine (tens of seconds on a CPU)"):
        agent = Agent(cfg, "inference")
    console.print(f"[dim]engine ready in {time.time() - t0:.0f}s[/]")
    n = 0
    try:
        for q in questions:
            r = await agent.answer(q, f"inference.{n}")
            n += 1
            show(agent, cfg, q, r, console)
    finally:
        await agent.aclose()
    return n


def show(agent: Agent, cfg: Config, question: str, r, console: Console) -> None:
    """The rollout as the model lived it: its text plain, the tool's output in cyan, then the answer."""
    console.rule(f"[bold]{question}")
    console.print(cfg.prompt.prefill, end="", style="dim")
    for kind, a, b in r.segments:
        text = agent.tokenizer.decode(r.completion_ids[a:b], skip_special_tokens=True)
        console.print(text, end="", style="cyan" if kind == "tool" else None, markup=False, highlight=False)
    console.print()
    _, final = r.texts(agent.tokenizer, cfg.prompt.prefill)
    console.print(f"[bold green]answer:[/] {extract_answer(final)}   [dim]({len(r.tool_calls)} tool call(s), "
                  f"{r.generated} tokens, stop: {r.stop_reason})[/]")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="inference.py", description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("question", nargs="*", help="the question (default: an interactive chat)")
    parser.add_argument("--examples", action="store_true", help="answer a few built-in example questions")
    parser.add_argument("--model", help="run dir, built-in name, HF id or path (default: latest export)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--log", default="runs/inference.log", help="where the engine's logs go (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="show the engine's logs instead of --log")
    args = parser.parse_args(argv)
    model = args.model or latest_export() or "smollm2-135m-instruct"
    try:
        model = resolve_run_model(model)
    except FileNotFoundError as exc:
        print(f"inference.py: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    args.config = args.config or run_config(model) or "configs/cpu_demo.yaml"
    cfg = config_from_args(args)
    # vLLM treats temperature 0 as greedy; its processed logprobs are then those of T = 1.
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": model}),
                                 "rollout": cfg.rollout.model_copy(update={"temperature": args.temperature or 1e-6})})
    log_path = None if args.verbose else Path(args.log)
    with engine_output_to(log_path) as console:
        console.print(f"[dim]model: {model}; config: {args.config}"
                      + (f"; engine logs: {log_path}" if log_path else "") + "[/]")
        if args.question:
            questions = [" ".join(args.question)]
        elif args.examples:
            questions = EXAMPLES
        else:
            questions = questions_from_user(console)
        try:
            with executor_available(cfg, log=lambda m: console.print(f"[dim]{m}[/]")) as cfg2:
                asyncio.run(chat(cfg2, questions, console))
        except ExecutorRefused as exc:
            print(f"inference.py: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        except KeyboardInterrupt:  # Ctrl-C mid-answer: stop, as at the prompt, without a traceback
            console.print("\n[dim]stopped[/]")
            raise SystemExit(130) from None
