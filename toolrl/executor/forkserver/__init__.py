"""The fork server: the processes that make, run and clean up after runners. Started by the front end
as `python -m toolrl.executor.forkserver FD` (boot.py); see docs/EXECUTOR.md for the process tree.
"""
