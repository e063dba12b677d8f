"""The test harness: runs inside the executor with a code task's program and tests, and reports
each test on a line that starts with the run's nonce (toolrl.tasks.code.judge explains why a
program cannot fake a report, and reads the lines back).

The source of `_toolrl_harness` alone is what goes to the executor (judge.build_harness appends the
call), so it is self-contained: everything it uses is imported or defined inside it, nothing comes
from toolrl, and what it captures first (os.write, os._exit, ...) the program cannot rebind.
"""


def _toolrl_harness(program, spec):
    import builtins
    import hashlib
    import io
    import json
    import os
    import signal
    import sys
    write, exit_, read, settrace, setprofile = os.write, os._exit, os.read, sys.settrace, sys.setprofile
    nonce = read(0, 256).decode().strip()
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again: input() sees EOF, never the nonce
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

    def digest(text):  # long outputs travel as a hash, so the executor's output cap cuts nothing
        return text if len(text) <= 200 else {"sha256": hashlib.sha256(text.encode()).hexdigest()}

    def report(i, ok, payload=None):
        line = json.dumps([i, ok, payload])
        write(1, ("\n" + nonce + " " + line + "\n").encode())

    def run(code, ns, timeout):
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            exec(code, ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            restore()

    timeout = spec["per_test_timeout_s"]
    try:
        compiled = compile(program, "<program>", "exec", dont_inherit=True, optimize=0)
    except BaseException:
        report(-1, False, "syntax")
        exit_(0)
    if spec["kind"] == "assert":
        ns = {"__name__": "__main__", "__builtins__": builtins}
        sys.stdout = sys.stderr = io.StringIO()
        try:
            run(compiled, ns, timeout)
            if spec.get("setup"):
                run(compile(spec["setup"], "<setup>", "exec", dont_inherit=True, optimize=0), ns, timeout)
        except BaseException as exc:  # SystemExit included: a program that exits defines nothing more
            report(-1, False, type(exc).__name__)
            exit_(0)
        for k, v in list(ns.items()):
            if callable(v) and getattr(getattr(v, "__code__", None), "co_filename", None) == "<program>":
                ns[k] = guard(v)
        if spec.get("entry_point"):
            if spec["entry_point"] not in ns:
                report(-1, False, "no " + spec["entry_point"])
                exit_(0)
            ns["candidate"] = ns[spec["entry_point"]]
        for i, test in enumerate(spec["tests"]):
            try:
                run(compile(test, "<test>", "exec", dont_inherit=True, optimize=0), dict(ns), timeout)
                report(i, True)
            except BaseException as exc:
                report(i, False, type(exc).__name__)
    elif spec["kind"] == "stdio":
        for i, text in enumerate(spec["inputs"]):
            # real text streams over bytes, so sys.stdin.buffer / sys.stdout.buffer work as in a script
            raw = io.BytesIO()
            out = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", write_through=True)
            sys.stdin = io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8")
            sys.stdout, sys.stderr = out, io.StringIO()
            try:
                run(compiled, {"__name__": "__main__", "__builtins__": builtins}, timeout)
                ok = True
            except SystemExit as exc:
                ok = exc.code in (None, 0)
            except BaseException:
                ok = False
            try:
                out.flush()
            except BaseException:
                pass
            printed = raw.getvalue().decode("utf-8", "replace")
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
