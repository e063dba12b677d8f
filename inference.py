"""inference.py: ask a trained model a question and watch the tool loop: its code, the output, the answer.

    python inference.py "A shop sells 128 boxes of 36 pens. How many pens?"
    python inference.py                      # an interactive chat (or one question per line on stdin)
    python inference.py --examples           # a few built-in examples
    python inference.py --model runs/RUN     # a run directory (its export), a built-in name, an HF id or path

The engine's own logs go to runs/inference.log (--log); --verbose shows them instead.
"""
from toolrl.worker.chat import main

if __name__ == "__main__":
    main()
