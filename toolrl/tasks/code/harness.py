"""The test harness: runs inside the executor with a code task's program and tests, and reports
each test on a line that starts with the run's nonce (toolrl.tasks.code.judge explains why a
program cannot fake a report, and reads the lines back). The nonce and the tests arrive on stdin.

The source of `_toolrl_digest`, `_toolrl_codec` and `_toolrl_harness` is what goes to the executor
(judge.build_harness appends the call), so they are self-contained: everything they use is imported
or defined inside them or sent beside, nothing comes from toolrl. For `assert` tasks the program runs
in a process of its own (toolrl.tasks.code.companion); for `stdio` and `call` tasks, whose expected
outputs never enter the sandbox, here, and what the harness captures first (os.write, os._exit, the
digest, ...) the program cannot rebind.
"""
from toolrl.tasks.code.companion import _toolrl_codec  # noqa: F401  (sent beside the harness: judge.HARNESS)


def _toolrl_digest(text, whole=False):
    """An output as reported: itself while its JSON is at most 100 bytes, else the SHA-256 of its
    canonical form (tokens, numbers to 6 decimals), so a report line stays small whatever the program
    prints (found in review: 200 emoji took 2.4 KB of escapes, and a few such lines pushed the reports
    past the executor's output cap, which leaves a sample unscored), and a long output meets the
    tolerance the judge gives a short one token by token (found in review: a double space or float
    noise failed for long outputs only). `whole`: the hash whatever the length (the judge's side, for
    an expected output the harness's may have been sent as). Sent with the harness and used by the
    judge."""
    import hashlib
    import json

    if not whole and len(text) <= 100 and len(json.dumps(text)) <= 100:
        return text
    out = []
    for tok in text.split():
        try:
            f = float(tok)
        except ValueError:
            f = None
        out.append(format(round(f, 6) + 0.0, ".6f") if f is not None and abs(f) < float("inf") else tok)
    return {"sha256": hashlib.sha256(" ".join(out).encode()).hexdigest()}


def _toolrl_value_json(value):
    """A returned value's JSON as Python's == sees it (APPS's grader compares so): integral floats
    and bools as ints, keys sorted, so that equal values hash alike when a long one travels as a hash
    (found in review: [0.0, 1.0, ...] for range(20) failed once it was hashed). Sent with the harness
    and used by the judge."""
    import json

    def norm(v):
        if type(v) is bool:
            return int(v)
        if type(v) is float and v == v and abs(v) != float("inf") and v == int(v):
            return int(v)
        if type(v) is list:
            return [norm(x) for x in v]
        if type(v) is dict:
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(json.loads(json.dumps(value, default=list))), sort_keys=True)


def _toolrl_harness(program, companion):
    import ast
    import builtins
    import io
    import json
    import linecache
    import os
    import signal
    import sys
    import time
    write, exit_, read, settrace, setprofile = os.write, os._exit, os.read, sys.settrace, sys.setprofile
    digest, value_json = _toolrl_digest, _toolrl_value_json  # sent beside this function
    sleep = time.sleep
    listdir, dup, dup2, lseek, memfd, close = os.listdir, os.dup, os.dup2, os.lseek, os.memfd_create, os.close
    # The nonce's line, then the tests: on stdin, never in this script's text
    chunks = []
    while True:
        chunk = read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    nonce, _, spec = b"".join(chunks).decode().partition("\n")
    nonce = nonce.strip()
    spec = json.loads(spec)
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again: input() sees EOF, never the nonce
    report_fd = dup(1)  # reports go here; fd 1 itself is the program's (stdio tasks capture it)
    dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what a program writes to fd 1 never crowds the reports
    encode = json.JSONEncoder().encode  # a private encoder: the program can patch json's own
    real_builtins = dict(builtins.__dict__)
    import collections
    import decimal
    import fractions
    names = ("builtins", "math", "cmath", "re", "collections", "itertools", "functools", "operator", "heapq",
             "bisect", "string", "statistics", "decimal", "fractions", "copy", "json", "random", "io", "os",
             "signal", "typing")
    snap = [(n, sys.modules[n], dict(sys.modules[n].__dict__)) for n in names if n in sys.modules]
    extra = (collections.Counter, collections.OrderedDict, collections.defaultdict, collections.deque,
             fractions.Fraction, decimal.Decimal)
    cls_snap = [(c, dict(c.__dict__)) for c in extra]
    plain_types = {int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset,
                   range, *extra}
    saved_stdout, saved_stderr = sys.stdout, sys.stderr

    def restore():
        settrace(None)
        setprofile(None)
        for n, m, d in snap:
            sys.modules[n] = m
            md = m.__dict__
            for k in [k for k in md if k not in d]:
                del md[k]
            for k, v in d.items():
                if md.get(k, d) is not v:
                    md[k] = v
        for c, d in cls_snap:
            for k in [k for k in c.__dict__ if k not in d]:
                try:
                    delattr(c, k)
                except (AttributeError, TypeError):
                    pass
            for k, v in d.items():
                if c.__dict__.get(k, d) is not v:
                    try:
                        setattr(c, k, v)
                    except (AttributeError, TypeError):
                        pass

    def plain(v, budget):
        budget[0] += 1
        if budget[0] > 1_000_000 or type(v) not in plain_types:
            return False
        if type(v) in (list, tuple, set, frozenset, collections.deque):
            return all(plain(x, budget) for x in v)
        if isinstance(v, dict):
            return all(plain(k, budget) and plain(x, budget) for k, x in v.items())
        return True

    class NotPlain(Exception):
        pass

    depth = [0]

    def guard(fn):
        def call(*a, **k):
            if depth[0]:  # a call from the program to itself: checked when the outer call returns
                return fn(*a, **k)
            depth[0] += 1
            try:
                out = fn(*a, **k)
            finally:
                depth[0] -= 1
                restore()
            if not plain(out, [0]):
                raise NotPlain(f"{getattr(fn, '__name__', 'function')} returned {type(out).__name__}, not plain data")
            return out
        return call

    class Timeout(BaseException):
        pass

    def on_alarm(signum, frame):
        raise Timeout()

    def report(i, ok, payload=None):
        if not ok and type(payload) is str:  # a program's exception name is its to choose: short, printable
            payload = ascii(payload)[1:-1][:60]
        line = encode([i, ok, payload])
        write(report_fd, ("\n" + nonce + " " + line + "\n").encode())

    def alone():
        """What the program left running between our own steps: threads (they could patch the
        checker after `restore`), signal handlers and interval timers. Threads refuse the run;
        handlers and timers are reset."""
        for sig in (signal.SIGPROF, signal.SIGVTALRM, signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        if len(listdir("/proc/self/task")) > 1:
            report(-1, False, "threads")
            exit_(0)

    def run(code, ns, timeout, threads_finish=False):
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            exec(code, ns)
            # A script's own worker thread (`threading.Thread(target=main).start()`, the competitive
            # programmer's way to a bigger stack) finishes within the test's time. Only for scripts:
            # what they print is judged outside; a thread beside assert tests could patch the checker.
            while threads_finish and len(listdir("/proc/self/task")) > 1:
                sleep(0.002)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            restore()
            alone()

    def checked(v):  # what a test compares or asserts must be plain data, whatever produced it
        if not plain(v, [0]):
            raise NotPlain(f"a test compared {type(v).__name__}, not plain data")
        return v

    class Plainify(ast.NodeTransformer):
        """Every value a test compares (==, <, in, ...), negates, combines with and/or or asserts
        goes through `checked`: an object of the program's whose __eq__ or __bool__ agrees with
        anything cannot pass, however it was made (a class, a callable instance, a partial)."""
        VALUE_OPS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn)

        def wrap(self, node):
            return ast.Call(ast.Name("__harness_checked__", ast.Load()), [node], [])

        def visit_Compare(self, node):
            self.generic_visit(node)
            if all(isinstance(op, self.VALUE_OPS) for op in node.ops):
                node.left, node.comparators = self.wrap(node.left), [self.wrap(c) for c in node.comparators]
            return node

        def visit_UnaryOp(self, node):
            self.generic_visit(node)
            if isinstance(node.op, ast.Not):
                node.operand = self.wrap(node.operand)
            return node

        def visit_BoolOp(self, node):
            self.generic_visit(node)
            node.values = [self.wrap(v) for v in node.values]
            return node

        def visit_Assert(self, node):
            self.generic_visit(node)
            node.test = self.wrap(node.test)
            return node

    def compile_test(src, name):
        tree = ast.fix_missing_locations(Plainify().visit(ast.parse(src, name)))
        return compile(tree, name, "exec", dont_inherit=True, optimize=0)

    timeout, kind, entry = spec["per_test_timeout_s"], spec["kind"], spec.get("entry_point")
    try:
        compiled = compile(program, "<program>", "exec", dont_inherit=True, optimize=0)
    except BaseException:
        report(-1, False, "syntax")
        exit_(0)
    if kind == "assert":
        # The program runs in a process of its own (the companion, sent beside), started fresh: this
        # process holds the nonce, the report fd and the tests; it runs the tests and the setup, and
        # imports nothing on the program's behalf.
        try:
            import ctypes
            import fcntl

            if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: no reading our memory
                raise OSError("prctl(PR_SET_DUMPABLE) failed")
        except BaseException as exc:
            report(-1, False, {"infra": f"could not make the harness non-dumpable: {exc}"})
            exit_(0)
        program_path = list(sys.path)
        # What the tests import comes from the installation, never from a file the program wrote
        here = os.path.realpath(os.getcwd())
        sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != here
                       and not os.path.realpath(p).startswith(here + os.sep)]
        sys.path_importer_cache.clear()
        tests = []
        for test in spec["tests"]:
            try:
                tests.append(compile_test(test, "<test>"))
            except BaseException as exc:
                tests.append(exc)
        try:  # the setup (HumanEval's `def check(candidate)`) holds asserts too: checked alike
            setup = compile_test(spec["setup"], "<setup>") if spec.get("setup") else None
        except BaseException as exc:
            report(-1, False, type(exc).__name__)
            exit_(0)
        program_setup = spec.get("program_setup") or ""  # runs beside the program, and here for the tests
        prompt = spec.get("prompt") or ""  # HumanEval's prompt: its helpers are the task's
        modules = spec.get("modules") or ()  # standard modules the tests may use unimported
        boot_s = spec.get("boot_timeout_s") or 20.0  # for the program's process to start, beside its time
        spec.clear()
        linecache.clearcache()

        class ProgramError(Exception):
            """The program raised what the tests cannot see as a builtin, exited, or sent what is
            not plain data."""

        class Fatal(BaseException):
            """The program's process could not be started: the sandbox's failure, not the program's
            (a BaseException: a test's own `except Exception` must not swallow it)."""

        class Handle:
            """A function or object of the program's: every use is a request to its process."""
            __slots__ = ("_ref", "_gen")

            def __init__(self, ref_, gen):
                object.__setattr__(self, "_ref", ref_)
                object.__setattr__(self, "_gen", gen)

            def _wire(self):
                if self._ref[0] == "h" and self._gen != comp.gen:
                    raise ProgramError("an object of an earlier run of the program")
                return list(self._ref)

            def __call__(self, *args, **kwargs):
                out = comp.ask(["call", self._wire(), to_wire(list(args), [1 << 22]), to_wire(kwargs, [1 << 22])])
                # A function's result must be plain data, as in one process: an object of its own
                # could answer `candidate(x).startswith(y)` with True. Calling a capitalised name (a
                # class, by the tests' own convention: Pair(1, 2)) gives an object.
                if self._ref[0] == "g" and not self._ref[1][:1].isupper() and not plain(out, [0]):
                    raise NotPlain(f"{self._ref[1]} returned the program's object, not plain data")
                return out

            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return comp.ask(["attr", self._wire(), name])

            def __getitem__(self, key):
                return comp.ask(["item", self._wire(), to_wire(key, [1 << 22])])

            def __contains__(self, x):
                return expect(comp.ask(["contains", self._wire(), to_wire(x, [1 << 22])]), bool)

            def __len__(self):
                return expect(comp.ask(["len", self._wire()]), int)

            def __iter__(self):
                return iter(expect(comp.ask(["list", self._wire()]), list))

            def __str__(self):
                return expect(comp.ask(["str", self._wire()]), str)

            def __repr__(self):
                return "<the program's object>"

        def expect(v, t):
            if type(v) is not t:
                raise TypeError(f"the program's object gave {type(v).__name__}, not {t.__name__}")
            return v

        def ref(v):
            if type(v) is Handle:
                return v._wire()
            raise TypeError(f"a test passed {type(v).__name__} to the program: only plain data and its objects pass")

        def deref(x):
            if x[0] == "h" and type(x[1]) is int:
                return Handle(("h", x[1]), comp.gen)
            raise TypeError("malformed value")

        to_wire, from_wire, send, recv = _toolrl_codec(ref, deref, ast.literal_eval)
        # What the program raised, by name, as the builtin a test may expect; StopIteration would end
        # an `all(map(candidate, xs))` early as if every item passed
        exceptions = {k: v for k, v in real_builtins.items() if isinstance(v, type) and issubclass(v, Exception)
                      and not issubclass(v, (StopIteration, StopAsyncIteration))}

        def raised(name, message):
            try:
                return exceptions.get(name, ProgramError)(message)
            except BaseException:  # one that needs more arguments (UnicodeDecodeError)
                return ProgramError(message)

        class Companion:
            def __init__(self):
                self.pid, self.rfd, self.wfd, self.gen = None, None, None, 0

            def start(self):
                """A fresh interpreter that runs the program: ("ready", its names) or ("raised", why).
                Fatal when it cannot start (then nothing of it is left)."""
                self.gen += 1
                to_r = from_w = None  # the companion's ends; ours are self.rfd and self.wfd (stop() closes them)
                # The first start is not the program's time: on a loaded host it took longer than a
                # test's whole time, and the sample was left unscored (CI, 2026-11-30). A restart
                # (after the program timed out or exited) is the program's doing, in its test's time.
                left = signal.setitimer(signal.ITIMER_REAL, boot_s)[0] if self.gen == 1 else None
                try:
                    to_r, self.wfd = os.pipe()  # pipes: nothing more to import
                    self.rfd, from_w = os.pipe()
                    self.pid = os.fork()
                    if self.pid == 0:
                        try:
                            os.setsid()  # its own group: stop() takes down what it forked too
                            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_r, from_w)]
                            null = os.open(os.devnull, os.O_RDWR)
                            for target in (0, 1, 2):  # no stdin (the nonce), no executor output
                                os.dup2(null, target)
                            os.dup2(high[0], 3)
                            os.dup2(high[1], 4)
                            os.closerange(5, 1 << 16)
                            os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", companion])
                        finally:
                            exit_(127)
                    close(to_r)
                    close(from_w)
                    to_r = from_w = None
                    first = recv(self.rfd)
                except BaseException as exc:  # no pipe, no fork, no interpreter, or no boot in time
                    for fd in (to_r, from_w):
                        if fd is not None:
                            close(fd)
                    self.stop()
                    raise Fatal(f"the program's process did not start ({type(exc).__name__}: {exc})") from None
                finally:
                    if left is not None:
                        signal.setitimer(signal.ITIMER_REAL, left)  # the program's time as it was (0: none)
                if first != ["boot"]:  # exec failed, or it could not drop its capabilities
                    self.stop()
                    raise Fatal(first[1] if type(first) is list and len(first) == 2 and first[0] == "fatal"
                                and type(first[1]) is str else "the program's process did not start")
                try:
                    send(self.wfd, {"program": program, "setup": program_setup, "path": program_path})
                    return self.answer()
                except BaseException:
                    self.stop()
                    raise

            def stop(self):
                pid, fds = self.pid, (self.rfd, self.wfd)
                self.pid = self.rfd = self.wfd = None  # first: an alarm below leaves nothing half done
                blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
                try:
                    if pid:
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except OSError:
                            pass
                        try:
                            os.waitpid(pid, 0)
                        except OSError:
                            pass
                    for fd in fds:
                        if fd is not None:
                            try:
                                close(fd)
                            except OSError:
                                pass
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

            def answer(self):
                """("ok", value), ("raised", the exception's name) or ("ready", names)."""
                msg = recv(self.rfd)
                if type(msg) is not list or len(msg) != 2:
                    raise ProgramError("the program's process exited" if msg is None else "a malformed reply")
                if msg[0] == "e" and type(msg[1]) is str:
                    return "raised", msg[1]
                if msg[0] == "ok":
                    return "ok", from_wire(msg[1], [1 << 22])
                if msg[0] == "ready" and type(msg[1]) is dict:
                    return "ready", msg[1]
                raise ProgramError("a malformed reply")

            def ask(self, msg):
                try:
                    if self.pid is None:  # its last run timed out or exited: a fresh one for this test
                        try:
                            kind, value = self.start()
                        except Fatal as exc:
                            # The program has run, and what it left behind (a process that freezes or
                            # starves the next one) can stop a restart: the program's doing, never the
                            # sandbox's (found in review: it turned any sample into an unscored one)
                            raise ProgramError(f"its process did not start again: {exc}") from None
                        if kind != "ready":
                            raise ProgramError(f"the program raised {value} when run again")
                    send(self.wfd, msg)
                    kind, value = self.answer()
                except Fatal:
                    raise
                except BaseException:  # the test's time ran out mid-call, or the process is gone: spent
                    self.stop()
                    raise
                if kind == "raised":
                    raise raised(value, f"raised by the program: {value}")
                if kind != "ok":
                    self.stop()
                    raise ProgramError("a malformed reply")
                return value

        def infra(exc):
            report(-1, False, {"infra": str(exc)})
            comp.stop()
            exit_(0)

        comp = Companion()
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            kind, names = comp.start()
        except Fatal as exc:
            infra(exc)
        except ProgramError:
            kind, names = "raised", "exited"
        except BaseException as exc:  # Timeout while the program ran
            kind, names = "raised", type(exc).__name__
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if kind != "ready":  # a program that raised or exited defines nothing more
            report(-1, False, names if type(names) is str else "a malformed reply")
            comp.stop()
            exit_(0)
        # What the setup and the tests see: the program's public names as handles to its process,
        # its plain values as copies, its modules as ours where we have loaded them already. Never
        # a name of ours (`__builtins__`, the checker): the program chose this list.
        base = {}
        for k, desc in names.items():
            if type(k) is not str or not k.isidentifier() or k.startswith("_") or type(desc) is not list:
                continue
            loaded = sys.modules.get(desc[1]) if len(desc) == 2 and desc[0] == "m" and type(desc[1]) is str else None
            if type(loaded) is type(os):
                base[k] = loaded
            elif len(desc) == 2 and desc[0] == "v":
                try:
                    base[k] = from_wire(desc[1], [1 << 22])
                except BaseException:
                    base[k] = Handle(("g", k), 0)
            else:
                base[k] = Handle(("g", k), 0)
        if entry:
            if entry not in base:
                report(-1, False, "no " + entry)
                comp.stop()
                exit_(0)
            base["candidate"] = base[entry]
        # The tests see the real builtins: a program's `def set(...)` or `def abs(...)` must not answer
        # for them (the function under test keeps its name)
        for k in [k for k in base if k in real_builtins and k != entry]:
            del base[k]
        # ...and the real standard modules they use, whatever the program bound to those names
        # (found in review: `math = M()` whose isclose agrees, or an attribute set on a function
        # named `math`, answered `math.isclose(area(2), 12.566)` for a test without an import)
        for k in modules:
            if k in base and k != entry:
                try:
                    module = sys.modules.get(k) or __import__(k)
                except BaseException:
                    del base[k]
                    continue
                # `import k` gives the module; `from k import k` (datetime, copy, random) our own k.k
                base[k] = module if names[k][0] == "m" else getattr(module, k, module)
        # What the task itself defines comes from here, never from the program (found in review): the
        # prompt's helpers (HumanEval/32's `poly`, /38's `encode_cyclic`, which the tests call to make
        # their inputs), and what the setup that runs beside the program binds (MBPP's
        # test_setup_code): plain values, functions, modules, imported callables and classes. Only
        # its own classes and the objects built of them stay the program's, to be handed to it.
        function = type(report)
        for src, label in ((prompt, "<prompt>"), (program_setup, "<setup>")):
            if not src:
                continue
            own = {"__name__": "__main__", "__builtins__": builtins}
            try:
                run(compile(src, label, "exec", dont_inherit=True), own, timeout)
            except BaseException as exc:
                report(-1, False, type(exc).__name__)
                comp.stop()
                exit_(0)
            for k, v in own.items():
                if k.startswith("_") or k == entry:
                    continue
                mine = isinstance(v, type) and v.__module__ == "__main__"  # a class the setup defines
                if type(v) in (type(os), function, type(len)) or plain(v, [0]) or (isinstance(v, type) and not mine):
                    base[k] = v
        base.update(__name__="__main__", __builtins__=builtins, __harness_checked__=checked)
        if setup is not None:
            try:
                run(setup, base, timeout)
            except Fatal as exc:
                infra(exc)
            except BaseException as exc:
                report(-1, False, type(exc).__name__)
                comp.stop()
                exit_(0)
        for i, test in enumerate(tests):
            if isinstance(test, BaseException):
                report(i, False, type(test).__name__)
                continue
            try:
                run(test, dict(base), timeout)
                report(i, True)
            except Fatal as exc:
                infra(exc)
            except BaseException as exc:
                report(i, False, type(exc).__name__)
        comp.stop()
    elif kind == "stdio":
        devnull_fd = dup(0)
        for i, text in enumerate(spec["inputs"]):
            # The input on fd 0 and on sys.stdin, what is printed taken from fd 1 and sys.stdout: a
            # script may read open(0) and write sys.__stdout__ as well as use input() and print()
            data = text.encode()
            fd_in, fd_out = memfd("stdin"), memfd("stdout")
            write(fd_in, data)
            lseek(fd_in, 0, 0)
            dup2(fd_in, 0)
            dup2(fd_out, 1)
            raw = io.BytesIO()
            out = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", write_through=True)
            sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
            sys.stdout, sys.stderr = out, io.StringIO()
            try:
                run(compiled, {"__name__": "__main__", "__builtins__": builtins}, timeout, threads_finish=True)
                ok = True
            except SystemExit as exc:
                ok = exc.code in (None, 0)
            except BaseException:
                ok = False
            for stream in (out, sys.__stdout__):
                try:
                    stream.flush()
                except BaseException:
                    pass
            dup2(devnull_fd, 0)
            dup2(report_fd, 1)
            size = lseek(fd_out, 0, 2)
            lseek(fd_out, 0, 0)
            direct = read(fd_out, size) if size else b""
            close(fd_in)
            close(fd_out)
            printed = (direct + raw.getvalue()).decode("utf-8", "replace")
            text = "\n".join(ln.rstrip() for ln in printed.strip().splitlines())
            report(i, ok, digest(text) if ok else None)
    else:
        ns = {"__name__": "__main__", "__builtins__": builtins}
        sys.stdout = sys.stderr = io.StringIO()
        try:
            run(compiled, ns, timeout)
            if spec["fn_name"] in ns:
                fn = ns[spec["fn_name"]]
            else:  # LeetCode-style: a method of class Solution
                fn = getattr(ns["Solution"](), spec["fn_name"])
        except BaseException as exc:
            report(-1, False, type(exc).__name__)
            exit_(0)
        fn = guard(fn)
        for i, args in enumerate(spec["inputs"]):
            ns2 = dict(ns, _fn=fn, _args=args, _out=None)
            try:
                run(compile("_out = _fn(*_args)", "<test>", "exec"), ns2, timeout)
                report(i, True, digest(value_json(ns2["_out"])))
            except BaseException as exc:
                report(i, False, type(exc).__name__)
    sys.stdout, sys.stderr = saved_stdout, saved_stderr
    exit_(0)
