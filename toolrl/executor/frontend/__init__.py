"""The front end: the executor's HTTP service (uvicorn, multi-threaded, never forks runners)."""
