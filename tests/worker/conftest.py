"""What the worker's tests share: the real executor service, one per test module."""
import pytest

from procs import Proc, free_port  # tests/ is on sys.path (tests/conftest.py)


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    """The executor service's URL."""
    port = free_port()
    ex = Proc("executor", ["executor_service.py", "--port", str(port)], tmp_path_factory.mktemp("executor"))
    try:
        ex.wait_http(f"http://127.0.0.1:{port}/health", 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        ex.stop()
