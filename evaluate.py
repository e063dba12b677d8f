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
from toolrl.worker.evaluate import main

if __name__ == "__main__":
    main()
