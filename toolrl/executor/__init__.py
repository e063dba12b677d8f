"""Sandboxed Python execution: the executor service, its fork server and its clients.

See docs/EXECUTOR.md. Clients import `toolrl.executor.client` and `toolrl.executor.api` only.
"""
