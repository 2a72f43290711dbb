"""Which method to make the default, chosen on the training queries only (issue 51).

Table 1's test slice may say which method won there, but a default chosen on it would
be tuned on the test. Here each method is re-chosen on k-1 folds of the training
queries (best_fixed's arm, the accept/revert comparator, the policies' training) and
scored on the held-out fold, so every training query is scored once by a method that
never saw it. Everything reads the outcomes the evaluation already stored (every
allowed arm of each gated training query), so nothing is generated.

The gate and the detector's P(wrong) are the evaluation's: each training query gets its
out-of-fold P(wrong) (Detector.out_of_fold), held out or not (`Context.cv`,
`Pipeline.out_of_fold_always`), so the same queries are repaired as when the methods
trained. One leak remains and is stated: the detector that gave a query its
out-of-fold P(wrong) was fitted on folds that may hold the method's held-out queries.

Per method: accuracy (FEVER) or EM (QA) over the training queries, the paired delta
against naive with its bootstrap interval, wrong->right and right->wrong. The default
rule: among the policy kinds (what `train` / `run` do without flags), one replaces the
task's current default (app.DEFAULT_POLICY_KIND) when its delta beats the default's, or
equals it with fewer right answers broken; the best of all methods is named beside it.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from d2r_edge.eval.context import Context, Method
from d2r_edge.eval.metrics import flips, paired_bootstrap

log = logging.getLogger(__name__)

CV_DIR = "train-cv"
# the method each policy kind of `d2r-edge train` / `run` is evaluated as
POLICY_METHOD = {"linucb": Method.LINUCB, "thompson": Method.THOMPSON, "fixed": Method.BEST_FIXED}


def current_default(fact_verification: bool) -> Method:
    """What `d2r-edge run` repairs with today for this task (app.DEFAULT_POLICY_KIND)."""
    from d2r_edge.app import DEFAULT_POLICY_KIND
    from d2r_edge.tasks import Task

    return POLICY_METHOD[DEFAULT_POLICY_KIND[Task.FEVER if fact_verification else Task.QA]]


def fold_of(n: int, folds: int, seed: int) -> np.ndarray:
    """Each of n queries' fold (0..folds-1), a seeded shuffle dealt round-robin: sizes differ by at most one."""
    fold = np.empty(n, dtype=int)
    fold[np.random.default_rng(seed).permutation(n)] = np.arange(n) % folds
    return fold


def methods_cv(ctx: Context, methods: tuple[Method, ...], folds: int = 5) -> dict | None:
    """Each method's training-CV figures and the default they choose; None when the training queries are too
    few (fewer than two per fold). Records go to OUT/train-cv/fold<k>/ (a rerun resumes them)."""
    from d2r_edge.eval.methods import run_method

    methods = tuple(m for m in methods if m is not Method.ORACLE)       # post hoc: never a default
    if Method.NAIVE not in methods:
        methods = (Method.NAIVE, *methods)
    train = list(ctx.train)
    if len(train) < 2 * folds:
        log.warning("methods' training CV: %d training queries for %d folds; not computed", len(train), folds)
        return None
    fold = fold_of(len(train), folds, ctx.settings.run.seed)
    records: dict[str, list[dict]] = {m.value: [] for m in methods}
    for k in range(folds):
        out = ctx.settings.out / CV_DIR / f"fold{k}"
        out.mkdir(parents=True, exist_ok=True)
        sub = replace(ctx, settings=replace(ctx.settings, out=out), cv=True, comparator=None, phases={},
                      train=[q for q, f in zip(train, fold) if f != k],
                      test=[q for q, f in zip(train, fold) if f == k])
        for m in methods:
            records[m.value] += run_method(sub, m)
    return summarize(records, ctx.settings.task.fact_verification, folds, ctx.settings.bootstrap_resamples,
                     ctx.settings.run.seed)


def summarize(records: dict[str, list[dict]], fact_verification: bool, folds: int, resamples: int,
              seed: int) -> dict:
    """The per-method figures over the queries every method scored, and the default they choose."""
    ids = set.intersection(*({r["id"] for r in recs} for recs in records.values()))
    by = {m: sorted((r for r in recs if r["id"] in ids), key=lambda r: r["id"]) for m, recs in records.items()}
    naive = [r["final_correct"] for r in by[Method.NAIVE.value]]
    key = "accuracy" if fact_verification else "em"
    rows = {}
    for m, recs in by.items():
        final = [r["final_correct"] for r in recs]
        ci = paired_bootstrap(naive, final, n_resamples=resamples, seed=seed)
        w2r, r2w = flips([r["first_correct"] for r in recs], final)
        rows[m] = {key: float(np.mean(final)), "delta_vs_naive": ci.mean, "ci95": [ci.lo, ci.hi],
                   "wrong_to_right": w2r, "right_to_wrong": r2w,
                   "repaired": sum(bool(r["repaired"]) for r in recs)}
    current = current_default(fact_verification).value

    def rank(m: str) -> tuple:
        # the larger delta; at an equal delta, fewer right answers broken (never --methods' order)
        return rows[m]["delta_vs_naive"], -rows[m]["right_to_wrong"]

    def first(names) -> str | None:
        return max(names, key=lambda m: (rank(m), m == current, m), default=None)

    # the default is a policy kind (what `train` / `run` do without flags); the best of all methods may need a
    # flag and a file (*_accept: a comparator; best_fixed_labeled: gold labels for `train`)
    best_any = first(m for m in rows if m != Method.NAIVE.value)
    best = first(m for m in rows if m in {k.value for k in POLICY_METHOD.values()})
    if current in rows and best is not None and rank(best) <= rank(current):
        best = current
    return {"folds": folds, "n": len(ids), "metric": key, "methods": rows, "current_default": current,
            "default_by_training_cv": best, "best_method": best_any,
            "rule": f"each method re-chosen on {folds - 1} of {folds} folds of the training queries and scored on "
                    "the held-out fold; the default (a policy kind: "
                    + ", ".join(k.value for k in POLICY_METHOD.values())
                    + ") becomes the one with the largest delta vs naive (at an equal delta, the fewest "
                      "right->wrong) if it beats the current default's by that order",
            "leak": "a query's out-of-fold P(wrong) comes from a detector fitted on folds that may hold that "
                    "method's held-out queries"}
