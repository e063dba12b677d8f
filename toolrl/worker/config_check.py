"""`python config.py` and `toolrl-config`: the config check, with what only the packages know.

toolrl.config is a foundation module and imports no package; the registered rewards live here, in
the gen worker's room, so both entry points run the same checks (the console script ran none: a
misspelt reward passed it)."""
from toolrl.config import Config
from toolrl.config import main as config_main


def rewards_fit_the_task(cfg: Config) -> None:
    """Every reward the config weighs is registered and fits its task (toolrl.worker.rewards)."""
    from toolrl.worker.rewards import check_reward_config  # lazy: it loads torch; --get and --print stay fast

    check_reward_config(cfg)


def main(argv: list[str] | None = None) -> None:
    config_main(argv, checks=(rewards_fit_the_task,))
