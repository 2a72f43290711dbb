"""Which signal carries the failure detection, against which label, at what cost per query?

For the test queries' first answers (the generator's, before the UNVERIFIED gate), a
detector (d2r_edge.detector: logistic, penalty and threshold chosen out of fold) is
fitted on the training queries' first answers with the features of

- the groups the fit chooses itself ("selected", what `--gate calibrated` uses: backward
  elimination on the training queries' out-of-fold log-loss, Detector.fit),
- every signal group ("all"),
- one group alone ("only nli_query", ...),
- every group but one ("without log_probs", ...),

(groups: d2r_edge.detector.feature_groups) and scored on the test queries with a 95%
bootstrap interval, beside its own stratified cross-validation on the training queries
(several fold seeds): the figure a choice may read. Alg. 1's score is the first row.

Labels: FEVER, the generator's label is wrong; QA, the answer is not an exact match
(`em_wrong`, which counts near-misses as wrong) and its token F1 is below 0.5
(`f1_below_half`). Each label gets its own fits.

Cost per query (seconds, from the first attempts' recorded stage times): the NLI pairs
behind the NLI and grounding groups (`diagnose_s`, which for QA also clusters the
samples), the samples behind self-consistency (`samples_s`), the self-check's request
(`p_true_s`), the reader (`reader_s`, its share of `diagnose_s`), the answer itself (`generate_s`
without those; its log-probabilities come with it), retrieval. Beside it, what each signal asks of
the generator per query (`signal_generator_load`): requests, and tokens generated - the self-check
exactly one (max_tokens 1), the answer its own tokens (the log-probabilities' count, without the
JSON around it), each sample counted as long as the greedy answer (an estimate: a replayed sample's
length is not stored); the NLI pairs, the reader and retrieval ask nothing of it.
"""

from __future__ import annotations

import logging

import numpy as np

from d2r_edge.errors import ConfigError
from d2r_edge.eval.detection import BOOTSTRAP, alg1_score, auprc, auroc, bootstrap, cross_validated

log = logging.getLogger(__name__)

CV_SEEDS = 3            # fold seeds per variant's training cross-validation (5 folds each)
MIN_TRAIN = 50          # fewer training queries: no ablation (a dozen fits on a few dozen rows say nothing)


def labels(ctx, queries, firsts) -> dict[str, np.ndarray]:
    """What "the first answer is wrong" means, per name (module docstring)."""
    from d2r_edge.detector import first_answer

    fv = ctx.settings.task.fact_verification
    scored = [ctx.score(q, first_answer(fv, a)) for q, a in zip(queries, firsts)]
    if fv:
        return {"label_wrong": np.array([em < 1.0 for em, _ in scored], dtype=bool)}
    return {"em_wrong": np.array([em < 1.0 for em, _ in scored], dtype=bool),
            "f1_below_half": np.array([f1 < 0.5 for _, f1 in scored], dtype=bool)}


def variants(groups: dict[str, tuple[str, ...]]) -> list[tuple[str, tuple[str, ...]]]:
    """(name, feature names): all, then each group alone, then each group left out."""
    every = tuple(n for names in groups.values() for n in names)
    return ([("all", every)] + [(f"only {g}", names) for g, names in groups.items()]
            + [(f"without {g}", tuple(n for n in every if n not in names)) for g, names in groups.items()])


def _row(name: str, n_features: int | None, scores, wrong, train_cv: dict | None,
         resamples: int = BOOTSTRAP) -> dict:
    return {"variant": name, "features": n_features, "auroc": auroc(scores, wrong), "auprc": auprc(scores, wrong),
            **bootstrap(scores, wrong, resamples=resamples),
            "train_cv_auroc": None if train_cv is None else train_cv["auroc"],
            "train_cv_auroc_sd": None if train_cv is None else train_cv["auroc_sd"]}


def ablation_rows(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                  names: tuple[str, ...], groups: dict[str, tuple[str, ...]], task: str,
                  cv_seeds: int = CV_SEEDS, resamples: int = BOOTSTRAP) -> list[dict]:
    """One row per variant (module docstring); a variant whose features are missing on every training
    query, or that cannot be fitted, is a row with `skipped` saying why."""
    from d2r_edge.detector import Detector

    rows = []
    try:      # the gate's own detector: it chooses its groups inside each fit (the CV is nested)
        det = Detector.fit(x_train, y_train, names, task, groups=groups)
        row = _row("selected", sum(1 for w in det.weights if w != 0.0), det.p_wrong_many(x_test), y_test,
                   cross_validated(x_train, y_train, names, task, seeds=cv_seeds, groups=groups), resamples)
        rows.append({**row, "groups_kept": det.fit_stats.get("groups_kept")})
    except ConfigError as exc:
        rows.append({"variant": "selected", "features": None, "skipped": str(exc)})
    for name, keep in variants(groups):
        cols = [names.index(n) for n in keep]
        xs_train, xs_test = x_train[:, cols], x_test[:, cols]
        if not keep or np.isnan(xs_train).all():
            rows.append({"variant": name, "features": len(keep), "skipped": "its signals are missing on every "
                                                                            "training query"})
            continue
        try:
            det = Detector.fit(xs_train, y_train, keep, task)
        except ConfigError as exc:
            rows.append({"variant": name, "features": len(keep), "skipped": str(exc)})
            continue
        cv = cross_validated(xs_train, y_train, keep, task, seeds=cv_seeds)
        rows.append(_row(name, len(keep), det.p_wrong_many(xs_test), y_test, cv, resamples))
    return rows


def signal_costs(firsts) -> dict[str, dict[str, float]]:
    """Median and p90 seconds per query of what each signal group needs (module docstring)."""
    def stats(values):
        v = np.asarray(values, dtype=np.float64)
        return {"median": float(np.median(v)), "p90": float(np.percentile(v, 90))} if len(v) else None

    t = [a.timings_s for a in firsts]
    sampled = [x for x in t if "samples_s" in x]
    checked = [x for x in t if "p_true_s" in x]
    read = [x for x in t if "reader_s" in x]
    return {"nli_pairs (nli_query, grounding)": stats([x.get("diagnose_s", 0.0) - x.get("reader_s", 0.0) for x in t]),
            "reader (reader)": stats([x["reader_s"] for x in read]),
            "samples (self_consistency)": stats([x["samples_s"] for x in sampled]),
            "self-check request (self_check)": stats([x["p_true_s"] for x in checked]),
            "answer with log-probs (log_probs, answer)": stats([x.get("generate_s", 0.0) - x.get("samples_s", 0.0)
                                                               - x.get("p_true_s", 0.0) for x in t]),
            "retrieval (retrieval)": stats([x.get("retrieve_s", 0.0) + x.get("embed_query_s", 0.0) for x in t])}


def signal_generator_load(firsts) -> dict[str, dict[str, float] | None]:
    """Median generator requests and generated tokens per query of each signal that asks the generator
    (module docstring); None for a signal no first attempt had."""
    answer_tokens = [len(a.generation.logprobs) for a in firsts if a.generation.logprobs]
    med = float(np.median(answer_tokens)) if answer_tokens else None
    n_samples = [len(a.generation.samples) for a in firsts if a.generation.samples]
    checked = [a for a in firsts if a.generation.p_true is not None or "p_true_s" in a.timings_s]
    return {"answer with log-probs (log_probs, answer)": {"requests": 1.0, "generated_tokens": med},
            "samples (self_consistency)": None if not n_samples else
            {"requests": float(np.median(n_samples)),
             "generated_tokens": None if med is None else float(np.median(n_samples)) * med},
            "self-check request (self_check)": {"requests": 1.0, "generated_tokens": 1.0} if checked else None}


def ablation(ctx, cv_seeds: int = CV_SEEDS) -> dict | None:
    """The tables of the module docstring over ctx's training and test queries; None without test
    queries, {"skipped": why} with fewer than MIN_TRAIN training queries."""
    from d2r_edge.detector import feature_groups, feature_matrix, feature_names

    if len(ctx.train) < MIN_TRAIN:
        return {"skipped": f"{len(ctx.train)} training queries; the signal ablation needs >= {MIN_TRAIN}"}
    fv = ctx.settings.task.fact_verification
    train_firsts = [ctx.first(q) for q in ctx.train]
    test_firsts = [ctx.first(q) for q in ctx.test]
    if not train_firsts or not test_firsts:
        return None
    names, groups = feature_names(fv), feature_groups(fv)
    x_train, x_test = feature_matrix(train_firsts, fv), feature_matrix(test_firsts, fv)
    y_train, y_test = labels(ctx, ctx.train, train_firsts), labels(ctx, ctx.test, test_firsts)
    alg1_train = [alg1_score(a.diagnosis) for a in train_firsts]
    alg1_test = [alg1_score(a.diagnosis) for a in test_firsts]
    out = {"groups": {g: list(v) for g, v in groups.items()}, "labels": {},
           "costs_s": signal_costs(train_firsts + test_firsts),
           "generator_per_query": signal_generator_load(train_firsts + test_firsts), "cv_fold_seeds": cv_seeds}
    for label in y_train:
        yt, ye = y_train[label], y_test[label]
        alg1 = _row("alg1_nli", None, alg1_test, ye, None, ctx.settings.bootstrap_resamples)
        alg1["train_auroc"] = auroc(alg1_train, yt)
        rows = [alg1, *ablation_rows(x_train, yt, x_test, ye, names, groups, ctx.settings.task.value, cv_seeds,
                                     ctx.settings.bootstrap_resamples)]
        out["labels"][label] = {"n_train": int(len(yt)), "n_train_wrong": int(yt.sum()), "n_test": int(len(ye)),
                                "n_test_wrong": int(ye.sum()), "rows": rows}
        log.info("detection ablation (%s): %d variants", label, len(rows))
    return out
