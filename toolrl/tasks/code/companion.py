"""The program's own process for `assert` tasks: the harness (toolrl.tasks.code.harness) keeps the
tests and the nonce, and the program runs here, in a fresh interpreter the harness starts with
`python -I -S -c`, and answers the harness's calls (requests on fd 3, answers on fd 4).

Why a fresh interpreter and not a fork: everything the executor handed the runner (the job, its
stdin with the nonce and the tests) went through the runner's memory, where a program that walks
frames or `gc.get_objects()` finds it (found in review: `sys._getframe()` up to the harness's frame
gave the nonce and the report fd, and every test passed). A fork would copy that memory; exec starts
from none of it. The companion holds no descriptor of the executor's output (fds 0-2 are /dev/null),
so it cannot write a report even with a nonce, and it drops any capabilities it has, so it cannot
read the harness's memory (the harness makes itself non-dumpable).

Both functions go to the executor as source (judge.COMPANION, judge.HARNESS): self-contained,
nothing from toolrl.
"""


def _toolrl_codec(ref, deref, parse):
    """Plain data over the harness's two pipes, both ways: tagged lists of strings and numbers, written
    with repr and read with `parse` (the harness: ast.literal_eval, which builds literals only: never
    pickle or eval on what the program sent; the companion: eval of the harness's trusted requests),
    or as JSON when large. Decoded values are plain Python types only. `ref(v)` encodes what is not
    plain data (the companion: a handle to its object; the harness: its handle's reference);
    `deref(x)` decodes a reference. Nothing is imported before it is met: the companion starts in
    ~20 ms on a slow host, and importing json there would double that. Returns (encode, decode,
    send, recv)."""
    import os
    import sys

    seq_tags = {list: "l", tuple: "t", set: "S", frozenset: "F"}
    seq_types = {"l": list, "t": tuple, "S": set, "F": frozenset}
    named = {("collections", "Counter"): "C", ("collections", "OrderedDict"): "O",
             ("collections", "defaultdict"): "D", ("collections", "deque"): "q",
             ("fractions", "Fraction"): "Q", ("decimal", "Decimal"): "M"}
    by_tag = {tag: key for key, tag in named.items()}
    factories = {"int": int, "float": float, "str": str, "list": list, "dict": dict, "set": set,
                 "tuple": tuple, "frozenset": frozenset, "bool": bool}

    def cls(tag):  # imported only when a value of it is met: a value of it means it is loaded already
        mod, name = by_tag[tag]
        return getattr(sys.modules.get(mod) or __import__(mod), name)

    def pairs(v, budget):
        return [[encode(k, budget), encode(x, budget)] for k, x in v.items()]

    def encode(v, budget):
        budget[0] -= 1
        if budget[0] < 0:
            raise OverflowError("a value too large to pass")
        t = type(v)
        if v is None:
            return ["N"]
        if t is bool:
            return ["B", int(v)]
        if t is int:
            return ["i", format(v, "x")]  # hex: exact, and no limit on the digits
        if t is float:
            return ["f", v.hex()]
        if t is complex:
            return ["c", v.real.hex(), v.imag.hex()]
        if t is str:
            return ["s", v]
        if t is bytes:
            return ["b", v.hex()]
        if t in seq_tags:
            return [seq_tags[t], [encode(x, budget) for x in v]]
        if t is dict:
            return ["d", pairs(v, budget)]
        if t is range:
            return ["r", encode(v.start, budget), encode(v.stop, budget), encode(v.step, budget)]
        tag = named.get((getattr(t, "__module__", None), getattr(t, "__name__", None)))
        if tag is None or t is not cls(tag):
            return ref(v)
        if tag in ("C", "O"):
            return [tag, pairs(v, budget)]
        if tag == "D":
            return ["D", next((n for n, f in factories.items() if v.default_factory is f), None), pairs(v, budget)]
        if tag == "q":
            return ["q", v.maxlen, [encode(x, budget) for x in v]]
        if tag == "Q":
            return ["Q", format(v.numerator, "x"), format(v.denominator, "x")]
        return ["M", str(v)]

    def bad():
        raise TypeError("malformed value")

    def text(x):
        return x if type(x) is str else bad()

    def decode_pairs(x, budget):
        if type(x) is not list or any(type(p) is not list or len(p) != 2 for p in x):
            bad()
        return [(decode(k, budget), decode(y, budget)) for k, y in x]

    def decode(x, budget):
        budget[0] -= 1
        if budget[0] < 0 or type(x) is not list or not x or type(x[0]) is not str:
            bad()
        tag = x[0]
        if tag == "N":
            return None
        if tag == "B":
            return x[1] == 1 if type(x[1]) is int and x[1] in (0, 1) else bad()
        if tag == "i":
            return int(text(x[1]), 16)
        if tag == "f":
            return float.fromhex(text(x[1]))
        if tag == "c":
            return complex(float.fromhex(text(x[1])), float.fromhex(text(x[2])))
        if tag == "s":
            return text(x[1])
        if tag == "b":
            return bytes.fromhex(text(x[1]))
        if tag in seq_types:
            return seq_types[tag](decode(y, budget) for y in x[1]) if type(x[1]) is list else bad()
        if tag == "d":
            return dict(decode_pairs(x[1], budget))
        if tag == "r":
            a, b, c = (decode(y, budget) for y in x[1:4])
            return range(a, b, c) if type(a) is int and type(b) is int and type(c) is int else bad()
        if tag in ("C", "O"):
            return cls(tag)(dict(decode_pairs(x[1], budget)) if tag == "C" else decode_pairs(x[1], budget))
        if tag == "D":
            return cls(tag)(factories.get(x[1]) if type(x[1]) is str else None, decode_pairs(x[2], budget))
        if tag == "q":
            if x[1] is not None and (type(x[1]) is not int or x[1] < 0):
                bad()
            return cls(tag)((decode(y, budget) for y in x[2]), x[1]) if type(x[2]) is list else bad()
        if tag == "Q":
            return cls(tag)(int(text(x[1]), 16), int(text(x[2]), 16))
        if tag == "M":
            return cls(tag)(text(x[1]))
        return deref(x)

    def send(fd, obj):
        """repr for what is small; json (fast for large values, loaded on first use) for the rest."""
        body = repr(obj)
        if len(body) > 1 << 18:
            import json

            body = b"j" + json.dumps(obj, separators=(",", ":")).encode()
        else:
            body = b"r" + body.encode("utf-8", "surrogatepass")
        view = memoryview(len(body).to_bytes(4, "big") + body)
        while view:
            view = view[os.write(fd, view):]

    def read_exact(fd, n):
        parts, left = [], n
        while left:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                return None
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def recv(fd, limit=64 << 20):
        """One message; None at the end of the stream."""
        head = read_exact(fd, 4)
        if head is None:
            return None
        n = int.from_bytes(head, "big")
        if n > limit:
            raise ValueError(f"a message of {n} bytes is over the limit of {limit}")
        body = read_exact(fd, n)
        if body is None:
            return None
        if body[:1] == b"j":
            import json

            return json.loads(body[1:])
        if body[:1] != b"r":
            raise ValueError("a malformed message")
        return parse(body[1:].decode("utf-8", "surrogatepass"))

    return encode, decode, send, recv


def _toolrl_companion(rfd, wfd):
    """Runs the program it is sent, then answers the harness: call, attribute, item, len, list,
    str, contains, each on a function or object of the program's. Results go back as plain data,
    anything else as a handle the harness can only pass back here."""
    import builtins
    import os
    import sys

    handles = {}

    def ref(v):
        handles[len(handles) + 1] = v
        return ["h", len(handles)]

    def deref(x):
        if x[0] == "h" and type(x[1]) is int and x[1] in handles:
            return handles[x[1]]
        if x[0] == "g" and type(x[1]) is str:
            return ns[x[1]]
        raise TypeError("malformed value")

    def plain_only(v):
        raise TypeError("not plain data")

    def trusted(text):  # the harness's requests: plain literals, read without importing ast
        return eval(text, {"__builtins__": {}})

    encode, decode, send, recv = _toolrl_codec(ref, deref, trusted)
    plain_encode = _toolrl_codec(plain_only, deref, trusted)[0]

    # Root in a user namespace (the executor without a per-slot uid) holds CAP_SYS_PTRACE there,
    # which would read the harness's memory whatever its dumpable flag: drop every capability, and
    # the bounding set, so that executing a program again regains none.
    def capable():
        return any(int(ln.split()[1], 16) for ln in open("/proc/self/status").read().splitlines()
                   if ln.startswith(("CapEff:", "CapPrm:")))

    if capable():
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
        header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # _LINUX_CAPABILITY_VERSION_3
        if libc.capset(header, data) != 0 or capable():
            send(wfd, ["fatal", "could not drop its capabilities"])
            os._exit(3)
    send(wfd, ["boot"])
    hello = recv(rfd)
    sys.path[:] = hello["path"]

    def leave(code=None):  # exit() and quit() as site would give them (-S skips site)
        raise SystemExit(code)

    builtins.exit = builtins.quit = leave
    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(hello["program"], "<program>", "exec", dont_inherit=True), ns)
        if hello["setup"]:  # what the tests hand the program (MBPP's test_setup_code) is built here, its own
            exec(compile(hello["setup"], "<setup>", "exec", dont_inherit=True), ns)
    except BaseException as exc:  # SystemExit included: a program that exits defines nothing more
        send(wfd, ["e", type(exc).__name__])
        os._exit(0)
    names, budget = {}, [100_000]
    for k, v in list(ns.items()):
        if k.startswith("__"):
            continue
        if type(v) is type(os):
            names[k] = ["m", v.__name__]
            continue
        try:
            names[k] = ["v", plain_encode(v, budget)]
        except Exception:
            names[k] = ["g"]
    send(wfd, ["ready", names])
    while True:
        msg = recv(rfd)
        if msg is None:
            os._exit(0)
        try:
            op, target = msg[0], deref(msg[1])
            if op == "call":
                out = target(*decode(msg[2], [1 << 22]), **decode(msg[3], [1 << 22]))
            elif op == "attr":
                out = getattr(target, msg[2])
            elif op == "item":
                out = target[decode(msg[2], [1 << 22])]
            elif op == "contains":
                out = decode(msg[2], [1 << 22]) in target
            elif op == "len":
                out = len(target)
            elif op == "list":
                out = list(target)
            elif op == "str":
                out = str(target)
            else:
                raise TypeError(f"unknown request {op!r}")
            reply = ["ok", encode(out, [1 << 22])]
        except BaseException as exc:
            reply = ["e", type(exc).__name__]
        send(wfd, reply)
