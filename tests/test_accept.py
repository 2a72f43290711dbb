"""Accept or revert a repair (issue 51 §1): the comparator, and the pipeline keeping the answer it trusts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from stand_ins import demo_questions, make_runtime

from d2r_edge.accept import PAIR_NAMES, Comparator, pair_features
from d2r_edge.detector import Detector, feature_names
from d2r_edge.errors import ConfigError


def _constant(names, p: float, threshold: float = 0.5, task: str = "qa") -> Detector:
    """A model of the detector's form whose output is p whatever the features."""
    n = len(names)
    bias = float(np.log(p / (1 - p)))
    return Detector(tuple(names), task, np.zeros(n), np.ones(n), np.zeros(n), bias, threshold)


def _rows(rng, n):
    """Pairs where the repaired answer is the better one exactly when its P(wrong) fell."""
    rows, y = [], []
    for _ in range(n):
        first, second = rng.random(), rng.random()
        row = {k: 0.0 for k in PAIR_NAMES}
        row.update(pw_first=first, pw_repaired=second, pw_delta=second - first, changed=1.0,
                   r_ent_first=rng.random(), r_ent_repaired=rng.random(), arm_retrieval=float(rng.random() < 0.5))
        row["r_ent_delta"] = row["r_ent_repaired"] - row["r_ent_first"]
        rows.append(row)
        y.append(second + rng.normal(0, 0.05) < first)
    return rows, y


def test_the_comparator_learns_which_answer_to_keep_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    rows, y = _rows(rng, 120)
    comp = Comparator.fit(rows, y, "fever")
    test_rows, test_y = _rows(rng, 60)
    kept = np.array([comp.p_better(r) >= comp.threshold for r in test_rows])
    assert np.mean(kept == np.array(test_y)) > 0.85                   # it reads the P(wrong) difference
    comp.save(tmp_path / "c.json")
    back = Comparator.load(tmp_path / "c.json")
    assert back.threshold == comp.threshold
    assert [back.p_better(r) for r in test_rows[:5]] == pytest.approx([comp.p_better(r) for r in test_rows[:5]])
    assert json.loads((tmp_path / "c.json").read_text())["features"] == list(PAIR_NAMES)


def test_too_few_flips_are_refused_with_how_many_it_needs():
    rng = np.random.default_rng(1)
    rows, y = _rows(rng, 12)
    with pytest.raises(ConfigError, match=">= 2 fixes and >= 2 breaks"):
        Comparator.fit(rows, [True] * 11 + [False], "qa")
    with pytest.raises(ConfigError, match=">= 10 repairs"):
        Comparator.fit(rows[:5], y[:5], "qa")


@pytest.fixture(scope="module")
def runtime(demo_kb, tiny_models):
    return make_runtime(demo_kb, tiny_models)


def test_a_repair_the_check_rejects_leaves_the_first_answer(runtime, monkeypatch):
    """Without the comparator the repaired attempt always stands; with one that trusts the first answer,
    the first answer stands, the record says so and why, and the policy learns reward 0 for it; with one
    that trusts the repair, the repaired attempt stands. Every repair counts as changing the answer here
    (whether the demo's extractive answers change depends on the random-weight models)."""
    from d2r_edge import accept

    rt = runtime
    monkeypatch.setattr(accept, "changed", lambda first, repaired, fv: True)
    repaired = [q for q in demo_questions() if rt.answer(q).repaired]
    assert repaired, "no query was repaired: nothing to accept or revert"
    rt.pipeline.detector = _constant(feature_names(False), 0.3)
    try:
        rt.pipeline.comparator = Comparator(_constant(PAIR_NAMES, 0.1))      # P(repaired better) 0.1 < 0.5
        for q in repaired:
            res = rt.answer(q)
            rec, rep = res.record, res.record["repair"]
            assert rep["kept"] == "first" and rep["accept"]["p_repaired_better"] == pytest.approx(0.1)
            assert rep["accept"]["p_wrong_first"] == pytest.approx(0.3) and "threshold" in rep["accept"]["why"]
            assert res.answer == res.first_answer == rec["first_answer"] and rep["reward"] == 0.0
            assert rec["final"] == rec["first"]                                  # the first attempt stands
        rt.pipeline.comparator = Comparator(_constant(PAIR_NAMES, 0.9))      # trusts the repair: kept
        for q in repaired:
            rec = rt.answer(q).record
            assert rec["repair"]["kept"] == "repaired"
            assert rec["repair"]["accept"]["p_repaired_better"] == pytest.approx(0.9)
            assert rec["final"]["timings_s"] != rec["first"]["timings_s"]       # the second attempt stands
    finally:
        rt.pipeline.comparator = None
        rt.pipeline.detector = None


def test_an_unchanged_answer_is_not_compared_and_the_comparator_needs_the_detector(runtime):
    rt = runtime
    first = second = type("A", (), {})()
    rt.pipeline.comparator = Comparator(_constant(PAIR_NAMES, 0.1))
    try:
        with pytest.raises(ConfigError, match="--detector"):
            rt.pipeline.accept_or_revert(first, second, 0, None)
    finally:
        rt.pipeline.comparator = None
    rec = next(r for r in (rt.answer(q).record for q in demo_questions()) if r["repair"])
    assert rec["repair"]["kept"] == "repaired" and rec["repair"]["accept"] is None      # no comparator: as before


def test_pair_features_are_finite_without_log_probs_or_samples(runtime):
    rt = runtime
    p = rt.pipeline
    q = demo_questions()[0]
    first, _ = p.metered_attempt(q, p.default, metered=False)
    row = pair_features(first, first, 0, 0.4, 0.6, fact_verification=False)
    assert list(row) == list(PAIR_NAMES) and all(np.isfinite(v) for v in row.values())
    assert row["pw_delta"] == pytest.approx(0.2) and row["changed"] == 0.0 and row["lp_present"] == 0.0
