"""executor_service.py: the sandboxed Python execution service (docs/EXECUTOR.md).

    python executor_service.py [--config F] [--set k=v] [--host H] [--port P]

Model-written code runs here, in a fork server that holds nothing of value: each execution in a
fresh process with its own uid, namespaces and cgroup limits. Binds 127.0.0.1 unless told otherwise.
"""
from toolrl.executor.main import main

if __name__ == "__main__":
    main()
