"""Level 1 of the procedural code tasks: functions over lists, strings and numbers whose reference
solution is one line."""
from __future__ import annotations

import math
import random

from toolrl.tasks.code.templates import (FIRST_LETTERS, LAST_LETTERS, LISTS, NUMS, STRS, WORD_LISTS, Instance,
                                         VOCAB, ints, letters, nb, ordinal, plural, sentence, signed,
                                         words)


def sum_multiples(r: random.Random) -> Instance:
    k, xs = r.randint(2, 9), r.choice(LISTS)
    rem = r.randrange(k) if r.random() < 0.5 else 0
    which = f"that are divisible by {k}" if rem == 0 else \
        f"that leave the remainder {rem} when divided by {k} ({nb(f'x % {k} == {rem}')})"
    name = r.choice(["sum_multiples" if rem == 0 else "sum_remainder", "total_divisible"])
    return Instance({"k": k, "rem": rem}, name, f"{xs}: list[int]", "int",
                    f"Return the sum of the numbers in {xs} {which}.",
                    f"return sum(x for x in {xs} if x % {k} == {rem})",
                    lambda g: (ints(g, -30, 30),), [([],), ([k + rem],), ([1, -k],)])


def count_greater(r: random.Random) -> Instance:
    t, op, xs = r.randint(-5, 15), r.choice([">", ">="]), r.choice(LISTS)
    phrase = "greater than" if op == ">" else "greater than or equal to"
    return Instance({"t": t, "op": op}, r.choice(["count_greater", "count_above", "how_many_above"]),
                    f"{xs}: list[int]", "int",
                    f"Return how many numbers in {xs} are {phrase} {t}.",
                    f"return sum(1 for x in {xs} if x {op} {t})",
                    lambda g: (ints(g, t - 10, t + 10),), [([],), ([t],), ([t + 1, t - 1],)])


def affine_map(r: random.Random) -> Instance:
    a, b, xs = r.randint(2, 9), r.choice([i for i in range(-9, 10) if i]), r.choice(LISTS)
    expr = signed(a, b)
    return Instance({"a": a, "b": b}, r.choice(["transform", "scale_and_shift", "map_linear"]),
                    f"{xs}: list[int]", "list[int]",
                    f"Return a new list in which each number x of {xs} is replaced by {nb(expr)}.",
                    f"return [{expr} for x in {xs}]",
                    lambda g: (ints(g, -10, 10),), [([],), ([0],)])


def clamp(r: random.Random) -> Instance:
    lo, hi, x = r.randint(-10, 0), r.randint(1, 20), r.choice(NUMS)
    return Instance({"lo": lo, "hi": hi}, r.choice(["clamp", "limit", "bound"]), f"{x}: int", "int",
                    f"Return {x} limited to the range from {lo} to {hi}: {lo} if {x} is smaller than {lo}, "
                    f"{hi} if it is larger than {hi}, else {x} itself.",
                    f"return max({lo}, min({hi}, {x}))",
                    lambda g: (g.randint(lo - 15, hi + 15),), [(lo,), (hi,), (lo - 1,), (hi + 1,)])


def count_letters(r: random.Random) -> Instance:
    chars = "aeiou" if r.random() < 0.3 else "".join(sorted(r.sample("abcdeilmnoprstu", r.randint(2, 4))))
    s = r.choice(STRS)
    return Instance({"chars": chars}, r.choice(["count_letters", "count_chars", "letter_count"]), f"{s}: str",
                    "int", f"Return how many characters of {s} are one of the characters in {chars!r}.",
                    f"return sum(1 for c in {s} if c in {chars!r})",
                    lambda g: (sentence(g),), [("",), (chars,)])


def reverse_words(r: random.Random) -> Instance:
    sep, case, s = r.choice([" ", "-", "_", ", ", " | ", "/"]), r.choice(["", "upper", "title"]), r.choice(STRS)
    tail = {"": "", "upper": ", in upper case",
            "title": ", each word with its first letter in upper case and the rest in lower case"}[case]
    return Instance({"sep": sep, "case": case}, r.choice(["reverse_words", "words_backwards", "flip_words"]),
                    f"{s}: str", "str",
                    f"Return the words of {s} (separated by whitespace) in reverse order, joined with {sep!r}{tail}.",
                    f"return {sep!r}.join(reversed({s}.split())){'.' + case + '()' if case else ''}",
                    lambda g: (sentence(g, (0, 6)),), [("",), ("one",)])


def prefix_repeat(r: random.Random) -> Instance:
    n, m, s = r.randint(1, 6), r.randint(2, 5), r.choice(STRS)
    first = "first character" if n == 1 else f"first {n} characters"
    return Instance({"n": n, "m": m}, r.choice(["repeat_prefix", "prefix_times", "echo_start"]), f"{s}: str", "str",
                    f"Return the {first} of {s} repeated {m} times (all of {s}, repeated, if it is shorter).",
                    f"return {s}[:{n}] * {m}",
                    lambda g: (letters(g, n=(0, 9)),), [("",), ("a",)])


def count_digits(r: random.Random) -> Instance:
    op = r.choice([">", "<"])
    d, n = (r.randint(0, 8) if op == ">" else r.randint(1, 9)), r.choice(NUMS)
    return Instance({"d": d, "op": op}, r.choice(["count_digits", "digits_beyond", "digit_count"]),
                    f"{n}: int", "int",
                    f"Return how many digits of {n} (ignoring its sign) are "
                    f"{'greater' if op == '>' else 'less'} than {d}.",
                    f"return sum(1 for c in str(abs({n})) if int(c) {op} {d})",
                    lambda g: (g.randint(-10 ** g.randint(1, 7), 10 ** g.randint(1, 7)),), [(0,), (d,), (-9182736450,)])


def words_by_length(r: random.Random) -> Instance:
    k, op, ws = r.randint(2, 9), r.choice([">=", "<=", "=="]), r.choice(WORD_LISTS)
    how = {">=": "at least", "<=": "at most", "==": "exactly"}[op]
    return Instance({"k": k, "op": op}, r.choice(["words_of_length", "select_words", "filter_by_length"]),
                    f"{ws}: list[str]", "list[str]",
                    f"Return the words in {ws} that have {how} {k} letters, in their original order.",
                    f"return [w for w in {ws} if len(w) {op} {k}]",
                    lambda g: (words(g, (2, 10)),), [([],)])


def sum_extreme(r: random.Random) -> Instance:
    k, big, xs = r.randint(1, 8), r.random() < 0.5, r.choice(LISTS)
    which = "largest" if big else "smallest"
    what = f"the {which} number" if k == 1 else f"the {k} {which} numbers"
    return Instance({"k": k, "largest": big}, r.choice([f"sum_{which}", f"top_{k}_sum" if big else f"bottom_{k}_sum"]),
                    f"{xs}: list[int]", "int",
                    f"Return the sum of {what} in {xs} (of all of them if it has fewer than {k}; 0 if it is empty).",
                    f"return sum(sorted({xs}{', reverse=True' if big else ''})[:{k}])",
                    lambda g: (ints(g, -20, 20, (0, 9)),), [([],), ([5],)])


def divisible(r: random.Random) -> Instance:
    a, b = sorted(r.sample(range(2, 10), 2))
    mode, n = r.choice(["and", "or"]), r.choice(NUMS)
    how = f"both {a} and {b}" if mode == "and" else f"{a} or {b} (or both)"
    return Instance({"a": a, "b": b, "mode": mode}, r.choice(["is_divisible", "divides_evenly", "check_divisible"]),
                    f"{n}: int", "bool", f"Return True if {n} is divisible by {how}, else False.",
                    f"return {n} % {a} == 0 {mode} {n} % {b} == 0",
                    lambda g: ((a * b // math.gcd(a, b) if mode == "and" else g.choice([a, b])) * g.randint(-12, 12)
                               if g.random() < 0.5 else a * b * g.randint(-9, 9) + g.choice([1, -1]) if g.random() < 0.5
                               else g.randint(-100, 100),), [(0,), (a,), (b,), (a * b + 1,)])


def replace_char(r: random.Random) -> Instance:
    a = r.choice("aeilnorst")
    b, s = r.choice([c for c in "abcdefghijklmnopqrstuvwxyz*-" if c != a] + [""]), r.choice(STRS)
    what = f"replaced by {b!r}" if b else "removed"
    return Instance({"a": a, "b": b}, r.choice(["replace_char", "swap_letter", "substitute"]), f"{s}: str", "str",
                    f"Return {s} with every {a!r} {what}.", f"return {s}.replace({a!r}, {b!r})",
                    lambda g: (sentence(g),), [("",), (a * 3,)])


def every_nth(r: random.Random) -> Instance:
    start, step, xs = r.randint(0, 3), r.randint(2, 5), r.choice(LISTS)
    return Instance({"start": start, "step": step}, r.choice(["every_nth", "take_every", "stride"]),
                    f"{xs}: list[int]", "list[int]",
                    f"Return every {ordinal(step)} element of {xs}, starting with the one at index {start}: the "
                    f"elements at indexes {start}, {start + step}, {start + 2 * step} and so on.",
                    f"return {xs}[{start}::{step}]",
                    lambda g: (ints(g, -9, 9, (0, 14)),), [([],), ([1],)])


def count_start_end(r: random.Random) -> Instance:
    end = r.random() < 0.5
    c, s = r.choice(LAST_LETTERS if end else FIRST_LETTERS), r.choice(STRS)
    verb = "endswith" if end else "startswith"
    hits = [w for w in VOCAB if getattr(w, verb)(c)]
    return Instance({"c": c, "end": end}, r.choice([f"count_{'ending' if end else 'starting'}", "count_words_with"]),
                    f"{s}: str", "int",
                    f"Return how many words in {s} (separated by whitespace) {'end' if end else 'start'} "
                    f"with the letter {c!r}.",
                    f"return sum(1 for w in {s}.split() if w.{verb}({c!r}))",
                    lambda g: (" ".join(g.choice(hits if g.random() < 0.4 else VOCAB)
                                        for _ in range(g.randint(0, 9))),),
                    [("",)])


def sum_first_last(r: random.Random) -> Instance:
    n, last, xs = r.randint(1, 8), r.random() < 0.5, r.choice(LISTS)
    which = "last" if last else "first"
    return Instance({"n": n, "last": last}, r.choice([f"sum_{which}", f"{which}_total"]), f"{xs}: list[int]", "int",
                    f"Return the sum of the {which} {plural(n, 'number')} in {xs} (of all of them if it has fewer; "
                    "0 if it is empty).",
                    f"return sum({xs}[-{n}:])" if last else f"return sum({xs}[:{n}])",
                    lambda g: (ints(g, -20, 20, (0, 12)),), [([],), ([7],)])


def pad(r: random.Random) -> Instance:
    width, ch, left, s = r.randint(4, 10), r.choice("*.#0-"), r.random() < 0.5, r.choice(STRS)
    return Instance({"width": width, "ch": ch, "left": left}, r.choice(["pad", f"pad_{'left' if left else 'right'}"]),
                    f"{s}: str", "str",
                    f"Return {s} padded on the {'left' if left else 'right'} with {ch!r} up to a length of {width} "
                    f"({s} unchanged if it is already at least that long).",
                    f"return {s}.{'rjust' if left else 'ljust'}({width}, {ch!r})",
                    lambda g: (letters(g, n=(0, width + 2)),), [("",), ("x" * width,)])


TEMPLATES = [sum_multiples, count_greater, affine_map, clamp, count_letters, reverse_words, prefix_repeat,
             count_digits, words_by_length, sum_extreme, divisible, replace_char, every_nth, count_start_end,
             sum_first_last, pad]
