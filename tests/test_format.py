"""The output format read back: boxed answers, the answer block, and the program before the stop marker."""
import pytest

from toolrl.format import STOP_MARKER, extract_answer, extract_program, last_boxed


@pytest.mark.parametrize("text, want", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{a}{b}}", r"\frac{a}{b}"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),
    (r"\boxed{unclosed", None),
    ("nothing", None),
])
def test_last_boxed(text, want):
    assert last_boxed(text) == want


M = STOP_MARKER


@pytest.mark.parametrize("segment,want", [
    ("<program>\n```python\nx = 1\nprint(x)\n```\n</program>\n" + M, "x = 1\nprint(x)"),
    ("```python\na = 1\n```\nthen\n```python\nb = 2\n```\n" + M, "b = 2"),  # the last block
    ("```python\na = 1\n```\n```bash\nls\n```\n" + M, "a = 1"),  # python wins over a later other fence
    ("```\nprint(3)\n```\n" + M, "print(3)"),  # a bare fence
    ("<program>\nprint(4)\n</program>\n" + M, "print(4)"),  # bare code in <program> tags
    ("<program>\n```python\nprint(5)\n" + M, "print(5)"),  # an unclosed fence runs to the marker
    ("```python\nprint(6)\n```\n" + M + "\n```output\n6\n```\n", "print(6)"),  # after the marker: ignored
    ("```output\n7\n```\n" + M, None),  # an output fence is not a program
    ("I will just think.\n" + M, None),
    ("<program>\n</program>\n" + M, None),
])
def test_extract_program(segment, want):
    assert extract_program(segment, M) == want


def test_extract_answer_reads_the_last_box_of_the_last_answer_block():
    assert extract_answer("<answer>\\boxed{1}</answer> text <answer>\\boxed{2} \\boxed{3}</answer>") == "3"
    assert extract_answer("\\boxed{5} but no answer block") is None
    assert extract_answer("<answer>no box</answer>") is None


@pytest.mark.parametrize("segment,program", [
    # an empty last python fence: the code is in the one before it (nothing ran)
    ("<program>\n```python\nprint(1)\n```\n```python\n```\n</program>\n", "print(1)"),
    # a one-line fence (its closing backticks were read as an opening fence: "</program>" ran)
    ("<program>\n```python print(47*38)```\n</program>\n", "print(47*38)"),
    ("<program>\n```python\nx = 2\n```\n```py print(x)```\n", "print(x)"),  # the last one
    # an indented fence or body (an IndentationError)
    ("<program>\n  ```python\n  x = 1\n  print(x)\n  ```\n</program>\n", "x = 1\nprint(x)"),
    ("<program>\n    print(3)\n</program>", "print(3)"),
    ("<program>\n```python\n```\n</program>", None),
])
def test_programs_are_found_where_the_model_put_them(segment, program):
    """Found in review: each of these ran nothing, the wrong text, or failed on its indentation."""
    assert extract_program(segment) == program
