"""Sandboxed Python execution: the executor service, its fork server and its clients.

See docs/EXECUTOR.md. Clients import `toolrl.sandbox.client` and `toolrl.sandbox.api` only.
"""
