"""The test harness: runs inside the executor with a code task's program and tests, and reports
each test on a line that starts with the run's nonce (toolrl.tasks.code.judge explains why a
program cannot fake a report, and reads the lines back).

The source of `_toolrl_digest` and `_toolrl_harness` is what goes to the executor (judge.build_harness
appends the call), so they are self-contained: everything they use is imported or defined inside
them, nothing comes from toolrl, and what the harness captures first (os.write, os._exit, the digest,
...) the program cannot rebind.
"""


def _toolrl_digest(text):
    """An output as reported: itself up to 200 characters, else the SHA-256 of its canonical form
    (tokens, numbers to 6 decimals), so the executor's output cap cuts nothing and a long output meets
    the tolerance the judge gives a short one token by token (found in review: a double space or
    float noise failed past 200 characters only). Sent with the harness and used by the judge."""
    import hashlib

    if len(text) <= 200:
        return text
    out = []
    for tok in text.split():
        try:
            f = float(tok)
        except ValueError:
            f = None
        out.append(format(round(f, 6) + 0.0, ".6f") if f is not None and abs(f) < float("inf") else tok)
    return {"sha256": hashlib.sha256(" ".join(out).encode()).hexdigest()}


def _toolrl_harness(program, spec):
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
    digest = _toolrl_digest  # sent beside this function
    sleep = time.sleep
    listdir, dup, dup2, lseek, memfd, close = os.listdir, os.dup, os.dup2, os.lseek, os.memfd_create, os.close
    nonce = read(0, 256).decode().strip()
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
        tests = []  # compiled before the program runs, which cannot touch `ast` or `compile` by then
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
        # The tests now exist only as code. As text they were readable by the program: this whole
        # script sits in linecache (the executor keeps it for tracebacks), so a program could parse
        # the asserts and answer each by lookup (found in review: 143 of 164 HumanEval tasks).
        spec.clear()
        linecache.clearcache()
        ns = {"__name__": "__main__", "__builtins__": builtins}
        sys.stdout = sys.stderr = io.StringIO()
        try:
            run(compiled, ns, timeout)
        except BaseException as exc:  # SystemExit included: a program that exits defines nothing more
            report(-1, False, type(exc).__name__)
            exit_(0)
        # What the setup and the tests see: a copy of the program's namespace. The program's own
        # functions keep `ns` as their globals, so what they rebind there (the checker, the function
        # under test) never reaches the tests (found in review: a first call that unhooked the
        # checker passed every later test).
        base = dict(ns, __harness_checked__=checked)
        if setup is not None:
            try:
                run(setup, base, timeout)
            except BaseException as exc:
                report(-1, False, type(exc).__name__)
                exit_(0)
        # Everything callable that the program made is called through `guard` (its result must be
        # plain data): functions, and callable instances and partials, which agreed with anything
        # through arithmetic (`abs(candidate(x) - y) < 1e-6`). Classes (tests build instances of a
        # program's class) and what the setup defined are left as they are.
        for k, v in ns.items():
            if base.get(k) is v and callable(v) and not isinstance(v, type) and not k.startswith("__"):
                base[k] = guard(v)
        if entry:
            if entry not in base:
                report(-1, False, "no " + entry)
                exit_(0)
            base["candidate"] = base[entry]
        # The tests see the real builtins and modules: a program's `def set(...)`, `def abs(...)` or
        # `math = ...` must not answer for them (the function under test keeps its name)
        for k in [k for k in base if k in real_builtins and k != entry and not k.startswith("__")]:
            del base[k]
        for n, m, _ in snap:
            if n in base and base[n] is not m:
                base[n] = m
        for i, test in enumerate(tests):
            if isinstance(test, BaseException):
                report(i, False, type(test).__name__)
                continue
            try:
                run(test, dict(base), timeout)
                report(i, True)
            except BaseException as exc:
                report(i, False, type(exc).__name__)
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
                report(i, True, digest(json.dumps(json.loads(json.dumps(ns2["_out"], default=list)), sort_keys=True)))
            except BaseException as exc:
                report(i, False, type(exc).__name__)
    sys.stdout, sys.stderr = saved_stdout, saved_stderr
    exit_(0)
