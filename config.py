"""The one config of the system: `python config.py --config FILE [--set k=v ...] --print`.

Every service reads the same typed tree (defined in toolrl/config.py): model, data, prompt,
executor, ref_server, rollout, rewards, grpo, teacher, learner, eval, logging, launch. An unknown
key or a bad value exits non-zero with one line that names it.
"""
from toolrl.config import main

if __name__ == "__main__":
    main()
