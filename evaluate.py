"""evaluate.py: accuracy, pass@k, format and tool use through the tool-interleaved rollout engine.

    python evaluate.py --model M --task T --n-problems N --samples K --out FILE.json
    python evaluate.py score --task humaneval:HumanEval/0 --program FILE

`python evaluate.py --help` lists the options; toolrl/worker/evaluate.py is the code.
"""
from toolrl.worker.evaluate import main

if __name__ == "__main__":
    main()
