"""What a procedural code template is made of (toolrl.tasks.code.procedural): a template is a function
of a `random.Random` that draws its parameters and returns one `Instance`, the function to write.

The instance's `params` are its meaning (thresholds, constants, which variant), and with the
template's name they are the instance's key: the train/held-out split is made on that key, so a
held-out function is never one the training stream can produce, whatever its names. Names (of the
function and its arguments) are drawn too, but only vary the surface.

The level modules (templates_lines, templates_loops, templates_steps) hold the templates; this
module holds what they share: the instance, the name pools and the input generators.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

Inputs = Callable[[random.Random], tuple]  # one random argument tuple for the function


@dataclass
class Instance:
    params: dict  # the meaning: with the template's name, the key the split is made on (JSON values)
    name: str  # the function's name
    args: str  # its parameters as written in the signature, e.g. "nums: list[int], k: int"
    returns: str  # its return annotation
    doc: str  # the specification, one paragraph (the examples are added from the reference)
    body: str  # the reference solution's body, not indented
    inputs: Inputs  # random arguments for examples and hidden tests
    edges: list[tuple] = field(default_factory=list)  # fixed arguments always tested (empty input, boundaries)


Template = Callable[[random.Random], Instance]

# Surface names: drawn per instance, never part of its key.
LISTS = ["nums", "numbers", "values", "xs", "items", "data"]
STRS = ["s", "text", "string", "line"]
WORD_LISTS = ["words", "names", "items", "tokens"]
NUMS = ["n", "x", "num", "value"]

VOCAB = ["a", "an", "by", "sky", "fig", "kiwi", "pear", "plum", "lime", "date", "apple", "grape", "melon",
         "lemon", "mango", "peach", "olive", "berry", "banana", "cherry", "orange", "papaya", "avocado",
         "apricot", "coconut", "tomato", "mulberry", "plantain", "blueberry", "raspberry", "watermelon"]
PALINDROMES = ["a", "wow", "noon", "level", "kayak", "radar", "civic", "refer", "madam", "racecar"]
FIRST_LETTERS = sorted({w[0] for w in VOCAB})
LAST_LETTERS = sorted({w[-1] for w in VOCAB})
PEOPLE = ["ann", "bob", "cid", "dee", "eve", "fay"]


def ints(r: random.Random, lo: int = -20, hi: int = 20, n: tuple[int, int] = (0, 8)) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(*n))]


def words(r: random.Random, n: tuple[int, int] = (0, 7), pool: list[str] = VOCAB, caps: bool = False) -> list[str]:
    out = [r.choice(pool) for _ in range(r.randint(*n))]
    if caps:  # some words capitalised, a few all in upper case
        out = [w.capitalize() if x < 0.3 else w.upper() if x < 0.45 else w for w, x in ((w, r.random()) for w in out)]
    return out


def sentence(r: random.Random, n: tuple[int, int] = (0, 7), caps: bool = False) -> str:
    return " ".join(words(r, n, caps=caps))


def text(r: random.Random) -> str:
    """Words with some capitals and punctuation: for character-level templates."""
    out = ""
    for w in words(r, (0, 6), caps=True):
        out += w + r.choice([" ", " ", " ", ", ", ". ", "! "])
    return out.strip()


def letters(r: random.Random, alphabet: str = "abcdeilnorst", n: tuple[int, int] = (0, 10)) -> str:
    return "".join(r.choice(alphabet) for _ in range(r.randint(*n)))


def signed(a: int, b: int, var: str = "x") -> str:
    """'3 * x + 4', '3 * x - 4' or '3 * x': a linear expression as a person writes it."""
    head = f"{a} * {var}"
    return head if b == 0 else f"{head} {'+' if b > 0 else '-'} {abs(b)}"


def nb(code: str) -> str:
    """A code fragment of a spec, kept on one line when the docstring is wrapped."""
    return code.replace(" ", NBSP)


NBSP = "\u00a0"  # textwrap does not break at it; the prompt has plain spaces again


def ordinal(k: int) -> str:
    return {1: "first", 2: "second", 3: "third", 4: "fourth", 5: "fifth"}.get(k, f"{k}th")


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
