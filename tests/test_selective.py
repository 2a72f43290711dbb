"""The trust certificate's arithmetic and its guarantee on a score distribution whose risk is known."""

import json
import math

import numpy as np
import pytest

from d2r_edge.errors import ConfigError
from d2r_edge.selective import (
    Certificate,
    InsufficientCalibration,
    applied,
    aurc,
    binom_cdf,
    certify,
    min_trusted,
    resplit_check,
    risk_coverage,
)


def _world(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Scores uniform on [0, 1], P(wrong | score) = score: the error among score <= t is t / 2."""
    rng = np.random.default_rng(seed)
    s = rng.uniform(size=n)
    return s, rng.uniform(size=n) < s


def test_binomial_tail_matches_the_closed_form():
    for k, n, p in [(0, 10, 0.3), (2, 10, 0.3), (7, 45, 0.25), (30, 200, 0.2)]:
        exact = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))
        assert binom_cdf(k, n, p) == pytest.approx(exact, rel=1e-10)
    assert binom_cdf(-1, 5, 0.5) == 0.0 and binom_cdf(5, 5, 0.5) == 1.0


def test_fewest_trusted_answers_is_where_an_all_right_set_first_rejects():
    m = min_trusted(0.25, 0.1)          # 9 starts: level 0.1 / 9
    assert 0.75 ** m <= 0.1 / 9 < 0.75 ** (m - 1)


def test_the_certified_threshold_holds_its_error_on_the_population():
    """Over many calibration draws the chosen threshold's true risk (t / 2) exceeds epsilon in at most
    delta of them; and it is not vacuous: with 2,000 queries the threshold is within 0.15 of the true 0.5."""
    eps, delta, too_risky, thresholds = 0.25, 0.1, 0, []
    for seed in range(300):
        s, y = _world(400, seed)
        try:
            t = certify(s, y, eps, delta).threshold
        except InsufficientCalibration:
            continue
        thresholds.append(t)
        too_risky += t / 2 > eps
    assert len(thresholds) > 250 and too_risky / 300 <= delta
    big = certify(*_world(2000, 7), eps, delta)
    assert 0.35 <= big.threshold <= 0.5 and big.coverage_calibration == pytest.approx(big.threshold, abs=0.05)


def test_a_score_that_says_nothing_certifies_nothing_and_says_how_many_queries_would_not_help():
    rng = np.random.default_rng(0)
    with pytest.raises(InsufficientCalibration, match="no number of queries would"):
        certify(rng.uniform(size=400), rng.uniform(size=400) < 0.6, 0.25)


def test_too_few_queries_are_refused_with_the_number_needed():
    s, y = _world(10, 0)
    with pytest.raises(InsufficientCalibration, match=f">= {min_trusted(0.05, 0.1)} trusted"):
        certify(s, y, 0.05)
    s, y = _world(60, 1)
    with pytest.raises(InsufficientCalibration, match=r"about \d+ labeled queries would"):
        certify(s, y, 0.2)
    with pytest.raises(ConfigError):
        certify(s, y, 1.5)


def test_risk_coverage_and_aurc_take_ties_together():
    s = np.array([0.1, 0.1, 0.5, 0.9])
    wrong = np.array([False, True, False, True])
    cov, risk = risk_coverage(s, wrong)
    assert cov.tolist() == [0.5, 0.75, 1.0] and risk.tolist() == [0.5, pytest.approx(1 / 3), 0.5]
    assert aurc(s, wrong) == pytest.approx((0.5 * 2 + 1 / 3 + 0.5) / 4)
    # a perfect ranking has the lowest area, a constant score the error rate itself
    assert aurc([0, 0.1, 0.2, 0.3], [False, False, True, True]) == pytest.approx((0 + 0 + 1 / 3 + 0.5) / 4)
    assert aurc([0, 0, 1, 1], [False, False, True, True]) == pytest.approx((0 + 0 + 0.5 + 0.5) / 4)
    assert aurc([0.3] * 4, wrong) == 0.5


def test_applied_counts_trusted_answers_on_new_queries():
    cert = certify(*_world(2000, 3), 0.25)
    s, y = _world(1000, 4)
    got = applied(cert, s, y)
    assert got["trusted"] == int((s <= cert.threshold).sum()) and got["error"] == pytest.approx(
        y[s <= cert.threshold].mean())


def test_resplits_violate_at_most_delta_and_report_coverage():
    s, y = _world(600, 5)
    rows = {r["epsilon"]: r for r in resplit_check(s, y, splits=200)}
    assert all(r["violation_rate"] <= 0.1 for r in rows.values())
    assert rows[0.4]["coverage_mean"] > 0.5 and rows[0.05]["refused_share"] == 1.0


def test_certificate_round_trip_and_binding_to_its_detector(tmp_path):
    det, other = tmp_path / "detector.json", tmp_path / "other.json"
    det.write_text("{}")
    other.write_text("{ }")
    from d2r_edge.selective import file_sha256

    cert = certify(*_world(1000, 2), 0.3, detector_sha256=file_sha256(det))
    cert.save(tmp_path / "trust.json")
    assert Certificate.load(tmp_path / "trust.json", det) == cert
    with pytest.raises(ConfigError, match="another detector"):
        Certificate.load(tmp_path / "trust.json", other)
    raw = json.loads((tmp_path / "trust.json").read_text())
    raw["epsilon"] = 2
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="outside"):
        Certificate.load(tmp_path / "bad.json")
