"""The one config of the system: `python config.py --config FILE [--set k=v ...] --print`.

Every service reads the same typed tree (defined in toolrl/config.py): model, data, prompt,
executor, ref_server, rollout, rewards, grpo, teacher, learner, eval, logging, launch. An unknown
key, a bad value or a reward that does not exist or fit the task exits non-zero with one line that
names it (toolrl/worker/config_check.py).
"""
from toolrl.worker.config_check import main

if __name__ == "__main__":
    main()
