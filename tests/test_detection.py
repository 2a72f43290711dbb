"""Failure-detection metrics: AUROC / AUPRC on constructed cases, Alg. 1's score."""

from __future__ import annotations

import numpy as np
import pytest

from d2r_edge.diagnose import Diagnosis
from d2r_edge.eval.detection import alg1_score, auprc, auroc, detection_row
from d2r_edge.signals import Entailment, FailureType, KGStatus


def test_separable_scores_give_auroc_one_and_reversed_zero():
    wrong = [True, True, False, False, False]
    assert auroc([0.9, 0.8, 0.1, 0.2, 0.3], wrong) == 1.0
    assert auroc([0.1, 0.2, 0.9, 0.8, 0.7], wrong) == 0.0
    assert auprc([0.9, 0.8, 0.1, 0.2, 0.3], wrong) == 1.0


def test_a_constant_score_is_chance():
    wrong = [True, False, False, True, False, False]
    assert auroc([0.5] * 6, wrong) == 0.5
    assert auprc([0.5] * 6, wrong) == pytest.approx(2 / 6)


def test_auroc_matches_the_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 200).astype(float)        # many ties
    y = rng.random(200) < 0.3 + 0.1 * s
    pos, neg = s[y], s[~y]
    brute = (np.sum(pos[:, None] > neg[None, :]) + 0.5 * np.sum(pos[:, None] == neg[None, :])) / (len(pos) * len(neg))
    assert auroc(s, y) == pytest.approx(brute)


def test_auprc_matches_average_precision_without_ties():
    rng = np.random.default_rng(1)
    s, y = rng.random(100), rng.random(100) < 0.4
    order = np.argsort(-s)
    hits = y[order]
    precision_at_hits = np.cumsum(hits)[hits] / (np.flatnonzero(hits) + 1)
    assert auprc(s, y) == pytest.approx(precision_at_hits.mean())


def test_one_class_only_has_no_auroc():
    assert auroc([0.1, 0.2], [False, False]) is None
    assert auprc([0.1, 0.2], [False, False]) is None
    row = detection_row("x", [0.1, 0.9], [False, False], [False, True])
    assert row == {"score": "x", "auroc": None, "auprc": None, "n": 2, "n_wrong": 0, "flagged": 1,
                   "flagged_wrong": 0, "auroc_ci95": None, "auprc_ci95": None, "bootstrap_resamples": 2000}


def _diag(pq, pr, kg=KGStatus.NO_TRIPLETS):
    as_d = lambda rows: [dict(zip(("entailment", "neutral", "contradiction"), r)) for r in rows]  # noqa: E731
    return Diagnosis(FailureType.NO_FAILURE, Entailment.ENTAILMENT, Entailment.ENTAILMENT, kg, None, None,
                     as_d(pq), as_d(pr))


def test_alg1_score_follows_the_probabilities_alg1_thresholds():
    grounded = _diag([(0.9, 0.05, 0.05), (0.1, 0.8, 0.1)], [(0.95, 0.03, 0.02), (0.2, 0.7, 0.1)])
    unrelated = _diag([(0.05, 0.9, 0.05)], [(0.9, 0.05, 0.05)])        # nothing bears on the query
    unsupported = _diag([(0.9, 0.05, 0.05)], [(0.1, 0.3, 0.6)])        # the response is not entailed
    assert alg1_score(grounded) == pytest.approx(0.05)
    assert alg1_score(unrelated) == pytest.approx(0.9)
    assert alg1_score(unsupported) == pytest.approx(0.9)
    assert alg1_score(_diag([(0.9, 0.05, 0.05)], [(0.9, 0.05, 0.05)], KGStatus.CONFLICT)) == 1.0
    assert alg1_score(_diag([], [])) == 1.0
