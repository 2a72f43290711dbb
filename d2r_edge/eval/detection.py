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
text, scored as the methods score them. (Table 1, Table 4 and the records score
FEVER's first answer after the gate: `first_correct` there is another label.)

Every row carries 95% bootstrap intervals (queries resampled, seeded) and, for
the calibrated detector, the paired difference to Alg. 1's score on the same
resamples. Rows are given pooled and per test file: a detector trained on one
retrieval regime (HotpotQA distractor) can fail on another (fullwiki), and a
test file with no training counterpart is named in a warning. The training
queries' cross-validation is stratified and averaged over several fold seeds.
"""

from __future__ import annotations

import logging

import numpy as np

from d2r_edge.detector import first_answer
from d2r_edge.errors import ConfigError
from d2r_edge.signals import FailureType, KGStatus

log = logging.getLogger(__name__)
DETECTOR_FILE = "detector.json"


def _scores(scores) -> np.ndarray:
    s = np.asarray(scores, dtype=np.float64)
    if np.isnan(s).any():
        raise ValueError(f"{int(np.isnan(s).sum())} of {len(s)} failure scores are NaN: a NaN cannot be ranked; "
                         f"find the attempt that produced it")
    return s


def auroc(scores, wrong) -> float | None:
    """P(score of a wrong answer > score of a right one), ties counting half (Mann-Whitney U).
    None when one of the two classes is empty; a NaN score is refused (ValueError)."""
    s, y = _scores(scores), np.asarray(wrong, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = ((ends - counts + 1 + ends) / 2)[inv]           # 1-based, averaged over ties
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def auprc(scores, wrong) -> float | None:
    """Average precision of ranking wrong answers first (tied scores enter together).
    None without a wrong answer; a constant score gives the share of wrong answers; a NaN score is
    refused (ValueError)."""
    s, y = _scores(scores), np.asarray(wrong, dtype=bool)
    n_pos = int(y.sum())
    if n_pos == 0:
        return None
    _, inv = np.unique(s, return_inverse=True)
    wrong_at = np.bincount(inv, weights=y.astype(np.float64))[::-1]     # thresholds from the highest score down
    tp, seen = np.cumsum(wrong_at), np.cumsum(np.bincount(inv)[::-1])   # (tied scores enter together)
    return float(np.sum(wrong_at / n_pos * tp / seen))


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


BOOTSTRAP = 2000        # default resamples behind a detection interval; `eval answers --bootstrap` sets them (seeded)


def bootstrap(scores, wrong, others: dict | None = None, resamples: int = BOOTSTRAP,
              seed: int = 0) -> dict:
    """95% percentile intervals of AUROC and AUPRC over query resamples; for each score in `others`
    the paired AUROC difference (scores - other) on the same resamples. A resample with one class
    only is skipped."""
    s, y = _scores(scores), np.asarray(wrong, dtype=bool)
    others = {k: _scores(v) for k, v in (others or {}).items()}
    rng = np.random.default_rng(seed)
    roc, prc, diffs = [], [], {k: [] for k in others}
    for _ in range(resamples):
        i = rng.integers(len(s), size=len(s))
        if y[i].all() or not y[i].any():
            continue
        a = auroc(s[i], y[i])
        roc.append(a)
        prc.append(auprc(s[i], y[i]))
        for k, o in others.items():
            diffs[k].append(a - auroc(o[i], y[i]))

    def ci(v):
        return [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] if v else None

    return {"auroc_ci95": ci(roc), "auprc_ci95": ci(prc),
            **{f"auroc_minus_{k}": {"mean": float(np.mean(v)) if v else None, "ci95": ci(v)}
               for k, v in diffs.items()}}


def detection_row(name: str, scores, wrong, flagged, others: dict | None = None,
                  resamples: int = BOOTSTRAP) -> dict:
    wrong, flagged = np.asarray(wrong, dtype=bool), np.asarray(flagged, dtype=bool)
    return {"score": name, "auroc": auroc(scores, wrong), "auprc": auprc(scores, wrong), "n": int(len(wrong)),
            "n_wrong": int(wrong.sum()), "flagged": int(flagged.sum()), "flagged_wrong": int((flagged & wrong).sum()),
            **bootstrap(scores, wrong, others, resamples), "bootstrap_resamples": resamples}


def _first_attempts(ctx, queries) -> tuple[list, np.ndarray]:
    firsts = [ctx.first(q) for q in queries]
    fv = ctx.settings.task.fact_verification
    wrong = np.array([ctx.score(q, first_answer(fv, a))[0] < 1.0 for q, a in zip(queries, firsts)], dtype=bool)
    return firsts, wrong


def fit_detector(ctx):
    """The calibrated detector fitted on the training queries' first attempts, or None (logged) when
    they cannot support a fit (too few, or all right / all wrong). Its `out_of_fold` P(wrong) is what
    the policies see for those queries while they train."""
    from d2r_edge.detector import Detector, feature_groups, feature_matrix, feature_names

    fv = ctx.settings.task.fact_verification
    firsts, wrong = _first_attempts(ctx, ctx.train)
    try:
        det = Detector.fit(feature_matrix(firsts, fv), wrong, feature_names(fv), ctx.settings.task.value,
                           groups=feature_groups(fv),
                           keys=[q.text for q in ctx.train])
    except ConfigError as exc:
        log.warning("no calibrated detector: %s", exc)
        return None
    det.save(ctx.settings.out / DETECTOR_FILE)
    return det


def train_cross_validation(ctx, folds: int = 5, seeds: int = 5) -> dict | None:
    """Detection measured on the training queries only (never the test slice): Alg. 1's score and the
    detector's out-of-fold P(wrong) (refitted on the other folds, each fit choosing its own penalty and
    threshold inside its folds), stratified, over `seeds` fold seeds: the mean and spread of AUROC/AUPRC.
    What a choice between the gates may read; None when the training queries are too few to split."""
    from d2r_edge.detector import feature_groups, feature_matrix, feature_names

    fv = ctx.settings.task.fact_verification
    firsts, wrong = _first_attempts(ctx, ctx.train)
    if len(firsts) < 5 * folds or min(wrong.sum(), (~wrong).sum()) < 2 * folds:
        return None
    cv = cross_validated(feature_matrix(firsts, fv), wrong, feature_names(fv), ctx.settings.task.value, folds, seeds,
                         groups=feature_groups(fv))
    if cv is None:
        return None
    alg1 = [alg1_score(a.diagnosis) for a in firsts]
    return {"n": int(len(wrong)), "n_wrong": int(wrong.sum()), "folds": folds, "fold_seeds": seeds,
            "stratified": True, "alg1_nli_auroc": auroc(alg1, wrong), "alg1_nli_auprc": auprc(alg1, wrong),
            **{f"calibrated_{k}": v for k, v in cv.items()}}


def cross_validated(x: np.ndarray, wrong: np.ndarray, names, task: str, folds: int = 5, seeds: int = 5,
                    groups: dict | None = None) -> dict | None:
    """A detector refitted on the other folds scores each held-out fold (each fit choosing its own penalty,
    signal groups when given, and threshold inside its folds), stratified, over `seeds` fold seeds: the
    mean and sd of the out-of-fold AUROC / AUPRC. None when a fold cannot be fitted."""
    from d2r_edge.detector import Detector, stratified_folds

    rocs, prcs = [], []
    for seed in range(seeds):
        fold = stratified_folds(wrong, folds, seed)
        out = np.full(len(wrong), np.nan)
        for k in range(folds):
            held = fold == k
            try:
                det = Detector.fit(x[~held], wrong[~held], names, task, groups=groups)
            except ConfigError:
                return None
            out[held] = det.p_wrong_many(x[held])
        rocs.append(auroc(out, wrong))
        prcs.append(auprc(out, wrong))
    return {"auroc": float(np.mean(rocs)), "auroc_sd": float(np.std(rocs)),
            "auprc": float(np.mean(prcs)), "auprc_sd": float(np.std(prcs))}


def _rows(ctx, queries) -> list[dict]:
    from d2r_edge.detector import feature_matrix

    firsts, wrong = _first_attempts(ctx, queries)
    flagged = [a.diagnosis.failure is not FailureType.NO_FAILURE for a in firsts]
    alg1 = [alg1_score(a.diagnosis) for a in firsts]
    n = ctx.settings.bootstrap_resamples
    rows = [detection_row("alg1_nli", alg1, wrong, flagged, resamples=n)]
    det = ctx.pipeline.detector
    if det is not None:
        p = det.p_wrong_many(feature_matrix(firsts, ctx.settings.task.fact_verification))
        rows.append({**detection_row("calibrated", p, wrong, [x >= det.threshold for x in p], {"alg1_nli": alg1},
                                     resamples=n),
                     "threshold": det.threshold, "fit": det.fit_stats})
    return rows


def detection(ctx) -> list[dict]:
    """One row per failure score over the test queries' first attempts (the detector is the one
    open_context fitted on the training queries): pooled, then per test file when there are several
    (`file` names it; `file_in_training`: whether training queries came from that file too)."""
    rows = _rows(ctx, ctx.test)
    by_file: dict[str, list] = {}
    for q in ctx.test:
        by_file.setdefault(ctx.test_files.get(q.id, "?"), []).append(q)
    trained_on = set(ctx.train_files.values())
    for name in by_file:
        if ctx.train_files and name not in trained_on:
            log.warning("detection: test file %s has no training counterpart (no training query came from it); "
                        "its detection figures measure a shift, not the detector", name)
    if len(by_file) > 1:
        for name, qs in by_file.items():
            rows += [{**r, "file": name, "file_in_training": name in trained_on} for r in _rows(ctx, qs)]
    return rows
