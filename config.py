"""The one config of the system: `python config.py --config FILE [--set k=v ...] --print`.

Every service reads the same typed tree (defined in toolrl/config.py): model, data, prompt,
executor, ref_server, rollout, rewards, grpo, learner, logging. An unknown key or a bad value
exits non-zero with one line that names it.
"""
import argparse

from toolrl.config import Config, add_config_args, config_from_args, dump_config, load_config  # noqa: F401


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    parser.add_argument("--get", metavar="KEY", help="print one resolved value, e.g. executor.port")
    args = parser.parse_args()
    cfg = config_from_args(args)
    if args.get:
        value = cfg
        for part in args.get.split("."):
            if not hasattr(value, part):
                raise SystemExit(f"config error: unknown key '{args.get}'")
            value = getattr(value, part)
        print(value)
    elif args.print:
        print(dump_config(cfg), end="")
    else:
        print("config OK")


if __name__ == "__main__":
    main()
