"""The arithmetic family: the seeded generator, its curriculum streams and its teacher's traces."""
import contextlib
import io
import itertools
import json
import random
from pathlib import Path

import pytest

from toolrl.config import DataConfig, TeacherConfig
from toolrl.format import STOP_MARKER
from toolrl.tasks import DataError, get_task, load_problems, load_task, problem_stream
from toolrl.tasks.arithmetic import (_TAUGHT_NAMES, FREE_KINDS, KINDS, LEVELS, TAUGHT_KINDS, arithmetic_problem,
                                     arithmetic_problems, arithmetic_stream, cue_clause, expression_in_words,
                                     kind_problem, mixed_stream)
from toolrl.tasks.textmath import load_gsm8k

FIX = Path(__file__).resolve().parent.parent / "fixtures"


def test_arithmetic_is_seeded_and_correct():
    a = arithmetic_problems(20, seed=7, level=3)
    b = arithmetic_problems(20, seed=7, level=3)
    assert a == b
    assert a != arithmetic_problems(20, seed=8, level=3)
    for p in a:
        expr = p.meta["expression"]
        assert str(eval(expr)) == p.answer
        assert p.program == f"print({expr})"
        assert int(p.answer) > 0
        for v in p.meta["numbers"].values():
            assert str(v) in p.question


@pytest.mark.parametrize("level", LEVELS)
def test_levels_need_a_calculator(level):
    probs = arithmetic_problems(50, seed=0, level=level)
    assert all(int(p.answer) >= 144 for p in probs)  # never a one-digit toy
    assert len({p.question for p in probs}) == 50
    if level >= 2:  # multi-step: at least one product and one more operation
        assert all(p.meta["expression"].count("*") >= 1 and len(p.meta["numbers"]) >= 3 for p in probs)
    # harder levels have bigger answers on average
    if level > 1:
        prev = arithmetic_problems(50, seed=0, level=level - 1)
        assert sum(int(p.answer) for p in probs) > sum(int(p.answer) for p in prev)


def test_training_problems_and_streams():
    cfg = DataConfig(source="arithmetic", seed=3, level=2)
    probs = load_problems(cfg, n=5)
    assert probs == arithmetic_problems(5, seed=3, level=2)
    assert load_problems(cfg, n=5, seed=4) != probs
    # each worker its own stream; the curriculum's level replaces data.level; mix_levels takes 1..level in turn
    a, b = problem_stream(cfg, "w0"), problem_stream(cfg, "w1")
    assert [p.id for p in itertools.islice(a, 3)] != [p.id for p in itertools.islice(b, 3)]
    assert {p.level for p in itertools.islice(problem_stream(cfg, "w0", level=4), 5)} == {4}
    mixed = DataConfig(source="arithmetic", level=3, mix_levels=True)
    assert [p.level for p in itertools.islice(problem_stream(mixed, "w0"), 6)] == [1, 2, 3, 1, 2, 3]
    assert get_task("arithmetic").curriculum and not get_task("gsm8k").curriculum


def test_heldout_seed_differs():
    cfg = DataConfig()
    train = {p.question for p in arithmetic_problems(200, seed=cfg.seed, level=1)}
    held = {p.question for p in arithmetic_problems(200, seed=cfg.eval_seed, level=1)}
    assert len(train & held) <= 2  # different streams; a rare coincidence is possible
    assert arithmetic_problem(cfg.eval_seed, 1, 0).id != arithmetic_problem(cfg.seed, 1, 0).id
    json.dumps(arithmetic_problem(0, 5, 0).meta)  # meta stays JSON-serialisable


def test_expression_in_words():
    assert expression_in_words("148 * 36 - 2915") == "148 times 36, minus 2915"
    assert expression_in_words("(2 * 3 + 4 * 5) * 6 - 7") == "(2 times 3, plus 4 times 5) times 6, minus 7"


def test_teacher_trace_plans_programs_and_concludes_from_the_output():
    """The trace's text (the executor run and the token layout: tests/test_rollout_loop.py)."""
    teacher = get_task("arithmetic").teacher(TeacherConfig())
    rng = random.Random(0)
    for p in arithmetic_problems(6, seed=4, level=3):
        t = teacher(p, rng)
        assert t.text.endswith(STOP_MARKER) and f"```python\n{t.program}\n```" in t.text and t.expect == p.answer
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(t.program, {})  # our own program: every style prints the answer
        assert out.getvalue().strip() == p.answer
        a, b, c = (p.meta["numbers"][k] for k in "abc")
        assert f"{a} times {b}, minus {c}" in t.text.split("<program>")[0]  # the plan names the operation
        assert t.conclusion("123").endswith("\\boxed{123}\n</answer>") and "</think>" in t.conclusion("1")
    assert teacher(load_gsm8k(str(FIX / "gsm8k_sample.jsonl"))[0], rng) is None  # not generated: no trace


def test_quote_cue_quotes_the_words_that_decide_plus_or_minus():
    """teacher.quote_cue: the plan starts from the clause of the question around the last number, and
    says which way it goes; without the option the plan is as before."""
    cued = get_task("arithmetic").teacher(TeacherConfig(quote_cue=True))
    plain = get_task("arithmetic").teacher(TeacherConfig())
    rng = random.Random(0)
    clauses = {2: set(), 3: set()}
    for level in (2, 3):
        for p in arithmetic_problems(40, seed=1, level=level):
            clause, n, op = cue_clause(p)
            c = str(p.meta["numbers"]["c"])
            assert n == c and op == "+-"[level - 2] and c in clause and clause in p.question
            clauses[level].add(clause.replace(c, "C"))
            head = cued(p, rng).text.split("<program>")[0]
            how = "is added" if level == 2 else "is taken away"
            assert f'"{clause}"' in head and f"{c} {how}" in head
            assert head.index(clause) < head.index(expression_in_words(p.meta["expression"]))  # cue, then plan
            assert "is added" not in plain(p, rng).text and '"' not in plain(p, rng).text
    # the clause is the verb's phrase, not the whole question, for every template
    assert clauses == {2: {"It already holds C bottles", "receives C donated books", "plus C toys on a night shift",
                           "then C more laps in a race"},
                       3: {"sells C rolls", "C of them ride for free", "C batteries turn out to be broken",
                           "ships C of them"}}
    assert cue_clause(arithmetic_problem(1, 4, 0)) is None  # a·b + c·d ends in a product: no cue
    assert '"' not in cued(arithmetic_problem(1, 4, 0), rng).text
    f = arithmetic_problem(1, 5, 0).meta["numbers"]["f"]
    assert cue_clause(arithmetic_problem(1, 5, 0))[1:] == (str(f), "-")


# ---------------------------------------------------------------------------------------------
# Kinds: the taught ones (the levels) and the teacher-free ones

def test_every_problem_has_a_kind_and_the_free_kinds_are_right():
    for level in LEVELS:  # the taught kinds are the levels, problem for problem
        p = arithmetic_problem(3, level, 0)
        assert (p.meta["kind"], p.meta["taught"]) == (_TAUGHT_NAMES[level], True) == (TAUGHT_KINDS[level - 1], True)
        assert kind_problem(3, p.meta["kind"], 0) == p and p.id == f"arith-L{level}-s3-0"
    assert set(FREE_KINDS) == {"gain", "loss", "product_plus_commas", "product_minus_commas"}
    assert not set(FREE_KINDS) & set(TAUGHT_KINDS)
    for kind in FREE_KINDS:
        probs = [kind_problem(7, kind, i) for i in range(40)]
        assert probs == [kind_problem(7, kind, i) for i in range(40)]  # seeded
        assert probs != [kind_problem(8, kind, i) for i in range(40)]
        assert len({p.question for p in probs}) == 40
        for i, p in enumerate(probs):
            expr = p.meta["expression"]
            assert (p.meta["kind"], p.meta["taught"], p.level) == (kind, False, KINDS[kind].level)
            assert p.id == f"arith-{kind}-s7-{i}" and p.program == f"print({expr})"
            assert str(eval(expr)) == p.answer and int(p.answer) >= 144  # positive, and needs a calculator
            shown = (lambda v: f"{v:,}") if KINDS[kind].commas else str  # noqa: E731
            assert all(shown(v) in p.question for v in p.meta["numbers"].values())
            json.dumps(p.meta)
    gain, loss = kind_problem(0, "gain", 0), kind_problem(0, "loss", 0)
    assert " + " in gain.meta["expression"] and " - " in loss.meta["expression"]


def test_gain_and_loss_differ_only_in_a_verb_the_teacher_never_uses():
    """Each scene is worded once gaining and once losing, with the same question: only the verb says
    which operation it is, and the taught templates never use those words."""
    taught = " ".join(t for k in TAUGHT_KINDS for t in KINDS[k].templates).lower()
    for g, lo in zip(KINDS["gain"].templates, KINDS["loss"].templates):
        (g_head, g_question), (l_head, l_question) = g.rsplit(". ", 1), lo.rsplit(". ", 1)
        assert g_question == l_question and g_head.split(", and then ")[0] == l_head.split(", and then ")[0]
    for cue in ("joins", "gift", "picks", "takes on", "fly away", "loses", "wilt", "unloads"):
        assert cue in " ".join(KINDS["gain"].templates + KINDS["loss"].templates) and cue not in taught
    # nor does the question's ending: a taught a·b + c question ends "... now?", and SFT on it
    # moved both free kinds toward plus
    endings = {" ".join(t.rstrip("?").split()[-2:]) for k in TAUGHT_KINDS for t in KINDS[k].templates}
    for t in KINDS["gain"].templates + KINDS["loss"].templates:
        assert " ".join(t.rstrip("?").split()[-2:]) not in endings and not t.endswith("now?"), t


def test_the_comma_kinds_are_taught_operations_whose_numbers_a_program_must_not_copy():
    """product_plus_commas, product_minus_commas: a taught template with a and c over 1000 written
    "1,250". The expression is right; the question's numbers copied into Python are a tuple."""
    for kind, level in (("product_plus_commas", 2), ("product_minus_commas", 3)):
        for i in range(30):
            p = kind_problem(4, kind, i)
            n, sep = p.meta["numbers"], {k: f"{v:,}" for k, v in p.meta["numbers"].items()}
            assert (p.level, p.meta["commas"], p.meta["taught"]) == (level, True, False)
            assert p.meta["expression"] == KINDS[f"{_TAUGHT_NAMES[level]}"].expression.format(**n)
            assert p.question in [t.format(**sep) for t in KINDS[_TAUGHT_NAMES[level]].templates]
            assert n["a"] > 1000 and n["c"] > 1000 and f"{n['a']:,}" in p.question and int(p.answer) > 0
            try:  # "1,005" is a syntax error (a leading zero), "1,250" a tuple
                copied = eval(KINDS[kind].expression.format(**sep))
                assert isinstance(copied, tuple) and str(copied) != p.answer
            except SyntaxError:
                assert ",0" in p.question
    assert "commas" not in kind_problem(4, "gain", 0).meta and "commas" not in arithmetic_problem(4, 2, 0).meta


def test_the_default_stream_is_unchanged_and_naming_the_taught_kinds_changes_nothing():
    ids = lambda it, n=12: [p.id for p in itertools.islice(it, n)]  # noqa: E731
    for mix, level in ((True, 3), (False, 2), (True, 1)):
        d = DataConfig(level=level, max_level=3, mix_levels=mix)
        old = ids(mixed_stream(d.seed * 100_003 + 7, level) if mix else arithmetic_stream(d.seed * 100_003 + 7, level))
        assert ids(get_task("arithmetic").stream(d, 7)) == old
        for kinds in (["taught"], ["product", "product_plus", "product_minus"]):
            assert ids(get_task("arithmetic").stream(d.model_copy(update={"kinds": kinds}), 7)) == old
    d = DataConfig(level=2, kinds=["taught"])
    assert load_problems(d, n=5) == arithmetic_problems(5, seed=0, level=2)


def test_the_stream_draws_the_kinds_named_in_turn():
    d = DataConfig(level=3, max_level=3, mix_levels=True, kinds=["all"])  # levels 4-5 are above the curriculum
    got = list(itertools.islice(problem_stream(d, "w0"), 15))
    assert [p.meta["kind"] for p in got[:5]] == ["product", "product_plus", "product_minus", "gain", "loss"]
    assert len({p.id for p in got}) == 15
    # a kind named twice comes twice as often, never with the same problem twice
    twice = list(itertools.islice(problem_stream(d.model_copy(update={"kinds": ["taught", "verbs", "verbs"]}), "w0"),
                                  70))
    kinds = [p.meta["kind"] for p in twice]
    assert kinds.count("loss") == kinds.count("gain") == 20 == 2 * kinds.count("product")
    assert len({p.id for p in twice}) == 70
    # without mix_levels, the kinds at the curriculum's level; the curriculum's level picks among them
    only = DataConfig(level=2, max_level=3, kinds=["product_plus", "gain", "product_minus", "loss"])
    kinds_of = lambda it: {p.meta["kind"] for p in itertools.islice(it, 8)}  # noqa: E731
    assert kinds_of(problem_stream(only, "w0")) == {"product_plus", "gain"}
    assert kinds_of(problem_stream(only, "w0", level=3)) == {"product_minus", "loss"}
    with pytest.raises(DataError, match="unknown arithmetic kind 'gains'"):
        problem_stream(d.model_copy(update={"kinds": ["gains"]}), "w0")
    with pytest.raises(DataError, match="level 1"):
        problem_stream(DataConfig(level=1, max_level=3, kinds=["gain", "loss"]), "w0")
    # a level the curriculum could reach later has no kind: said when the stream is made, not at a promotion
    with pytest.raises(DataError, match="data.kinds at level 3"):
        problem_stream(DataConfig(level=2, max_level=3, kinds=["gain", "product_plus"]), "w0")
    assert problem_stream(DataConfig(level=2, max_level=3, kinds=["gain", "product_plus"], mix_levels=True), "w0")


def test_twin_free_kinds_pair_each_gain_problem_with_its_loss_twin():
    """data.twin_free_kinds: gain's and loss's problem i share scene and numbers, so only the verb
    (and the answer, by 2c) tells them apart; off, they are drawn apart; the taught kinds are as before."""
    d = DataConfig(level=3, max_level=3, mix_levels=True, kinds=["taught", "verbs", "verbs"])
    pairs = lambda data: [(g, lo) for g, lo in itertools.pairwise(itertools.islice(problem_stream(data, "w0"), 70))  # noqa: E731
                          if (g.meta["kind"], lo.meta["kind"]) == ("gain", "loss")]
    twins, apart = pairs(d.model_copy(update={"twin_free_kinds": True})), pairs(d)
    assert len(twins) == len(apart) == 20
    for g, lo in twins:
        assert g.meta["numbers"] == lo.meta["numbers"] and g.question != lo.question
        assert g.question.split(", and then ")[0] == lo.question.split(", and then ")[0]
        assert int(g.answer) - int(lo.answer) == 2 * g.meta["numbers"]["c"]
    assert sum(g.meta["numbers"] == lo.meta["numbers"] for g, lo in apart) == 0
    taught = lambda data: [p.id for p in itertools.islice(problem_stream(data, "w0"), 70) if p.meta["taught"]]  # noqa: E731
    assert taught(d.model_copy(update={"twin_free_kinds": True})) == taught(d)
    for kind in ("product_plus_commas", "product_minus_commas"):  # only gain and loss are paired
        assert [kind_problem(0, kind, i, twins=True) for i in range(5)] == [kind_problem(0, kind, i) for i in range(5)]
    for kinds in (None, ["taught", "gain"]):  # nothing to pair: said, not ignored
        with pytest.raises(DataError, match="twin_free_kinds"):
            problem_stream(d.model_copy(update={"kinds": kinds, "twin_free_kinds": True}), "w0")


def test_heldout_selects_kinds_and_stays_apart_from_training():
    d = DataConfig(level=1)
    free = load_task("arithmetic:1-3@verbs", 6, 5, d)
    assert [p.id for p in free] == [f"arith-{k}-s5-{i}" for i in range(3) for k in ("gain", "loss")]
    assert load_task("arithmetic:1-3@verbs", 4, 5, d) == free[:4]  # a smaller eval is a prefix
    assert load_task("arithmetic:@verbs", 6, 5, d) == free == load_task("arithmetic:1-3@gain,loss", 6, 5, d)
    commas = ("product_plus_commas", "product_minus_commas")
    assert [p.meta["kind"] for p in load_task("arithmetic:1-3@free", 8, 5, d)] == ["gain", "loss", *commas] * 2
    assert load_task("arithmetic:1-3@commas", 4, 5, d) == load_task("arithmetic:1-3@" + ",".join(commas), 4, 5, d)
    every = load_task("arithmetic:1-3@all", 10, 5, d)
    assert [p.meta["kind"] for p in every[:5]] == ["product", "product_plus", "product_minus", "gain", "loss"]
    assert every[:3] == load_task("arithmetic:1-3", 9, 5, d)[:3]  # the taught kinds' problems are the levels'
    assert load_task("arithmetic:1-3@taught", 9, 5, d) == load_task("arithmetic:1-3", 9, 5, d)
    assert {p.meta["kind"] for p in load_task("arithmetic:3@free", 4, 5, d)} == {"loss", "product_minus_commas"}
    for bad, words in (("arithmetic:1@loss", "level 1"), ("arithmetic:1-3@nope", "unknown arithmetic kind"),
                       ("arithmetic:1-3@", "no kind"), ("arithmetic:x@free", "@KINDS")):
        with pytest.raises(DataError, match=words):
            load_task(bad, 3, 5, d)
    # training draws from data.seed, held-out problems from data.eval_seed: no question in common
    train = DataConfig(level=3, max_level=3, mix_levels=True, kinds=["free"])
    trained = {p.question for p in itertools.islice(problem_stream(train, "w0"), 400)}
    held = load_task("arithmetic:1-3@free", 400, train.eval_seed, train)
    assert not trained & {p.question for p in held}


def test_the_teacher_demonstrates_only_the_taught_kinds():
    rng = random.Random(0)
    task = get_task("arithmetic")
    taught, free = load_task("arithmetic:1-3@taught", 6, 5, DataConfig()), load_task("arithmetic:1-3@free", 6, 5,
                                                                                      DataConfig())
    default = task.teacher(TeacherConfig())
    assert all(default(p, rng) is not None for p in taught) and all(default(p, rng) is None for p in free)
    said = task.teacher(TeacherConfig(kinds=["taught"]))
    assert all(said(p, rng) is not None for p in taught) and all(said(p, rng) is None for p in free)
    # teacher.kinds may teach a teacher-free kind (an upper bound to compare with), and then its trace is right
    loss_only = task.teacher(TeacherConfig(kinds=["loss"]))
    for p in free:
        t = loss_only(p, rng)
        assert (t is not None) == (p.meta["kind"] == "loss")
        if t is not None:
            assert t.expect == p.answer and "minus" in t.text.split("<program>")[0]
    assert all(loss_only(p, rng) is None for p in taught)
    with pytest.raises(DataError, match="teacher.kinds"):
        task.teacher(TeacherConfig(kinds=["gian"]))
