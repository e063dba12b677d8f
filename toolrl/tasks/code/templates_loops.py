"""Level 2 of the procedural code tasks: loops, conditions and dictionaries."""
from __future__ import annotations

import random

from toolrl.tasks.code.templates import (LISTS, NUMS, PEOPLE, STRS, WORD_LISTS, Instance, ints, nb, ordinal, text,
                                         words)


def char_counts(r: random.Random) -> Instance:
    ignore, fold, m, s = r.choice(["", " ", " .,!", "aeiou "]), r.random() < 0.5, r.randint(1, 3), r.choice(STRS)
    doc = f"Return a dictionary that maps each character of {s} to the number of times it occurs"
    doc += ", counting upper and lower case as the same letter (use the lower case letter as the key)" if fold else ""
    doc += f". Leave out the characters in {ignore!r}" if ignore else ""
    doc += f". Keep only the characters that occur at least {m} times" if m > 1 else ""
    body = f"counts = {{}}\nfor c in {s}{'.lower()' if fold else ''}:\n"
    body += f"    if c in {ignore!r}:\n        continue\n" if ignore else ""
    body += "    counts[c] = counts.get(c, 0) + 1\n"
    body += f"return {{c: k for c, k in counts.items() if k >= {m}}}" if m > 1 else "return counts"
    name = r.choice(["char_counts", "count_characters", "histogram"])
    return Instance({"ignore": ignore, "fold": fold, "m": m}, name, f"{s}: str", "dict[str, int]", doc + ".", body,
                    lambda g: (text(g),), [("",)])


def window(r: random.Random) -> Instance:
    w, agg, xs = r.randint(2, 6), r.choice(["max", "min", "sum"]), r.choice(LISTS)
    what = {"max": "the largest", "min": "the smallest", "sum": "the sum"}[agg]
    return Instance({"w": w, "agg": agg}, r.choice([f"window_{agg}", f"rolling_{agg}", f"running_{agg}"]),
                    f"{xs}: list[int]", "list[int]",
                    f"Return a list with one number for each position i of {xs}: {what} of the numbers from "
                    f"position {nb(f'i - {w - 1}')} to position i (fewer at the start of the list).",
                    f"result = []\nfor i in range(len({xs})):\n    part = {xs}[max(0, i - {w - 1}):i + 1]\n"
                    f"    result.append({agg}(part))\nreturn result",
                    lambda g: (ints(g, -20, 20, (0, 10)),), [([],), ([3],)])


def fizzbuzz(r: random.Random) -> Instance:
    a, b = r.sample(range(2, 8), 2)
    w1, w2 = r.choice([("Fizz", "Buzz"), ("Foo", "Bar"), ("Ping", "Pong"), ("Tic", "Tac"), ("Zig", "Zag")])
    n = r.choice(NUMS)
    return Instance({"a": a, "b": b, "w1": w1, "w2": w2}, r.choice(["fizzbuzz", "number_words", "say_numbers"]),
                    f"{n}: int", "list[str]",
                    f"Return a list of strings for the numbers 1 to {n}: '{w1}{w2}' for multiples of both {a} and "
                    f"{b}, '{w1}' for the other multiples of {a}, '{w2}' for the other multiples of {b}, and the "
                    "number itself (as a string) for the rest.",
                    f"result = []\nfor i in range(1, {n} + 1):\n    if i % {a} == 0 and i % {b} == 0:\n"
                    f"        result.append('{w1}{w2}')\n    elif i % {a} == 0:\n        result.append('{w1}')\n"
                    f"    elif i % {b} == 0:\n        result.append('{w2}')\n    else:\n"
                    "        result.append(str(i))\nreturn result",
                    lambda g: (g.randint(0, 25),), [(0,), (1,), (a * b,)])


def letter_counts(r: random.Random) -> Instance:
    k, last, fold, ws = r.randint(1, 4), r.random() < 0.5, r.random() < 0.5, r.choice(WORD_LISTS)
    which = "end" if last else "start"
    doc = f"Return a dictionary that maps each letter to the number of words in {ws}"
    doc += f" with at least {k} letters" if k > 1 else ""
    doc += f" that {which} with it"
    doc += ", counting upper and lower case as the same letter (lower case keys)" if fold else ""
    body = f"counts = {{}}\nfor w in {ws}:\n    if len(w) >= {k}:\n"
    body += f"        c = w[{-1 if last else 0}]{'.lower()' if fold else ''}\n"
    body += "        counts[c] = counts.get(c, 0) + 1\nreturn counts"
    return Instance({"k": k, "last": last, "fold": fold}, r.choice([f"count_by_{'last' if last else 'first'}_letter",
                                                                   "letter_index"]),
                    f"{ws}: list[str]", "dict[str, int]", doc + ".", body,
                    lambda g: (words(g, (0, 8), caps=True),), [([],)])


def divide_out(r: random.Random) -> Instance:
    d, rest, n = r.randint(2, 10), r.random() < 0.5, r.choice(NUMS)
    if rest:
        doc = f"Divide the positive integer {n} by {d} again and again as long as it divides evenly, and " \
              "return what is left."
        name = r.choice([f"strip_factor_{d}", "remove_factor"])
    else:
        doc = f"Return how many times the positive integer {n} can be divided by {d}, one division after the other, " \
              "as long as it divides evenly."
        name = r.choice([f"times_divisible_by_{d}", "count_divisions"])
    return Instance({"d": d, "rest": rest}, name, f"{n}: int", "int", doc,
                    f"while {n} % {d} == 0:\n    {n} //= {d}\nreturn {n}" if rest else
                    f"count = 0\nwhile {n} % {d} == 0:\n    {n} //= {d}\n    count += 1\nreturn count",
                    lambda g: (d ** g.randint(0, 5) * g.choice([1, 2, 3, 5, 7, 11, 13]),), [(1,), (d,), (d ** 3,)])


def buckets(r: random.Random) -> Instance:
    w, xs = r.randint(2, 25), r.choice(LISTS)
    return Instance({"w": w}, r.choice(["bucket_counts", "histogram", "count_ranges"]), f"{xs}: list[int]",
                    "dict[int, int]",
                    f"Count the numbers of {xs} in buckets of width {w}: a number x belongs to the bucket "
                    f"{nb(f'x // {w} * {w}')} (the lowest number of its bucket). Return a dictionary that maps "
                    "each bucket that has numbers to how many it has.",
                    f"counts = {{}}\nfor x in {xs}:\n    b = x // {w} * {w}\n    counts[b] = counts.get(b, 0) + 1\n"
                    "return counts",
                    lambda g: (ints(g, -50, 50, (0, 10)),), [([],), ([0, w - 1, w],)])


def longest_streak(r: random.Random) -> Instance:
    t, op, xs = r.randint(-3, 10), r.choice([">", "<"]), r.choice(LISTS)
    return Instance({"t": t, "op": op}, r.choice(["longest_streak", "longest_run", "max_run"]), f"{xs}: list[int]",
                    "int",
                    f"Return the length of the longest run of consecutive numbers in {xs} that are all "
                    f"{'greater' if op == '>' else 'less'} than {t} (0 if there is none).",
                    f"best = run = 0\nfor x in {xs}:\n    if x {op} {t}:\n        run += 1\n"
                    "        best = max(best, run)\n    else:\n        run = 0\nreturn best",
                    lambda g: (ints(g, t - 6, t + 6, (0, 12)),), [([],), ([t],)])


def caesar(r: random.Random) -> Instance:
    k, s = r.randint(1, 25), r.choice(STRS)
    return Instance({"k": k}, r.choice(["caesar", "shift_letters", "rotate"]), f"{s}: str", "str",
                    f"Shift every lower case letter of {s} {k} places forward in the alphabet, wrapping around from "
                    "'z' to 'a', and leave every other character unchanged. Return the result.",
                    f"result = ''\nfor c in {s}:\n    if 'a' <= c <= 'z':\n"
                    f"        result += chr((ord(c) - ord('a') + {k}) % 26 + ord('a'))\n    else:\n"
                    "        result += c\nreturn result",
                    lambda g: (text(g),), [("",), ("xyz",)])


def count_pairs(r: random.Random) -> Instance:
    diff, xs = r.random() < 0.5, r.choice(LISTS)
    t = r.randint(0, 10) if diff else r.randint(0, 20)
    cond = f"abs({xs}[i] - {xs}[j]) == {t}" if diff else f"{xs}[i] + {xs}[j] == {t}"
    name = r.choice(["count_pairs", "pairs_with_" + ("difference" if diff else "sum")])
    return Instance({"t": t, "diff": diff}, name, f"{xs}: list[int]", "int",
                    f"Return the number of pairs of positions {nb('i < j')} in {xs} with {nb(cond)}.",
                    f"count = 0\nfor i in range(len({xs})):\n    for j in range(i + 1, len({xs})):\n"
                    f"        if {cond}:\n            count += 1\nreturn count",
                    lambda g: (ints(g, 0, t + 3, (2, 10)) if diff else ints(g, t // 2 - 4, t // 2 + 4, (2, 10)),),
                    [([],), ([t],)])


def grades(r: random.Random) -> Instance:
    a = r.randint(80, 95)
    b = a - r.randint(5, 15)
    c = b - r.randint(5, 15)
    xs = r.choice(["scores", "marks", "points"])
    return Instance({"a": a, "b": b, "c": c}, r.choice(["grades", "letter_grades", "grade_all"]), f"{xs}: list[int]",
                    "list[str]",
                    f"Return a list with a letter grade for each score in {xs}: 'A' for {a} or more, 'B' for {b} or "
                    f"more, 'C' for {c} or more, and 'F' otherwise.",
                    f"result = []\nfor x in {xs}:\n    if x >= {a}:\n        result.append('A')\n"
                    f"    elif x >= {b}:\n        result.append('B')\n    elif x >= {c}:\n        result.append('C')\n"
                    "    else:\n        result.append('F')\nreturn result",
                    lambda g: ([g.choice([a, b, c, g.randint(c - 15, 100)]) for _ in range(g.randint(1, 8))],),
                    [([],), ([a, b - 1, c, c - 1],)])


def adjust_values(r: random.Random) -> Instance:
    k, c, d = r.randint(2, 5), r.randint(1, 9), r.choice(["d", "table", "stock", "counts"])
    return Instance({"k": k, "c": c}, r.choice(["adjust_values", "update_counts", "rescale"]), f"{d}: dict[str, int]",
                    "dict[str, int]",
                    f"Return a new dictionary with the keys of {d}: even values multiplied by {k}, odd values "
                    f"increased by {c}.",
                    f"result = {{}}\nfor key, value in {d}.items():\n    if value % 2 == 0:\n"
                    f"        result[key] = value * {k}\n    else:\n        result[key] = value + {c}\nreturn result",
                    lambda g: ({p: g.randint(-20, 20) for p in words(g, (0, 6), pool=PEOPLE)},), [({},)])


def alternate_case(r: random.Random) -> Instance:
    p = r.randint(2, 5)
    off, eq, s = r.randrange(p), r.random() < 0.5, r.choice(STRS)
    op = "==" if eq else "!="
    return Instance({"p": p, "off": off, "eq": eq}, r.choice(["alternate_case", "mixed_case", "stripe_case"]),
                    f"{s}: str", "str",
                    f"Return {s} with the characters at the positions i (counting from 0) where "
                    f"{nb(f'i % {p} {op} {off}')} in upper case and all the others in lower case.",
                    f"result = ''\nfor i, c in enumerate({s}):\n    if i % {p} {op} {off}:\n"
                    "        result += c.upper()\n    else:\n        result += c.lower()\nreturn result",
                    lambda g: (text(g),), [("",)])


def run_length(r: random.Random) -> Instance:
    count_first, show_one, joiner = r.random() < 0.5, r.random() < 0.5, r.choice(["", ",", " "])
    s = r.choice(STRS)
    doc = f"Compress {s} by runs of equal consecutive characters: write each run as " + (
        "its length followed by the character" if count_first else "the character followed by its length")
    doc += "" if show_one else " (a run of one character is written as the character alone)"
    doc += f", and join the runs with {joiner!r}" if joiner else ""
    part = "str(n) + s[i]" if count_first else "s[i] + str(n)"
    part = part if show_one else f"{part} if n > 1 else s[i]"
    body = (f"parts = []\ni = 0\nwhile i < len({s}):\n    j = i\n    while j < len({s}) and {s}[j] == {s}[i]:\n"
            f"        j += 1\n    n = j - i\n    parts.append({part.replace('s[i]', f'{s}[i]')})\n    i = j\n"
            f"return {joiner!r}.join(parts)")
    return Instance({"count_first": count_first, "show_one": show_one, "joiner": joiner},
                    r.choice(["run_length", "compress", "encode_runs"]), f"{s}: str", "str", doc + ".", body,
                    lambda g: ("".join(g.choice("abc") * g.randint(1, 4) for _ in range(g.randint(1, 5))),),
                    [("",), ("x",)])


def sum_until(r: random.Random) -> Instance:
    t, xs = r.randint(5, 40), r.choice(LISTS)
    return Instance({"t": t}, r.choice(["sum_until", "add_until_big", "total_before"]), f"{xs}: list[int]", "int",
                    f"Add up the numbers of {xs} from the start, stopping at the first number greater than {t} "
                    "(which is not added). Return the total.",
                    f"total = 0\nfor x in {xs}:\n    if x > {t}:\n        break\n    total += x\nreturn total",
                    lambda g: ([g.randint(-5, t) if g.random() < 0.85 else g.randint(t + 1, t + 9)
                                for _ in range(g.randint(0, 9))],), [([],), ([t + 1, 1],)])


def kth_distinct(r: random.Random) -> Instance:
    k, big, d, xs = r.randint(1, 5), r.random() < 0.5, r.choice([-1, 0]), r.choice(LISTS)
    which = "largest" if big else "smallest"
    return Instance({"k": k, "largest": big, "d": d}, r.choice([f"{ordinal(k)}_{which}", f"kth_{which}"]),
                    f"{xs}: list[int]", "int",
                    f"Return the {ordinal(k) + ' ' if k > 1 else ''}{which} distinct value in {xs} (a value that "
                    f"repeats counts once), or {d} if {xs} "
                    f"{f'has fewer than {k} distinct values' if k > 1 else 'is empty'}.",
                    f"distinct = sorted(set({xs}){', reverse=True' if big else ''})\nif len(distinct) < {k}:\n"
                    f"    return {d}\nreturn distinct[{k - 1}]",
                    lambda g: (ints(g, -9, 9, (0, 10)),), [([],), ([4, 4],), ([2, 1, 2, 3],)])


TEMPLATES = [char_counts, window, fizzbuzz, letter_counts, divide_out, buckets, longest_streak, caesar, count_pairs,
             grades, adjust_values, alternate_case, run_length, sum_until, kth_distinct]
