"""Level 3 of the procedural code tasks: two-step specifications (filter then transform, group then
aggregate, parse then select)."""
from __future__ import annotations

import math
import random

from toolrl.tasks.code.templates import (LISTS, NUMS, PALINDROMES, PEOPLE, STRS, VOCAB, WORD_LISTS, Instance, ints,
                                         nb, sentence, signed, text, words)


def sum_powers(r: random.Random) -> Instance:
    t, p, op, xs = r.randint(-5, 10), r.randint(2, 3), r.choice([">", "<"]), r.choice(LISTS)
    return Instance({"t": t, "p": p, "op": op}, r.choice(["sum_of_powers", f"sum_{'squares' if p == 2 else 'cubes'}"]),
                    f"{xs}: list[int]", "int",
                    f"Return the sum of the {'squares' if p == 2 else 'cubes'} of the numbers in {xs} that are "
                    f"{'greater' if op == '>' else 'less'} than {t}.",
                    f"total = 0\nfor x in {xs}:\n    if x {op} {t}:\n        total += x ** {p}\nreturn total",
                    lambda g: (ints(g, t - 8, t + 8),), [([],), ([t],)])


def group_totals(r: random.Random) -> Instance:
    m, xs = r.randint(1, 30), r.choice(["pairs", "entries", "records"])
    return Instance({"m": m}, r.choice(["totals_by_name", "group_totals", "big_spenders"]),
                    f"{xs}: list[tuple[str, int]]", "dict[str, int]",
                    f"{xs} is a list of (name, amount) pairs. Add up the amounts of each name and return a "
                    f"dictionary that maps each name whose total is at least {m} to its total.",
                    f"totals = {{}}\nfor name, amount in {xs}:\n    totals[name] = totals.get(name, 0) + amount\n"
                    f"return {{name: total for name, total in totals.items() if total >= {m}}}",
                    lambda g: ([(g.choice(PEOPLE[:3]), g.randint(-2, m)) for _ in range(g.randint(0, 8))],),
                    [([],), ([("ann", m)],)])


def top_letter(r: random.Random) -> Instance:
    k, last, s = r.randint(1, 6), r.random() < 0.5, r.choice(STRS)
    return Instance({"k": k, "last": last}, r.choice(["top_letter", "most_common_initial"]), f"{s}: str", "str",
                    f"Among the words of {s} (separated by whitespace) with at least {k} letters, find the letter "
                    f"that the most of them start with; if several letters tie, return the alphabetically "
                    f"{'last' if last else 'first'} of them. Return '' if no word has at least {k} letters.",
                    f"counts = {{}}\nfor w in {s}.split():\n    if len(w) >= {k}:\n"
                    "        counts[w[0]] = counts.get(w[0], 0) + 1\nif not counts:\n    return ''\n"
                    f"best = max(counts.values())\n"
                    f"return {'max' if last else 'min'}(c for c in counts if counts[c] == best)",
                    lambda g: (" ".join(g.choices(g.sample(VOCAB, 6), k=g.randint(0, 9))),), [("",)])


def filter_join(r: random.Random) -> Instance:
    k, op, sep, how, s = r.randint(2, 6), r.choice([">=", "<="]), r.choice([" ", "-", ",", "+"]), \
        r.choice(["upper", "reverse"]), r.choice(STRS)
    change = "turn them into upper case" if how == "upper" else "reverse each of them"
    return Instance({"k": k, "op": op, "sep": sep, "how": how}, r.choice(["select_and_join", "filter_words", "shout"]),
                    f"{s}: str", "str",
                    f"Take the words of {s} (separated by whitespace) that have "
                    f"{'at least' if op == '>=' else 'at most'} {k} letters, {change}, and return them "
                    f"joined with {sep!r}, in their original order.",
                    f"kept = [w for w in {s}.split() if len(w) {op} {k}]\n"
                    f"return {sep!r}.join({'w.upper()' if how == 'upper' else 'w[::-1]'} for w in kept)",
                    lambda g: (sentence(g, (0, 8)),), [("",)])


def dedupe_take(r: random.Random) -> Instance:
    n, big, xs = r.randint(1, 8), r.random() < 0.5, r.choice(LISTS)
    doc = f"Remove repeated values from {xs}, keeping the first occurrence of each, and return " + (
        f"the {n} largest of the values that remain, largest first" if big else f"the first {n} values that remain")
    return Instance({"n": n, "largest": big}, r.choice(["unique_head", "dedupe_take", "distinct_top"]),
                    f"{xs}: list[int]", "list[int]", doc + " (all of them if fewer remain).",
                    f"seen = []\nfor x in {xs}:\n    if x not in seen:\n        seen.append(x)\n"
                    f"return {f'sorted(seen, reverse=True)[:{n}]' if big else f'seen[:{n}]'}",
                    lambda g: (ints(g, 0, 9, (0, 12)),), [([],), ([3, 3, 3],)])


def chunk_agg(r: random.Random) -> Instance:
    c, agg, xs = r.randint(2, 6), r.choice(["sum", "max", "min"]), r.choice(LISTS)
    what = {"sum": "the sum", "max": "the largest number", "min": "the smallest number"}[agg]
    return Instance({"c": c, "agg": agg}, r.choice([f"chunk_{agg}", f"{agg}_per_chunk", "blocks"]),
                    f"{xs}: list[int]", "list[int]",
                    f"Split {xs} into consecutive chunks of {c} numbers (the last chunk may be shorter) and return a "
                    f"list with {what} of each chunk.",
                    f"result = []\nfor i in range(0, len({xs}), {c}):\n    result.append({agg}({xs}[i:i + {c}]))\n"
                    "return result",
                    lambda g: (ints(g, -20, 20, (0, 13)),), [([],), ([1],)])


def frequent_letters(r: random.Random) -> Instance:
    m, n, fold, s = r.randint(1, 3), r.randint(2, 5), r.random() < 0.5, r.choice(STRS)
    return Instance({"m": m, "n": n, "fold": fold}, r.choice(["frequent_letters", "top_letters"]), f"{s}: str", "str",
                    f"Count the letters of {s} (other characters do not count"
                    f"{'; upper and lower case are the same letter, written in lower case' if fold else ''}). Return "
                    f"a string of the letters that occur at least {m} times, the most frequent first and letters with "
                    f"equal counts in alphabetical order, at most {n} of them.",
                    f"counts = {{}}\nfor c in {s}{'.lower()' if fold else ''}:\n    if c.isalpha():\n"
                    "        counts[c] = counts.get(c, 0) + 1\n"
                    f"kept = [c for c in counts if counts[c] >= {m}]\nkept.sort(key=lambda c: (-counts[c], c))\n"
                    f"return ''.join(kept[:{n}])",
                    lambda g: (text(g),), [("",)])


def map_filter(r: random.Random) -> Instance:
    a, d, xs = r.randint(2, 5), r.randint(2, 5), r.choice(LISTS)
    b = r.choice([b for b in range(-5, 6) if b % math.gcd(a, d) == 0])  # some x give a multiple of d
    expr = signed(a, b)
    return Instance({"a": a, "b": b, "d": d}, r.choice(["map_then_filter", "transform_divisible"]), f"{xs}: list[int]",
                    "list[int]",
                    f"Compute {nb(expr)} for every number x of {xs} and return the results that are divisible by {d}, "
                    "in order.",
                    f"result = []\nfor x in {xs}:\n    y = {expr}\n    if y % {d} == 0:\n        result.append(y)\n"
                    "return result",
                    lambda g: (ints(g, -10, 10, (0, 10)),), [([],)])


def zip_count(r: random.Random) -> Instance:
    op = r.choice(["+", "-", "*"])
    t = r.randint(-5, 30) if op == "*" else r.randint(-5, 10)
    xs, ys = r.choice([("xs", "ys"), ("first", "second"), ("left", "right"), ("a", "b")])

    def pair(g: random.Random) -> tuple:  # mostly of equal length, sometimes one longer
        n = g.randint(0, 8)
        return (ints(g, -10, 10, (n, n)), ints(g, -10, 10, (n, n + 2)))[::g.choice([1, -1])]
    return Instance({"op": op, "t": t}, r.choice(["count_combined", "zip_count", "pairwise_above"]),
                    f"{xs}: list[int], {ys}: list[int]", "int",
                    f"Combine {xs} and {ys} position by position ({nb(f'{xs}[i] {op} {ys}[i]')}; stop at the end "
                    f"of the shorter list) and return how many of the results are greater than {t}.",
                    f"count = 0\nfor x, y in zip({xs}, {ys}):\n    if x {op} y > {t}:\n        count += 1\n"
                    "return count",
                    pair, [([], []), ([t], [0, 1])])


def parse_scores(r: random.Random) -> Instance:
    t, isep, kv, s = r.randrange(40, 91, 5), r.choice([",", ";", " "]), r.choice([":", "="]), r.choice(STRS)
    return Instance({"t": t, "isep": isep, "kv": kv}, r.choice(["passing_names", "parse_scores", "who_passed"]),
                    f"{s}: str", "list[str]",
                    f"{s} holds entries 'name{kv}score' separated by {isep!r}, e.g. 'ann{kv}72{isep}bob{kv}90'. Return "
                    f"the names whose score is at least {t}, sorted alphabetically.",
                    f"names = []\nfor entry in {s}.split({isep!r}):\n    if entry:\n"
                    f"        name, score = entry.split({kv!r})\n        if int(score) >= {t}:\n"
                    "            names.append(name)\nreturn sorted(names)",
                    lambda g: (isep.join(f"{p}{kv}{g.randint(0, 100)}" for p in words(g, (0, 6), pool=PEOPLE)),),
                    [("",), (f"eve{kv}{t}",)])


def digit_agg(r: random.Random) -> Instance:
    d, product, n = r.randint(0, 8), r.random() < 0.5, r.choice(NUMS)
    body = f"digits = [int(c) for c in str(abs({n})) if int(c) > {d}]\n"
    body += ("if not digits:\n    return 0\nresult = 1\nfor digit in digits:\n    result *= digit\nreturn result"
             if product else "return sum(digits)")
    name = r.choice(["digit_" + ("product" if product else "sum"), "big_digits"])
    return Instance({"d": d, "product": product}, name, f"{n}: int", "int",
                    f"Return the {'product' if product else 'sum'} of the digits of {n} (ignoring its sign) that are "
                    f"greater than {d}, or 0 if there are none.", body,
                    lambda g: (g.randint(-10 ** g.randint(1, 7), 10 ** g.randint(1, 7)),), [(0,), (-d,)])


def group_mod(r: random.Random) -> Instance:
    m, agg, xs = r.randint(2, 7), r.choice(["sum", "len", "max"]), r.choice(LISTS)
    what = {"sum": "sum", "len": "number of elements", "max": "largest number"}[agg]
    name = r.choice(["group_by_remainder", f"{'count' if agg == 'len' else agg}_by_mod"])
    return Instance({"m": m, "agg": agg}, name, f"{xs}: list[int]", "dict[int, int]",
                    f"Group the numbers of {xs} (none of them negative) by their remainder when divided by {m}, and "
                    f"return a dictionary that maps each remainder that occurs to the {what} of its group.",
                    f"groups = {{}}\nfor x in {xs}:\n    groups.setdefault(x % {m}, []).append(x)\n"
                    f"return {{r: {agg}(g) for r, g in groups.items()}}",
                    lambda g: (ints(g, 0, 40, (0, 10)),), [([],), ([m],)])


def palindromes(r: random.Random) -> Instance:
    k, out, ws = r.randint(1, 5), r.choice(["positions", "words", "count"]), r.choice(WORD_LISTS)
    what = {"positions": f"their positions in {ws} (counting from 0)", "words": "them, in their original order",
            "count": "how many there are"}[out]
    return Instance({"k": k, "out": out}, r.choice(["palindromes", "find_palindromes", "mirror_words"]),
                    f"{ws}: list[str]", "int" if out == "count" else "list[int]" if out == "positions" else "list[str]",
                    f"Find the words of {ws} that read the same backwards and forwards and have at least {k} letters. "
                    f"Return {what}.",
                    f"found = []\nfor i, w in enumerate({ws}):\n    if len(w) >= {k} and w == w[::-1]:\n"
                    f"        found.append({'w' if out == 'words' else 'i'})\n"
                    f"return {'len(found)' if out == 'count' else 'found'}",
                    lambda g: ([g.choice(PALINDROMES if g.random() < 0.5 else VOCAB) for _ in range(g.randint(0, 8))],),
                    [([],)])


def sort_containing(r: random.Random) -> Instance:
    c, longest, ws = r.choice("aeilnort"), r.random() < 0.5, r.choice(WORD_LISTS)
    return Instance({"c": c, "longest": longest}, r.choice(["sorted_with_letter", "select_and_sort"]),
                    f"{ws}: list[str]", "list[str]",
                    f"Return the words of {ws} that contain the letter {c!r}, sorted by length, "
                    f"{'longest' if longest else 'shortest'} first (words of equal length keep their order).",
                    f"kept = [w for w in {ws} if {c!r} in w]\n"
                    f"return sorted(kept, key=len{', reverse=True' if longest else ''})",
                    lambda g: (words(g, (0, 9)),), [([],)])


def row_sums(r: random.Random) -> Instance:
    t, op, grid = r.randint(-5, 10), r.choice([">", "<"]), r.choice(["grid", "rows", "table"])
    return Instance({"t": t, "op": op}, r.choice(["row_totals", "sum_rows_filtered"]), f"{grid}: list[list[int]]",
                    "list[int]",
                    f"{grid} is a list of rows of numbers. For each row, add up its numbers that are "
                    f"{'greater' if op == '>' else 'less'} than {t}; return the list of these row totals.",
                    f"totals = []\nfor row in {grid}:\n    total = 0\n    for x in row:\n        if x {op} {t}:\n"
                    "            total += x\n    totals.append(total)\nreturn totals",
                    lambda g: ([ints(g, t - 8, t + 8, (0, 5)) for _ in range(g.randint(0, 4))],), [([],), ([[]],)])


TEMPLATES = [sum_powers, group_totals, top_letter, filter_join, dedupe_take, chunk_agg, frequent_letters, map_filter,
             zip_count, parse_scores, digit_agg, group_mod, palindromes, sort_containing, row_sums]
