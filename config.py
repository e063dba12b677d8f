"""The one config of the system: `python config.py --config FILE [--set k=v ...] --print`.

Every service reads the same typed tree (defined in toolrl/config.py): model, data, prompt,
executor, ref_server, rollout, rewards, grpo, teacher, learner, eval, logging, launch. An unknown
key or a bad value exits non-zero with one line that names it.
"""
import argparse

from toolrl.config import Config, add_config_args, config_from_args, dump_config, load_config  # noqa: F401


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    parser.add_argument("--get", metavar="KEY", action="append",
                        help="print a resolved value, e.g. executor.port; repeatable, one line each "
                             "(lists as 1,2,3, null as an empty line)")
    args = parser.parse_args()
    cfg = config_from_args(args)
    if args.get:
        for key in args.get:
            value = cfg
            for part in key.split("."):
                if not hasattr(value, part):
                    raise SystemExit(f"config error: unknown key '{key}'")
                value = getattr(value, part)
            # shell-friendly: a list as 1,2,3 and None as an empty line (launch.sh reads these)
            print(",".join(map(str, value)) if isinstance(value, list) else "" if value is None else value)
    elif args.print:
        print(dump_config(cfg), end="")
    else:
        print("config OK")


if __name__ == "__main__":
    main()
