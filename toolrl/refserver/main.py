"""ref_server.py: reference logprobs, the bounded batch queue and the worker registry.

    python ref_server.py [--config F] [--set k=v] [--host H] [--port P]
    python ref_server.py --replica-of URL [--replica-id ID] [--config F] [--set k=v]

Gen workers upload scored groups; the learner pulls batches carrying reference logprobs. With
grpo.beta = 0 no reference model is loaded and samples pass straight through. With --replica-of, a
reference replica: no server, it computes reference logprobs for the server at URL (more GPUs for
the reference forward; toolrl/refserver/replicas.py). See docs/REF_SERVER.md.
"""
from __future__ import annotations

import argparse

from toolrl.config import add_config_args, config_from_args
from toolrl.net import add_bind_args, serve, setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ref_server.py", description=__doc__.splitlines()[0])
    add_config_args(parser)
    add_bind_args(parser, "ref_server")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--replica-of", metavar="URL", help="run as a reference replica of the server at URL")
    parser.add_argument("--replica-id", help="this replica's name in the server's stats (default: random)")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if args.replica_of:
        log = setup_logging("ref_replica", args.log_level)
        from toolrl.refserver.replicas import run_replica

        run_replica(cfg, args.replica_of, args.replica_id, log=log)
        return
    log = setup_logging("ref_server", args.log_level)

    from toolrl.refserver.app import create_app  # after parsing: --help stays fast (torch, transformers)

    app = create_app(cfg, log=log)
    host, port = args.host or cfg.ref_server.host, args.port or cfg.ref_server.port
    print(f"reference server listening on http://{host}:{port}", flush=True)
    serve(app, host, port, cfg.ref_server.token, "ref_server")
