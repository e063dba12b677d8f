"""Sandboxed Python execution: the executor service, its fork server and its clients.

Grouped by the process each module runs in (see docs/EXECUTOR.md for the map):
    api, client, local     clients (and api is the front end's wire format too)
    main, __main__         `python -m toolrl.executor`: the front end's entry point
    ipc, syscalls          shared by the processes below
    frontend/              the HTTP service
    forkserver/            the fork server: start-up, manager, sweeper, zygotes
    runner/                the child that runs the code

Clients import `toolrl.executor.client` and `toolrl.executor.api` only.
"""
