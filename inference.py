"""inference.py: ask a trained model a question and watch the tool loop: its code, the output, the answer.

    python inference.py "A shop sells 128 boxes of 36 pens. How many pens?"
    python inference.py                      # a few built-in examples
    python inference.py --model runs/RUN     # a run directory (its export), a built-in name, an HF id or path

The default model is the latest export under runs/, else SmolLM2-135M-Instruct. Code runs in the
executor service at executor.url; if none answers, a private one is started.
"""
import argparse
import asyncio
import sys

from toolrl.config import add_config_args, config_from_args

EXAMPLES = [
    "A farmer plants 47 rows of apple trees with 38 trees in each row. How many trees does the farmer plant?",
    "A warehouse receives 314 crates with 27 bottles in each crate. It already holds 905 bottles. "
    "How many bottles are in the warehouse now?",
    "A bakery bakes 236 trays with 418 rolls on each tray and sells 51234 rolls. How many rolls are left?",
]


async def answer_all(cfg, questions: list[str], console) -> None:
    from toolrl.worker.producer import GenWorker

    worker = GenWorker(cfg, worker_id="inference")
    try:
        for i, q in enumerate(questions):
            await answer(worker, cfg, q, console, f"inference.{i}")
    finally:
        await worker.executor.aclose()
        worker.close()


async def answer(worker, cfg, question: str, console, request_id: str) -> None:
    from toolrl.format import extract_answer
    from toolrl.worker.rollout import run_rollout

    ids = worker.prompt_ids(question)
    r = await run_rollout(worker.engine, worker.tool, worker.tokenizer, ids, cfg.rollout, request_id,
                          worker.pending_code)
    console.rule(f"[bold]{question}")
    console.print(cfg.prompt.prefill, end="", style="dim")
    for kind, a, b in r.segments:  # model text plain, tool output in cyan
        text = worker.tokenizer.decode(r.completion_ids[a:b], skip_special_tokens=True)
        console.print(text, end="", style="cyan" if kind == "tool" else None, markup=False, highlight=False)
    console.print()
    _, final = r.texts(worker.tokenizer, cfg.prompt.prefill)
    console.print(f"[bold green]answer:[/] {extract_answer(final)}   [dim]({len(r.tool_calls)} tool call(s), "
                  f"{r.generated} tokens, stop: {r.stop_reason})[/]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("question", nargs="*", help="the question (default: built-in examples)")
    parser.add_argument("--model", help="run dir, built-in name, HF id or path (default: latest export)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    args = parser.parse_args()
    if not args.config:
        args.config = "configs/cpu_demo.yaml"
    cfg = config_from_args(args)

    from rich.console import Console

    from toolrl.worker.evaluate import executor_available, latest_export, resolve_eval_model

    console = Console()
    model = args.model or latest_export() or "smollm2-135m-instruct"
    try:
        model = resolve_eval_model(model)
    except FileNotFoundError as exc:
        print(f"inference.py: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    console.print(f"[dim]model: {model}[/]")
    # vLLM treats temperature 0 as greedy; its processed logprobs are then those of T = 1.
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": model}),
                                 "rollout": cfg.rollout.model_copy(update={"temperature": args.temperature or 1e-6})})
    questions = [" ".join(args.question)] if args.question else EXAMPLES
    with executor_available(cfg, log=lambda m: console.print(f"[dim]{m}[/]")) as cfg2:
        asyncio.run(answer_all(cfg2, questions, console))


if __name__ == "__main__":
    main()
