"""The sandboxed Python execution service.

    python executor_service.py [--config F] [--set k=v] [--host H] [--port P]

Binds 127.0.0.1 unless told otherwise. All logic lives in toolrl.executor (docs/EXECUTOR.md).
"""
import argparse

from toolrl.config import add_config_args, config_from_args
from toolrl.executor.service import create_app
from toolrl.net import serve, setup_logging


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    parser.add_argument("--host", help="bind address (default: executor.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: executor.port)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    cfg = config_from_args(args).executor
    setup_logging("toolrl.executor", args.log_level)
    serve(create_app(cfg), args.host or cfg.host, args.port or cfg.port)


if __name__ == "__main__":
    main()
