"""The executor service for real, against hostile code.

One service (a subprocess on a free port) serves the whole module. After every case the service must
still answer /health and no process may be left with a slot uid: `clean` checks both.
"""
from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import pytest

from toolrl.executor.client import ExecutorClient
from toolrl.executor.local import LocalExecutor

pytestmark = pytest.mark.timeout(120)


def sandbox_pid_ns(forkserver_pid: int) -> str:
    """The PID namespace the fork server made for its runners (its first process unshared it)."""
    return os.readlink(f"/proc/{forkserver_pid}/ns/pid_for_children")


def processes_with_uid(lo: int, hi: int, pid_ns: str | None = None) -> list[str]:
    """Live processes whose real uid is in [lo, hi], seen from the host; only those in `pid_ns` when
    given (other executors on this machine may use the same uids). A zombie is not live, unless only
    its main thread has exited and other threads still run (State Z, Threads > 1)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
            if pid_ns is not None and os.readlink(f"/proc/{name}/ns/pid") != pid_ns:
                continue
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields["Uid"].split()[0])
        dead = fields.get("State", "").strip().startswith(("Z", "X")) and int(fields.get("Threads", "1")) <= 1
        if lo <= uid <= hi and not dead:
            found.append(f"pid {name} uid {uid} {fields.get('Name', '').strip()}")
    return found


def wait_for(fn, timeout_s: float = 3.0):
    """fn() until it returns something falsy or the time is up; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if not value or time.monotonic() >= deadline:
            return value
        time.sleep(0.05)


class Service:
    def __init__(self, ex: LocalExecutor, client: ExecutorClient):
        self.ex, self.c = ex, client
        h = client._http.get("/health").json()
        self.health = h
        self.slot_uids = h["uids"]["slots"]
        self.session_uids = h["uids"]["sessions"]
        self.pid_ns = sandbox_pid_ns(h["forkserver_pid"])

    def leftovers(self) -> list[str]:
        return processes_with_uid(*self.slot_uids, pid_ns=self.pid_ns)

    def run(self, code: str, **kw):
        return self.c.execute(code, **kw)

    def clean(self, wait_s: float = 0.0) -> None:
        """The service answers and no slot-uid process survives (optionally after a short wait)."""
        assert self.c.health(), "the service stopped answering /health"
        left = self.leftovers() if not wait_s else wait_for(self.leftovers, wait_s)
        assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    log = tmp_path_factory.mktemp("executor") / "executor.log"
    with LocalExecutor(sets=["executor.workers=2", "executor.max_output_bytes=4096",
                             "executor.output_kill_bytes=262144", "executor.memory_mb=256"],
                       log_path=log) as ex:
        with ExecutorClient(ex.url, timeout_s=60) as c:
            yield Service(ex, c)


@pytest.fixture
def s(svc):
    yield svc
    svc.clean()


# -- basics ----------------------------------------------------------------------------------------

def test_math_scoping_one_globals_dict(s):
    r = s.run("import math\ndef f(x): return math.sqrt(x)\nprint(f(4))")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "2.0\n", "")


def test_stdout_and_stderr_are_separate(s):
    r = s.run("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (r.stdout, r.stderr, r.status) == ("out\n", "err\n", "ok")


def test_warm_modules_and_fresh_randomness(s):
    code = ("import numpy as np, sympy, random\n"
            "print(sympy.factorint(360), np.arange(3).sum(), random.random(), np.random.rand())")
    a, b = s.run(code), s.run(code)
    assert a.status == b.status == "ok"
    assert a.stdout.startswith("{2: 3, 3: 2, 5: 1} 3 ")
    assert a.stdout != b.stdout, "every run must reseed random and numpy.random"


def test_light_and_heavy_zygotes(s):
    probe = "import sys\nprint(len(sys.modules))"
    light = int(s.run(probe).stdout)
    heavy = int(s.run(probe + "\nimport numpy").stdout.split()[0])
    assert heavy > light + 100, (light, heavy)  # numpy code starts with numpy (and sympy) loaded
    r = s.run("m = __import__('nu' + 'mpy')\nprint(m.arange(4).sum())")  # a computed name still works
    assert (r.status, r.stdout) == ("ok", "6\n")
    assert set(s.health["isolation"]["zygotes"]) == {"light", "heavy"}


def test_environment_is_clean(s):
    r = s.run("import os, json\nprint(json.dumps(dict(os.environ)))\nprint(os.getuid(), os.getcwd())")
    import json
    env = json.loads(r.stdout.splitlines()[0])
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # no GPU for model-written code
    assert not any(k for k in env if "TOKEN" in k or k.startswith(("PYTEST", "TOOLRL"))), env
    uid, cwd = r.stdout.splitlines()[1].split()
    assert s.slot_uids[0] <= int(uid) <= s.slot_uids[1]
    assert env["HOME"] == cwd


def test_health_reports_isolation(s):
    iso = s.health["isolation"]
    if os.geteuid() == 0:  # what CI and the dev machine have: every layer, nothing missing
        assert iso["missing"] == [], iso["missing"]
        assert all(iso["namespaces"][k] for k in ("mountns", "netns", "pidns", "ipcns", "utsns"))
        assert iso["uid_drop"] is True
        assert iso["filesystem"]["readonly_root"] and iso["filesystem"]["proc_private"]
    assert "sympy" in iso["preimported"] and "numpy" in iso["preimported"]


# -- hangs and timeouts ------------------------------------------------------------------------------

HANGS = {
    "infinite_loop": "while True: pass",
    "catches_timeout": "import time\nwhile True:\n    try:\n        time.sleep(0.01)\n        raise TimeoutError\n"
                       "    except BaseException:\n        pass",
    "ignores_signals": "import signal\nfor s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT):\n"
                       "    signal.signal(s, signal.SIG_IGN)\nsignal.alarm(1)\nwhile True: pass",
    "long_c_call": "print(sum(range(10**12)))",
    "sleep_in_subprocess": "import subprocess\nsubprocess.run(['sleep', '100'])",
    "sleep_in_python_subprocess": ("import subprocess, sys\n"
                                   "subprocess.run([sys.executable, '-c', 'import time; time.sleep(100)'])"),
}


@pytest.mark.parametrize("name", list(HANGS))
def test_hangs_are_killed_at_the_deadline(s, name):
    t = time.monotonic()
    r = s.run(HANGS[name], timeout_s=1)
    took = time.monotonic() - t
    assert r.status == "timeout", r
    assert r.exit_code == -9 and "time limit" in r.stderr
    assert 0.9 <= r.wall_ms / 1000 < 3.0 and took < 6.0, (r.wall_ms, took)


def test_what_was_printed_before_a_kill_is_kept(s):
    r = s.run("import os, sys\nprint('before the loop')\nprint('to stderr', file=sys.stderr)\nwhile True: pass",
              timeout_s=1)
    assert r.status == "timeout" and r.stdout == "before the loop\n" and r.stderr.startswith("to stderr\n"), r
    r = s.run("import os, signal\nprint('before the crash')\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert r.status == "error" and r.stdout == "before the crash\n", r


def test_no_pseudo_terminals(s):
    r = s.run("import os\ntry:\n    os.openpty()\n    print('pty')\nexcept OSError as e:\n    print('no pty')")
    assert (r.status, r.stdout) == ("ok", "no pty\n"), r


def test_code_can_make_no_namespaces_and_mount_nothing(s):
    """The seccomp filter: without it an unprivileged user namespace (and a tmpfs mounted inside it)
    is one call away. Threads, subprocesses and fork still work."""
    code = ("import ctypes, os, subprocess, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "out = [libc.unshare(0x10000000), libc.unshare(0x00020000), libc.mount(b'n', b'.', b'tmpfs', 0, None)]\n"
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
            "out.append(subprocess.run(['true']).returncode)\npid = os.fork()\nif pid == 0:\n    os._exit(3)\n"
            "out.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\nprint(out)")
    r = s.run(code)
    assert (r.status, r.stdout) == ("ok", "thread\n[-1, -1, -1, 0, 3]\n"), r
    assert s.health["isolation"]["seccomp"] is True


def test_sockets_only_of_the_unix_ip_and_netlink_families(s):
    """AF_VSOCK would reach the hypervisor past every network namespace; AF_ALG is kernel surface."""
    code = ("import socket\nout = []\nfor fam in (40, 38):  # AF_VSOCK, AF_ALG\n    try:\n"
            "        socket.socket(fam, socket.SOCK_STREAM if fam == 40 else socket.SOCK_SEQPACKET)\n"
            "        out.append('open')\n    except OSError as e:\n        out.append(e.errno)\n"
            "socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()\n"
            "socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close()\n"
            "a, b = socket.socketpair()\na.sendall(b'x')\nout.append(b.recv(1))\nprint(out)")
    r = s.run(code)
    assert (r.status, r.stdout) == ("ok", "[97, 97, b'x']\n"), r  # EAFNOSUPPORT


# -- processes and threads ---------------------------------------------------------------------------

def test_fork_bomb(s):
    r = s.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=1)
    assert r.status == "timeout"


def test_daemonised_grandchild_is_killed(s):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(1000)\n    os._exit(0)\nos.wait()\nprint('parent done')")
    r = s.run(code)
    assert (r.status, r.stdout) == ("ok", "parent done\n")
    # `s` fixture asserts no slot-uid process survives


def test_leftover_non_daemon_thread_does_not_hold_the_run(s):
    r = s.run("import threading, time\nthreading.Thread(target=time.sleep, args=(1000,)).start()\nprint('main done')",
              timeout_s=5)
    assert (r.status, r.stdout) == ("ok", "main done\n")
    assert r.wall_ms < 2000


def test_killing_the_parent_is_refused(s):
    r = s.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    assert r.status == "error" and "PermissionError" in r.stderr


def test_kill_minus_one_reaches_only_its_own_uid(s):
    r = s.run("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('still here')")
    assert (r.status, r.stdout) == ("ok", "still here\n")
    assert s.run("print(1)").stdout == "1\n"


def test_kill_self(s):
    r = s.run("import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGTERM)")
    assert (r.status, r.exit_code, r.stdout) == ("killed", -15, "bye\n")


# -- output -----------------------------------------------------------------------------------------

def test_100mb_print_is_cut_and_killed(s):
    r = s.run("print('x' * 100_000_000)", timeout_s=10)
    assert r.status == "output_limit" and r.truncated
    assert r.stdout.startswith("xxxx") and "truncated" in r.stdout
    assert len(r.stdout) < 5000


def test_endless_printing_is_killed_fast(s):
    r = s.run("while True: print('spam')", timeout_s=10)
    assert r.status == "output_limit" and r.truncated and r.wall_ms < 5000


def test_output_over_the_cap_keeps_head_and_tail(s):
    r = s.run("print('A' * 3000 + 'B' * 10000 + 'C' * 3000)\nimport sys; print('tail-err', file=sys.stderr)")
    assert r.status == "ok" and r.truncated
    assert r.stdout.startswith("A" * 100) and r.stdout.rstrip().endswith("C" * 100)
    assert "bytes omitted" in r.stdout and len(r.stdout) < 4200
    assert r.stderr == "tail-err\n"


def test_invalid_utf8_is_replaced(s):
    r = s.run("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end\\n')")
    assert r.status == "ok" and r.stdout == "ok \ufffd\ufffd end\n"


def test_closing_stdout(s):
    r = s.run("import os\nos.close(1)\nprint('lost')")  # line-buffered: the print itself fails, as it would in a shell
    assert r.status == "error" and r.stdout == "" and "Bad file descriptor" in r.stderr, r
    r = s.run("import sys\nsys.stdout.close()\nprint('x')")
    assert r.status == "error" and "closed file" in r.stderr


def test_dup2_over_stdout(s):
    r = s.run("import os, sys\nos.dup2(os.open('/dev/null', os.O_WRONLY), 1)\n"
              "print('hidden')\nprint('e', file=sys.stderr)")
    assert (r.status, r.stdout, r.stderr) == ("ok", "", "e\n")


# -- resources --------------------------------------------------------------------------------------

def test_memory_bomb(s):
    r = s.run("x = []\nwhile True:\n    x.append(bytearray(10**7))", timeout_s=10)
    assert r.status == "oom" and not r.executor_fault, r  # its own limit: the code's outcome


def test_numpy_memory_bomb(s):
    r = s.run("import numpy as np\na = np.ones((50_000, 50_000))", timeout_s=10)
    assert r.status == "oom" and "MemoryError" in r.stderr


def test_memory_bomb_across_forked_children(s):
    # each child stays under RLIMIT_AS; only the lane's cgroup sees the sum
    code = ("import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        b = bytearray(200 * 2**20)\n"
            "        b[::4096] = b'x' * len(b[::4096])\n        time.sleep(30)\nos.wait()\nprint('survived')")
    r = s.run(code, timeout_s=5)
    assert r.status in ("timeout", "oom", "ok", "error"), r
    s.clean()


def test_deep_recursion(s):
    r = s.run("def f(n): return f(n + 1)\nf(0)")
    assert r.status == "error" and "RecursionError" in r.stderr
    assert len(r.stderr) < 3000  # short: the repeated frames are collapsed and capped


def test_deep_recursion_with_a_raised_limit(s):
    r = s.run("import sys\nsys.setrecursionlimit(10**8)\ndef f(n): return f(n + 1)\nf(0)", timeout_s=3)
    assert r.status in ("error", "oom", "timeout"), r


def test_file_size_bomb(s):
    r = s.run("with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**20)", timeout_s=10)
    assert r.status == "error" and "File too large" in r.stderr


# A run that leaves the deepest tree it can, a file, and marks on its working dir itself.
LEAVE_TRACES = """import os
os.utime('.', (1, 1))
os.chmod('.', 0o777)
try:
    os.setxattr('.', 'user.mark', b'x')
except OSError:
    pass
open('leftover', 'w').write('x')
for i in range(3000):
    os.mkdir('d')
    os.chdir('d')
print('deep')
"""
SEE_TRACES = """import os
st = os.stat('.')
try:
    marks = os.listxattr('.')
except OSError:
    marks = []
print(sorted(os.listdir('.')), st.st_mtime > 1, oct(st.st_mode & 0o777), marks)
"""


def check_nothing_carries_over(c):
    pid = c._http.get("/health").json()["forkserver_pid"]
    for _ in range(3):  # twice over the slots: every slot is cleaned after such a run
        r = c.execute(LEAVE_TRACES, timeout_s=20)
        assert (r.status, r.stdout) == ("ok", "deep\n"), r
    for _ in range(4):
        r = c.execute(SEE_TRACES)
        assert (r.status, r.stdout) == ("ok", "[] True 0o700 []\n"), r
    assert c._http.get("/health").json()["forkserver_pid"] == pid  # the fork server lived through it


def test_a_run_leaves_nothing_to_the_next_and_cannot_break_cleanup(s):
    check_nothing_carries_over(s.c)


def test_fd_exhaustion(s):
    r = s.run("fs = []\nwhile True:\n    fs.append(open('/dev/null'))", timeout_s=5)
    assert r.status == "error" and "Too many open files" in r.stderr


# -- reach ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/tmp/x", "/var/tmp/x", "/dev/shm/x", "/etc/x", "../x", str(Path.cwd() / "pwned"),
                                  "/root/x", "/home/x"])
def test_writes_outside_the_working_dir_fail(s, path):
    r = s.run(f"open({path!r}, 'w').write('x')")
    assert r.status == "error" and ("PermissionError" in r.stderr or "Read-only file system" in r.stderr
                                    or "No such file" in r.stderr), r.stderr
    if path.startswith(str(Path.cwd())):
        assert not Path(path).exists()


def test_writes_inside_the_working_dir_work_and_vanish(s):
    r = s.run("import os, tempfile\nopen('a.txt', 'w').write('hi')\nopen(os.path.join(tempfile.gettempdir(), 'b'), 'w')"
              "\nprint(sorted(os.listdir('.')))")
    assert r.status == "ok" and r.stdout == "['a.txt', 'b']\n"
    r = s.run("import os\nprint(os.listdir('.'))")
    assert r.stdout == "[]\n", "a run must not see the files of an earlier run"


def test_cannot_read_another_lane_or_list_the_scratch_root(s):
    mine = s.run("import os\nprint(os.getcwd())", session_id="victim")
    other = mine.stdout.strip()
    s.run("open('secret.txt', 'w').write('s3cret')", session_id="victim")
    r = s.run(f"import os\nprint(os.listdir({other!r}))")
    assert r.status == "error" and "PermissionError" in r.stderr
    r = s.run(f"print(open({other + '/secret.txt'!r}).read())")
    assert r.status == "error" and "PermissionError" in r.stderr
    r = s.run("import os\nprint(os.listdir(os.path.dirname(os.getcwd())))")
    assert r.status == "error" and "PermissionError" in r.stderr
    assert s.c.delete_session("victim")


def test_proc_1_environ_and_other_processes(s):
    r = s.run("print(open('/proc/1/environ').read())")
    assert r.status == "error" and "PermissionError" in r.stderr
    r = s.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit())[:1])")
    assert r.stdout == "[1]\n"  # a private PID namespace: the host's processes are not there


def test_no_network_not_even_the_service_port(s):
    port = s.ex.port
    r = s.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert r.status == "error" and ("Network is unreachable" in r.stderr or "Connection refused" in r.stderr)
    r = s.run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert r.status == "error" and "OSError" in r.stderr


def test_setuid_binaries_gain_nothing(s):
    r = s.run("import subprocess\nprint(subprocess.run(['id', '-u'], capture_output=True, text=True).stdout)"
              "\nprint(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])")
    assert r.status == "ok"
    uid, nnp = r.stdout.split()
    assert int(uid) >= s.slot_uids[0] and nnp == "1"


# -- exits and errors -------------------------------------------------------------------------------

def test_sys_exit_3(s):
    r = s.run("import sys\nprint('before')\nsys.exit(3)")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("error", 3, "before\n", "")


def test_sys_exit_message(s):
    r = s.run("import sys\nsys.exit('bad input')")
    assert (r.status, r.exit_code, r.stderr) == ("error", 1, "bad input\n")


def test_os_exit_0_keeps_flushed_output(s):
    r = s.run("import os\nprint('flushed', flush=True)\nos._exit(0)")
    assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "flushed\n")


def test_syntax_error_is_short(s):
    r = s.run("def f(:\n    pass")
    assert r.status == "error" and r.exit_code == 1
    assert "SyntaxError" in r.stderr and "<code>" in r.stderr
    assert "toolrl" not in r.stderr and "Traceback" not in r.stderr


def test_traceback_has_no_harness_frames(s):
    r = s.run("def g():\n    return 1 / 0\ng()")
    assert r.status == "error" and r.stderr.startswith("Traceback (most recent call last):\n  File \"<code>\", line 3")
    assert "ZeroDivisionError: division by zero" in r.stderr and "toolrl" not in r.stderr
    assert "return 1 / 0" in r.stderr  # source lines are shown


def test_input_at_eof_and_with_stdin(s):
    r = s.run("input()")
    assert r.status == "error" and "EOFError" in r.stderr
    r = s.run("a = input(); b = input()\nprint(int(a) + int(b))", stdin="2\n3\n")
    assert (r.status, r.stdout) == ("ok", "5\n")


def test_big_stdin_and_code_pass_through_the_job_pipe(s):
    # both are larger than a pipe buffer: the fork server must hand them over without blocking
    r = s.run("import sys\ndata = sys.stdin.read()\nprint(len(data), data[-3:])", stdin="ab" * 150_000 + "end")
    assert (r.status, r.stdout) == ("ok", "300003 end\n")
    code = "x = 0\n" + "x += 1\n" * 40_000 + "print(x)"
    r = s.run(code, timeout_s=20)
    assert (r.status, r.stdout) == ("ok", "40000\n")
    r = s.run("print(len(input()))", stdin="y" * 200_000 + "\n", session_id="big")
    assert r.stdout == "200000\n" and s.c.delete_session("big")


def test_empty_code(s):
    r = s.run("")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "", "")


# -- stress -----------------------------------------------------------------------------------------

def _mixed(i: int) -> tuple[dict, callable]:
    kind = i % 6
    if kind == 0:
        return {"code": f"print({i} * 3)"}, lambda r: r.status == "ok" and r.stdout == f"{i * 3}\n"
    if kind == 1:
        return {"code": f"raise ValueError('v{i}')"}, lambda r: r.status == "error" and f"ValueError: v{i}" in r.stderr
    if kind == 2:
        return ({"code": f"import sys; sys.exit({i % 200 + 1})"},
                lambda r: r.status == "error" and r.exit_code == i % 200 + 1)
    if kind == 3:
        return ({"code": "print(input()[::-1])", "stdin": f"abc{i}\n"},
                lambda r: r.status == "ok" and r.stdout == f"abc{i}"[::-1] + "\n")
    if kind == 4:
        return ({"code": "while True: pass", "timeout_s": 0.3}, lambda r: r.status == "timeout")
    return ({"code": f"import math\nprint(math.factorial({i % 50}))"},
            lambda r: r.status == "ok" and r.stdout == f"{__import__('math').factorial(i % 50)}\n")


def test_stress_many_concurrent_clients(s):
    n, clients = 360, 16
    jobs = [_mixed(i) for i in range(n)]

    def worker(k: int) -> list[str]:
        bad = []
        with ExecutorClient(s.ex.url, timeout_s=120) as c:
            for i in range(k, n, clients):
                req, ok = jobs[i]
                if i % 5 == 0:  # some as one-item batches, the rest one by one
                    [r] = c.execute_batch([req])
                else:
                    r = c.execute(**req)
                if not ok(r):
                    bad.append(f"{i}: {req} -> {r}")
        return bad

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        bad = [b for part in pool.map(worker, range(clients)) for b in part]
    assert not bad, bad[:5]


def test_stress_big_batch_in_order(s):
    items = [{"code": f"print({i})"} for i in range(200)]
    res = s.c.execute_batch(items)
    assert [r.stdout for r in res] == [f"{i}\n" for i in range(200)]
    assert all(r.status == "ok" for r in res)
