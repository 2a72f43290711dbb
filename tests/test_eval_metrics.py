"""Answer metrics against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from d2r_edge.eval.metrics import (
    contains_answer,
    exact_match,
    fever_label,
    flips,
    macro_f1,
    normalize_answer,
    paired_bootstrap,
    token_f1,
)


def test_squad_normalization():
    assert normalize_answer("The  National Hockey League!") == "national hockey league"
    assert normalize_answer("an Apple, a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"          # articles only as whole words


def test_contains_answer_on_token_boundaries():
    assert contains_answer("The bridge was designed by Agnes Morrow in 1881.", ["Agnes Morrow"]) == 1.0
    assert contains_answer("It opened in 1967.", ["1967"]) == 1.0
    assert contains_answer("It opened in 19670.", ["1967"]) == 0.0        # not a token
    assert contains_answer("Played by the Northbank Orchestra.", ["the Northbank Orchestra"]) == 1.0
    assert contains_answer("anything", [""]) == 0.0 and contains_answer("", ["x"]) == 0.0


def test_exact_match_against_aliases():
    assert exact_match("the NHL.", ["National Hockey League", "NHL"]) == 1.0
    assert exact_match("NHL", ["National Hockey League (NHL)"]) == 0.0
    assert exact_match("", ["x"]) == 0.0


def test_token_f1_hand_computed():
    # prediction "national hockey" vs gold "national hockey league nhl": p = 2/2, r = 2/4 -> F1 = 2/3
    assert token_f1("National Hockey", ["National Hockey League (NHL)"]) == pytest.approx(2 / 3)
    # the best of several gold answers counts
    assert token_f1("Broad Peak", ["Nanda Devi", "Broad Peak"]) == 1.0
    # HotpotQA's rule: yes/no only match exactly
    assert token_f1("yes indeed", ["yes"]) == 0.0
    # repeated tokens count by multiplicity: "a b b" vs "b b c": common 2, p 2/3, r 2/3
    assert token_f1("x y y", ["y y z"]) == pytest.approx(2 / 3)


def test_fever_labels_and_macro_f1():
    assert fever_label("UNVERIFIED") == "NOT ENOUGH INFO"
    assert fever_label("NOT_ENOUGH_INFO") == fever_label(None) == "NOT ENOUGH INFO"
    assert fever_label("supports") == "SUPPORTS"
    gold = ["SUPPORTS", "SUPPORTS", "REFUTES", "NOT ENOUGH INFO"]
    pred = ["SUPPORTS", "REFUTES", "REFUTES", "SUPPORTS"]
    # SUPPORTS: tp 1 fp 1 fn 1 -> 0.5; REFUTES: tp 1 fp 1 fn 0 -> 2/3; NEI: tp 0 -> 0
    assert macro_f1(gold, pred) == pytest.approx((0.5 + 2 / 3 + 0) / 3)


def test_paired_bootstrap_known_cases():
    a = np.zeros(50)
    same = paired_bootstrap(a, a + 0.1, n_resamples=500)
    assert same.mean == pytest.approx(0.1) and same.lo == pytest.approx(0.1) and same.hi == pytest.approx(0.1)
    assert same.excludes_zero
    # half the queries +1, half -1: mean 0, the interval straddles 0 symmetrically
    b = np.r_[np.ones(100), -np.ones(100)]
    ci = paired_bootstrap(np.zeros(200), b, n_resamples=4000, seed=3)
    assert ci.mean == 0.0 and ci.lo < 0 < ci.hi and not ci.excludes_zero
    # the normal approximation of the mean's sd is 1/sqrt(200) = 0.0707: 95% -> +-0.139
    assert ci.hi == pytest.approx(1.96 / np.sqrt(200), abs=0.02)
    # paired: a shared per-query offset cancels, the interval is as narrow as the differences
    rng = np.random.default_rng(0)
    base = rng.normal(0, 10, 300)
    ci = paired_bootstrap(base, base + 1.0 + rng.normal(0, 0.01, 300), n_resamples=1000)
    assert ci.lo > 0.99 and ci.hi < 1.01
    with pytest.raises(ValueError):
        paired_bootstrap([1, 2], [1])


def test_flips():
    assert flips([1, 1, 0, 0], [1, 0, 1, 0]) == (1, 1)
    assert flips([0, 0, 0], [1, 1, 0]) == (2, 0)
