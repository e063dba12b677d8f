"""`python -m toolrl.executor.forkserver FD`: how the front end starts the fork server."""
from toolrl.executor.forkserver.boot import main

main()
