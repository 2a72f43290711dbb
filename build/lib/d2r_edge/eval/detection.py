"""Does the first-pass diagnosis see a wrong answer? AUROC / AUPRC of a failure score.

A repair policy can only fix answers the diagnosis offers it, so every
evaluation reports how well a score of "this first answer is wrong" separates
the test queries' wrong first answers from the right ones:

- `alg1_nli`: the probabilities Algorithm 1 thresholds, as one number. Alg. 1
  flags a failure when no passage bears on the query (every passage neutral
  to it), when no passage entails the response, or on a KG conflict; the
  score is 1 - min(max over passages of P(not neutral | passage, query),
  max over passages of P(entailment | passage, response)), 1 on a KG conflict.
  Its flags (`failure != no_failure`) are counted beside it.
- `calibrated`: d2r_edge.detector's P(wrong), fitted on the training queries'
  first attempts (never the test slice) and saved as OUT/detector.json;
  flagged: P(wrong) >= its threshold (chosen on the training queries).

A first answer is the generator's, before Alg. 1's UNVERIFIED gate (the gate
itself would make every flagged FEVER answer wrong): FEVER its label, QA its
text, scored as the methods score them.
"""

from __future__ import annotations

import logging

import numpy as np

from d2r_edge.detector import first_answer
from d2r_edge.errors import ConfigError
from d2r_edge.signals import FailureType, KGStatus

log = logging.getLogger(__name__)
DETECTOR_FILE = "detector.json"


def auroc(scores, wrong) -> float | None:
    """P(score of a wrong answer > score of a right one), ties counting half (Mann-Whitney U).
    None when one of the two classes is empty."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(wrong, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):           # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def auprc(scores, wrong) -> float | None:
    """Average precision of ranking wrong answers first (tied scores enter together).
    None without a wrong answer; a constant score gives the share of wrong answers."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(wrong, dtype=bool)
    n_pos = int(y.sum())
    if n_pos == 0:
        return None
    ap, tp, seen = 0.0, 0, 0
    for value in np.unique(s)[::-1]:            # thresholds from the highest score down
        at = s == value
        tp_new, seen_new = tp + int(y[at].sum()), seen + int(at.sum())
        ap += (tp_new - tp) / n_pos * (tp_new / seen_new)
        tp, seen = tp_new, seen_new
    return float(ap)


def alg1_score(diagnosis) -> float:
    """Algorithm 1's NLI probabilities as one failure score in [0, 1] (module docstring)."""
    if diagnosis.kg is KGStatus.CONFLICT:
        return 1.0
    pq = [p for p in diagnosis.passage_probs_q if p is not None]
    pr = [p for p in diagnosis.passage_probs_r if p is not None]     # (None: a pair left unscored)
    if not pq or not pr:
        return 1.0
    bears = max(1.0 - float(p.get("neutral", 0.0)) for p in pq)
    entailed = max(float(p.get("entailment", 0.0)) for p in pr)
    return 1.0 - min(bears, entailed)


def detection_row(name: str, scores, wrong, flagged) -> dict:
    wrong, flagged = np.asarray(wrong, dtype=bool), np.asarray(flagged, dtype=bool)
    return {"score": name, "auroc": auroc(scores, wrong), "auprc": auprc(scores, wrong), "n": int(len(wrong)),
            "n_wrong": int(wrong.sum()), "flagged": int(flagged.sum()), "flagged_wrong": int((flagged & wrong).sum())}


def _first_attempts(ctx, queries) -> tuple[list, np.ndarray]:
    firsts = [ctx.first(q) for q in queries]
    fv = ctx.settings.task.fact_verification
    wrong = np.array([ctx.score(q, first_answer(fv, a))[0] < 1.0 for q, a in zip(queries, firsts)], dtype=bool)
    return firsts, wrong


def fit_detector(ctx):
    """The calibrated detector fitted on the training queries' first attempts, or None (logged) when
    they cannot support a fit (too few, or all right / all wrong)."""
    from d2r_edge.detector import Detector, feature_matrix, feature_names

    fv = ctx.settings.task.fact_verification
    firsts, wrong = _first_attempts(ctx, ctx.train)
    try:
        det = Detector.fit(feature_matrix(firsts, fv), wrong, feature_names(fv), ctx.settings.task.value)
    except ConfigError as exc:
        log.warning("no calibrated detector: %s", exc)
        return None
    det.save(ctx.settings.out / DETECTOR_FILE)
    return det


def train_cross_validation(ctx, folds: int = 5) -> dict | None:
    """Detection measured on the training queries only (never the test slice): Alg. 1's score and the
    detector's out-of-fold P(wrong) (refitted on the other folds, queries in a seeded order). What a
    choice between the gates may read; None when the training queries are too few to split."""
    from d2r_edge.detector import Detector, feature_matrix, feature_names

    fv = ctx.settings.task.fact_verification
    firsts, wrong = _first_attempts(ctx, ctx.train)
    if len(firsts) < 5 * folds or wrong.all() or not wrong.any():
        return None
    x = feature_matrix(firsts, fv)
    fold = np.random.default_rng(0).permutation(len(firsts)) % folds
    out = np.full(len(firsts), np.nan)
    for k in range(folds):
        held = fold == k
        try:
            det = Detector.fit(x[~held], wrong[~held], feature_names(fv), ctx.settings.task.value)
        except ConfigError:
            return None
        out[held] = det.p_wrong_many(x[held])
    alg1 = [alg1_score(a.diagnosis) for a in firsts]
    return {"n": int(len(wrong)), "n_wrong": int(wrong.sum()), "folds": folds,
            "alg1_nli_auroc": auroc(alg1, wrong), "alg1_nli_auprc": auprc(alg1, wrong),
            "calibrated_auroc": auroc(out, wrong), "calibrated_auprc": auprc(out, wrong)}


def detection(ctx) -> list[dict]:
    """One row per failure score over the test queries' first attempts (the detector is the one
    open_context fitted on the training queries)."""
    from d2r_edge.detector import feature_matrix

    firsts, wrong = _first_attempts(ctx, ctx.test)
    flagged = [a.diagnosis.failure is not FailureType.NO_FAILURE for a in firsts]
    rows = [detection_row("alg1_nli", [alg1_score(a.diagnosis) for a in firsts], wrong, flagged)]
    det = ctx.pipeline.detector
    if det is not None:
        p = det.p_wrong_many(feature_matrix(firsts, ctx.settings.task.fact_verification))
        rows.append({**detection_row("calibrated", p, wrong, [x >= det.threshold for x in p]),
                     "threshold": det.threshold, "fit": det.fit_stats})
    return rows
