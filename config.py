"""The one config of the system: `python config.py --config FILE [--set k=v ...] --print`.

Every service reads the same typed tree (defined in toolrl/config.py): model, data, prompt,
executor, ref_server, rollout, rewards, grpo, teacher, learner, eval, logging, launch. An unknown
key or a bad value exits non-zero with one line that names it.
"""
from toolrl.config import main


def rewards_fit_the_task(cfg) -> None:
    """Every reward the config weighs is registered and fits its task (toolrl.worker.rewards)."""
    from toolrl.worker.rewards import check_reward_config  # lazy: it loads torch; --get and --print stay fast

    check_reward_config(cfg)


if __name__ == "__main__":
    main(checks=(rewards_fit_the_task,))
