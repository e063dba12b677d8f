"""The sandboxed Python execution service.

    python executor_service.py [--config F] [--set k=v] [--host H] [--port P]
    python -m toolrl.executor ...          (the same; what the package itself starts)

Binds 127.0.0.1 unless told otherwise. See docs/EXECUTOR.md.
"""
import argparse

from toolrl.config import add_config_args, config_from_args
from toolrl.net import add_bind_args, serve, setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="executor_service.py", description=__doc__.splitlines()[0])
    add_config_args(parser)
    add_bind_args(parser, "executor")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    cfg = config_from_args(args).executor
    setup_logging("toolrl.executor", args.log_level)

    from toolrl.executor.frontend.app import create_app  # after parsing: --help stays fast

    serve(create_app(cfg), args.host or cfg.host, args.port or cfg.port, cfg.token, "executor")
