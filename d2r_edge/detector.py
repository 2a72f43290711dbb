"""A calibrated failure detector: P(the first answer is wrong) from signals the runtime already has.

Algorithm 1 decides "failure or not" by thresholding argmax NLI labels; this
fits the same evidence, and more, to labels: a logistic regression (numpy,
Newton steps with an L2 penalty on standardized features) over

- the NLI probabilities of every (passage, query) and (passage, response) pair:
  max / mean entailment and contradiction, min neutral, the top-passage margin
  (entailment - contradiction), the share of passages that bear on the query
  and that entail the response;
- retrieval: the top passage's score, its gap to the next, the number of passages;
- the answer: its length; FEVER: the label given (one-hot); QA: whether the
  normalized answer occurs in a passage, the retrieval rank of the first
  passage holding it, and the best passage's share of the answer's tokens;
- the KG check: conflict / consistent;
- self-consistency (d2r_edge/consistency.py), where the generator drew samples:
  the samples' agreement with the answer, the number of answer clusters and
  their entropy; missing (NaN) without samples, like the log-probabilities;
- the self-check (issue 53, `--self-check`): the same model's P(True) that its
  answer is correct, asked in one more request (Kadavath et al. 2022);
  missing (NaN) where not asked or not readable;
- QA, the independent reader (issue 53, a profile with a `reader` role): its
  span's confidence, whether it found no answer, and its exact match and token
  F1 with the generator's answer; missing (NaN) without a reader;
- the generator's own confidence: the log-probability of the answer's first
  token (where a FEVER label's decision sits), their sum and their minimum,
  where the server returns them (OpenAI-compatible `logprobs`). Not the mean:
  it is confounded by the answer's token count (NOT ENOUGH INFO is 4 tokens,
  REFUTES 2). A generator that gives none (the extractive one, a server
  without logprobs, a cached answer from before), or an answer that cannot be
  located among the completion's tokens, has them *missing*:
  `gen_logprobs_present` is 0 and the values are NaN in the signals, replaced
  at scoring time by the training mean of the present ones (0 if none was
  present), never invented per answer.

Fitted by `d2r-edge eval answers` and `d2r-edge train --gate calibrated` on
training queries (label: the first answer was wrong), saved as JSON with its
feature list, version and fit statistics; loading refuses a file whose features
are not the ones this code computes for the task. Everything chosen from the
training queries is chosen out of fold (stratified k-fold, averaged over
several fold seeds): the L2 penalty (by out-of-fold log-loss, unless given) and
the threshold (the out-of-fold P(wrong) with the best balanced accuracy). The
fit statistics hold only out-of-fold figures: an in-sample one flatters a
model fitted on ~100 queries. The out-of-fold P(wrong) of each training query
is kept in memory (`out_of_fold`, keyed by query text) so that a policy trained
on those queries sees what it will see at test time, not the over-confident
in-sample value. With fewer than SELECT_MIN_SMALLER_CLASS training queries in
the smaller class, the fit statistics say the group selection is not reliable
(`selection_reliable`) and the report says so beside the detector's figures.

The gate (`Gate`): `paper` repairs what Algorithm 1 flags; `calibrated` repairs
when P(wrong) >= the detector's threshold (chosen on the training queries) and
adds P(wrong) to the policy's context. Either way the failure *type*, and so the
arms allowed, is Algorithm 1's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np

from d2r_edge.answers import FEVER_CLASSES, exact_match, normalize_answer, token_f1
from d2r_edge.errors import ConfigError
from d2r_edge.signals import KGStatus

log = logging.getLogger(__name__)

FORMAT = "d2r-edge-detector/3"
_COMMON = ("q_ent_max", "q_con_max", "q_neu_min", "q_ent_mean", "q_con_mean", "q_margin_top", "q_bearing_share",
           "r_ent_max", "r_con_max", "r_neu_min", "r_ent_mean", "r_con_mean", "r_margin_top", "r_entailing_share",
           "ret_top1", "ret_gap", "n_passages", "answer_len_log", "kg_conflict", "kg_consistent",
           "gen_logprobs_present", "gen_logprob_first", "gen_logprob_sum", "gen_logprob_min",
           "sc_agreement", "sc_clusters", "sc_entropy", "self_check_p_true")
REFIT = "refit it (d2r-edge train --gate calibrated, or d2r-edge eval answers)"
# NaN when the generator gave no log-probabilities (imputed at scoring time, see the module docstring)
READER_FEATURES = ("reader_confidence", "reader_no_answer", "reader_em", "reader_f1")
MAY_BE_MISSING = ("gen_logprob_first", "gen_logprob_sum", "gen_logprob_min", "sc_agreement", "sc_clusters",
                  "sc_entropy", "self_check_p_true", *READER_FEATURES)
L2_GRID = (0.1, 1.0, 10.0, 100.0, 1000.0)     # candidates for the penalty, chosen by out-of-fold log-loss
# below this many training queries in the smaller class (right or wrong first answers) the group selection's
# out-of-fold log-loss differences are within fold noise: the fit says so (HotpotQA with ~23 right answers
# kept a group whose training CV AUROC was 0.47 and whose test AUROC was 0.71)
SELECT_MIN_SMALLER_CLASS = 50


class Gate(str, Enum):
    """Which first answers get a repair: Algorithm 1's flags, or the calibrated P(wrong) >= threshold."""

    PAPER = "paper"
    CALIBRATED = "calibrated"


def _label_feature(label: str) -> str:
    return f"label_{label.lower().replace(' ', '_')}"


def feature_names(fact_verification: bool) -> tuple[str, ...]:
    extra = tuple(map(_label_feature, FEVER_CLASSES)) if fact_verification \
        else ("qa_answer_in_passage", "qa_answer_token_recall", "qa_answer_first_rank", *READER_FEATURES)
    return _COMMON + extra


def feature_groups(fact_verification: bool) -> dict[str, tuple[str, ...]]:
    """The features by the signal they come from (a partition of feature_names): what the ablation
    in d2r_edge.eval.ablation takes away or keeps alone, and what each costs to compute."""
    names = feature_names(fact_verification)
    groups = {"nli_query": tuple(n for n in names if n.startswith("q_")),
              "grounding": tuple(n for n in names if n.startswith(("r_", "kg_", "qa_"))),
              "retrieval": ("ret_top1", "ret_gap", "n_passages"),
              "log_probs": tuple(n for n in names if n.startswith("gen_")),
              "self_consistency": tuple(n for n in names if n.startswith("sc_")),
              "self_check": ("self_check_p_true",),
              "reader": tuple(n for n in names if n.startswith("reader_")),
              "answer": tuple(n for n in names if n == "answer_len_log" or n.startswith("label_"))}
    return groups


def _nli_stats(probs: list[dict], prefix: str) -> dict[str, float]:
    """Per-passage NLI probabilities summarized; the share is of passages bearing on the query (q:
    not neutral) or entailing the response (r)."""
    share_name = f"{prefix}_{'bearing' if prefix == 'q' else 'entailing'}_share"
    probs = [p for p in probs if p is not None]      # (None: a pair left unscored; a detector scores all)
    if not probs:
        return {n: 0.0 for n in _COMMON if n.startswith(f"{prefix}_")}
    ent, neu, con = (np.array([float(p.get(k, 0.0)) for p in probs])
                     for k in ("entailment", "neutral", "contradiction"))
    top = int(np.argmax(np.maximum(ent, con)))
    argmax = np.argmax(np.stack([ent, neu, con]), axis=0)
    share = float(np.mean(argmax != 1)) if prefix == "q" else float(np.mean(argmax == 0))
    return {f"{prefix}_ent_max": float(ent.max()), f"{prefix}_con_max": float(con.max()),
            f"{prefix}_neu_min": float(neu.min()), f"{prefix}_ent_mean": float(ent.mean()),
            f"{prefix}_con_mean": float(con.mean()), f"{prefix}_margin_top": float(ent[top] - con[top]),
            share_name: share}


def features(attempt, fact_verification: bool) -> dict[str, float]:
    """The detector's inputs for one attempt (an Attempt: passages, generation, diagnosis)."""
    d, passages = attempt.diagnosis, attempt.passages
    out = {**_nli_stats(d.passage_probs_q, "q"), **_nli_stats(d.passage_probs_r, "r")}
    scores = sorted((float(p.score) for p in passages), reverse=True)
    out["ret_top1"] = scores[0] if scores else 0.0
    out["ret_gap"] = scores[0] - scores[1] if len(scores) > 1 else 0.0
    out["n_passages"] = float(len(passages))
    answer = attempt.generation.response or ""
    out["answer_len_log"] = math.log1p(len(answer.split()))
    out["kg_conflict"] = float(d.kg is KGStatus.CONFLICT)
    out["kg_consistent"] = float(d.kg is KGStatus.CONSISTENT)
    lp = getattr(attempt.generation, "logprobs", None)
    out["gen_logprobs_present"] = float(bool(lp))
    out["gen_logprob_first"] = float(lp[0]) if lp else math.nan
    out["gen_logprob_sum"] = float(np.sum(lp)) if lp else math.nan
    out["gen_logprob_min"] = float(np.min(lp)) if lp else math.nan
    p_true = getattr(attempt.generation, "p_true", None)
    out["self_check_p_true"] = float(p_true) if p_true is not None else math.nan
    sc = getattr(d, "consistency", None) or {}
    for name in ("sc_agreement", "sc_clusters", "sc_entropy"):
        out[name] = float(sc[name]) if name in sc else math.nan
    if fact_verification:
        label = attempt.generation.label.value if attempt.generation.label is not None else "NOT ENOUGH INFO"
        for lab in FEVER_CLASSES:
            out[_label_feature(lab)] = float(label == lab)
    else:   # grounding, under the normalization EM scores with
        needle = normalize_answer(answer)
        toks = needle.split()
        texts = [normalize_answer(f"{p.title} {p.text}") for p in passages]
        out["qa_answer_in_passage"] = float(bool(needle) and any(f" {needle} " in f" {t} " for t in texts))
        out["qa_answer_token_recall"] = max((sum(t in set(p.split()) for t in toks) / len(toks) for p in texts),
                                            default=0.0) if toks else 0.0
        # in which passage: the retrieval rank of the first one holding the answer (none: one past the last).
        # On HotpotQA's 202 training questions, among answers found in a passage, AUROC 0.68 for wrong
        # answers (a later passage, more often wrong); found-or-not alone 0.54
        out["qa_answer_first_rank"] = float(next((i for i, t in enumerate(texts) if needle and f" {needle} " in
                                                  f" {t} "), len(texts)))
        out.update(reader_signals(getattr(d, "reader", None), answer))
    return out


def reader_signals(span: dict | None, answer: str) -> dict[str, float]:
    """The reader's agreement with the generator's answer (all NaN without a reader's span)."""
    if span is None:
        return {n: math.nan for n in READER_FEATURES}
    return {"reader_confidence": float(span["confidence"]), "reader_no_answer": float(span["no_answer"]),
            "reader_em": exact_match(span["text"], [answer]), "reader_f1": token_f1(span["text"], [answer])}


def record_signals(signals: dict[str, float]) -> dict[str, float | None]:
    """Signals as a JSON record holds them: a missing one (NaN) is null."""
    return {k: (None if math.isnan(v) else v) for k, v in signals.items()}


def feature_matrix(attempts, fact_verification: bool) -> np.ndarray:
    """features() of each attempt as rows, in feature_names() order."""
    names = feature_names(fact_verification)
    rows = [features(a, fact_verification) for a in attempts]
    return np.array([[r[n] for n in names] for r in rows], dtype=np.float64).reshape(len(rows), len(names))


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -35, 35)))


class _NoConvergence(ArithmeticError):
    pass


def _standardized(x: np.ndarray, present: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x with missing values imputed by the column mean of the present ones, impute, mean, scale)."""
    impute = np.array([float(x[present[:, j], j].mean()) if present[:, j].any() else 0.0
                       for j in range(x.shape[1])])
    x = np.where(present, x, impute)
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale[scale < 1e-9] = 1.0
    return x, impute, mean, scale


def _newton(z: np.ndarray, y: np.ndarray, l2: float, iterations: int) -> tuple[np.ndarray, int]:
    """Weights (bias last, not penalized) minimizing the L2-penalized log-loss; raises _NoConvergence."""
    w = np.zeros(z.shape[1])
    reg = np.full(z.shape[1], l2)
    reg[-1] = 0.0
    for it in range(1, iterations + 1):
        p = _sigmoid(z @ w)
        grad = z.T @ (p - y) + reg * w
        hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(reg) + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        w -= step
        if not np.all(np.isfinite(w)):
            raise _NoConvergence("non-finite weights")
        if np.max(np.abs(step)) < 1e-8:
            return w, it
    raise _NoConvergence(f"no convergence in {iterations} Newton steps")


def _fit_arrays(x: np.ndarray, y: np.ndarray, l2: float, iterations: int):
    present = ~np.isnan(x)
    xf, impute, mean, scale = _standardized(x, present)
    z = np.hstack([(xf - mean) / scale, np.ones((len(xf), 1))])
    w, steps = _newton(z, y, l2, iterations)
    return mean, scale, w, impute, present, steps


def _predict(x: np.ndarray, mean, scale, w, impute) -> np.ndarray:
    x = np.where(np.isnan(x), impute, x)
    return _sigmoid(((x - mean) / scale) @ w[:-1] + w[-1])


def stratified_folds(wrong: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """A fold index per row, each class spread evenly over the folds in a seeded order."""
    fold = np.empty(len(wrong), dtype=np.int64)
    rng = np.random.default_rng(seed)
    for cls in (False, True):
        idx = np.flatnonzero(np.asarray(wrong, dtype=bool) == cls)
        fold[rng.permutation(idx)] = np.arange(len(idx)) % folds
    return fold


def out_of_fold(x: np.ndarray, wrong: np.ndarray, l2: float, folds: int, seeds: int,
                iterations: int = 50) -> np.ndarray:
    """Each row's P(wrong) from fits that did not see it, averaged over `seeds` stratified splits.
    Raises _NoConvergence when a fold's fit does not converge."""
    y = np.asarray(wrong, dtype=np.float64)
    total = np.zeros(len(y))
    for seed in range(seeds):
        fold = stratified_folds(y == 1, folds, seed)
        for k in range(folds):
            held = fold == k
            mean, scale, w, impute, _, _ = _fit_arrays(x[~held], y[~held], l2, iterations)
            total[held] += _predict(x[held], mean, scale, w, impute)
    return total / seeds


def _log_loss(p: np.ndarray, y: np.ndarray) -> float:
    return float(-np.mean(y * np.log(np.clip(p, 1e-12, 1)) + (1 - y) * np.log(np.clip(1 - p, 1e-12, 1))))


def best_balanced_threshold(p: np.ndarray, wrong: np.ndarray) -> tuple[float, float]:
    """(threshold, balanced accuracy): the value of `p` itself (no rounding: compared like with like)
    at which flagging p >= threshold best separates wrong from right."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(wrong, dtype=bool)
    cands = np.unique(p)
    bal = [(np.mean(p[y] >= t) + np.mean(p[~y] < t)) / 2 for t in cands]
    i = int(np.argmax(bal))
    return float(cands[i]), float(bal[i])


def _checked(x, wrong, names) -> tuple[np.ndarray, np.ndarray]:
    """The fit's inputs, refused when they cannot give a meaningful fit (with the reason)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(wrong, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(names) or y.ndim != 1 or len(y) != len(x):
        raise ConfigError(f"detector fit: {x.shape} features for {len(names)} names and {y.shape} labels")
    if not np.all((y == 0) | (y == 1)):
        raise ConfigError("detector fit: the labels must be 0 (right) or 1 (wrong)")
    bad = [n for j, n in enumerate(names) if np.isinf(x[:, j]).any()
           or (n not in MAY_BE_MISSING and np.isnan(x[:, j]).any())]
    if bad:
        raise ConfigError(f"detector fit: non-finite values in {', '.join(bad)} (only {', '.join(MAY_BE_MISSING)} "
                          f"may be missing); fix the attempts that produced them")
    if len(y) < 10 or y.min() == y.max():
        raise ConfigError(f"detector fit needs right and wrong answers among >= 10 training queries "
                          f"(got {len(y)}, {int(y.sum())} wrong); give more --train queries")
    if min(y.sum(), len(y) - y.sum()) < 2:
        raise ConfigError(f"detector fit needs >= 2 right and >= 2 wrong training answers to choose its threshold "
                          f"out of fold (got {int(len(y) - y.sum())} right, {int(y.sum())} wrong); give more "
                          f"--train queries")
    return x, y


@dataclass
class Detector:
    """Logistic regression on standardized features; `threshold`: P(wrong) at which the gate repairs."""

    names: tuple[str, ...]
    task: str
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    bias: float
    threshold: float
    fit_stats: dict = field(default_factory=dict)
    impute: np.ndarray | None = None      # the value a missing (NaN) feature takes; None: 0
    # training query text -> its out-of-fold P(wrong); in memory only (see the module docstring)
    out_of_fold: dict[str, float] = field(default_factory=dict, repr=False)

    def _filled(self, x: np.ndarray) -> np.ndarray:
        x = np.array(x, dtype=np.float64)
        gaps = np.isnan(x)
        if gaps.any():
            fill = self.impute if self.impute is not None else np.zeros(x.shape[-1])
            x[gaps] = np.broadcast_to(fill, x.shape)[gaps]
        return x

    def p_wrong_many(self, x: np.ndarray) -> np.ndarray:
        x = self._filled(x)
        if not np.all(np.isfinite(x)):
            cols = sorted({self.names[j] for j in np.flatnonzero(~np.isfinite(x).all(axis=0))})
            raise ValueError(f"detector: infinite feature value(s) in {', '.join(cols)}; P(wrong) is undefined")
        return _sigmoid(((x - self.mean) / self.scale) @ self.weights + self.bias)

    def p_wrong_of_signals(self, signals: dict) -> float:
        """P(wrong) from a record's `detector_signals` (null: missing); refused when one is absent."""
        absent = [n for n in self.names if n not in signals]
        if absent:
            raise ConfigError(f"a record's detector_signals lack {', '.join(absent[:3])}: it was written by another "
                              f"version; answer the queries again with this one")
        row = np.array([[np.nan if signals[n] is None else float(signals[n]) for n in self.names]])
        return float(self.p_wrong_many(row)[0])

    def assess(self, attempt, fact_verification: bool, training_query: str | None = None) -> tuple[float, dict]:
        """P(wrong) of one attempt and the signals behind it (missing ones NaN). `training_query`: the
        query's text while a policy trains; a query the detector was fitted on then gets its
        out-of-fold P(wrong)."""
        signals = features(attempt, fact_verification)
        if training_query is not None and training_query in self.out_of_fold:
            return self.out_of_fold[training_query], signals
        row = np.array([[signals[n] for n in self.names]], dtype=np.float64)
        return float(self.p_wrong_many(row)[0]), signals

    @classmethod
    def fit(cls, x: np.ndarray, wrong: np.ndarray, names: tuple[str, ...], task: str, l2: float | None = None,
            iterations: int = 50, folds: int = 5, seeds: int = 3, keys: list[str] | None = None,
            groups: dict[str, tuple[str, ...]] | None = None) -> "Detector":
        """Newton's method on the L2-penalized log-loss. `l2` None: chosen from L2_GRID by out-of-fold
        log-loss; the threshold: the out-of-fold P(wrong) with the best balanced accuracy (stratified
        `folds`-fold, averaged over `seeds` splits). `keys`: each row's query text, for `out_of_fold`.
        `groups` (feature_groups): which signals to use, chosen on the same out-of-fold log-loss by
        backward elimination: while dropping one group's features lowers it, the best such group goes
        (few strong signals beat many weak ones on a few hundred queries); a dropped feature's weight is 0."""
        x, y = _checked(x, wrong, names)
        if keys is not None and len(keys) != len(y):
            raise ConfigError(f"detector fit: {len(keys)} keys for {len(y)} rows")
        k = int(min(folds, y.sum(), len(y) - y.sum()))
        grid = L2_GRID if l2 is None else (float(l2),)

        def best(cols: list[int]) -> tuple[float, float, np.ndarray, dict] | None:
            """(out-of-fold log-loss, l2, out-of-fold P(wrong), every l2's loss) of these columns."""
            tried: dict[float, tuple[float, np.ndarray]] = {}
            for value in grid:
                try:
                    oof = out_of_fold(x[:, cols], y, value, k, seeds, iterations)
                except _NoConvergence:
                    continue
                tried[value] = (_log_loss(oof, y), oof)
            if not tried:
                return None
            chosen = min(tried, key=lambda v: (tried[v][0], -v))       # ties: the stronger penalty
            return tried[chosen][0], chosen, tried[chosen][1], {str(v): round(tried[v][0], 6) for v in tried}

        kept = [g for g, members in (groups or {}).items() if members]
        # a group missing on every training query (no samples drawn, no log-probs given) says nothing:
        # it is never kept, whatever the elimination below would decide about a constant column
        absent = [g for g in kept if np.isnan(x[:, [names.index(n) for n in groups[g]]]).all()]
        kept = [g for g in kept if g not in absent]
        if groups and not kept:
            raise ConfigError("detector fit: every signal group is missing on every training query")
        cols_of = {g: [names.index(n) for n in groups[g]] for g in kept}
        cols = sorted(c for g in kept for c in cols_of[g]) if groups else list(range(len(names)))
        current = best(cols)
        if current is None:
            raise ConfigError(f"detector fit: Newton's method did not converge in {iterations} steps with l2 "
                              f"{', '.join(map(str, grid))}; give a larger l2 or more training queries")
        dropped = []
        while groups and len(kept) > 1:
            options = {}
            for g in kept:
                rest = sorted(c for h in kept if h != g for c in cols_of[h])
                result = best(rest)
                if result is not None:
                    options[g] = (result, rest)
            if not options:
                break
            g = min(options, key=lambda h: options[h][0][0])
            if not options[g][0][0] < current[0] - 1e-9:
                break
            current, cols = options[g]
            kept.remove(g)
            dropped.append(g)
        loss_oof, chosen, oof, losses = current
        try:
            mean_k, scale_k, w_k, impute_k, present, steps = _fit_arrays(x[:, cols], y, chosen, iterations)
        except _NoConvergence as exc:
            raise ConfigError(f"detector fit: {exc} (l2 {chosen}); give a larger l2 or more training "
                              f"queries") from None
        mean, scale, impute = np.zeros(len(names)), np.ones(len(names)), np.zeros(len(names))
        weights = np.zeros(len(names))
        mean[cols], scale[cols], impute[cols], weights[cols] = mean_k, scale_k, impute_k, w_k[:-1]
        t, bal = best_balanced_threshold(oof, y)
        stats = {"n": int(len(y)), "n_wrong": int(y.sum()), "l2": chosen,
                 "l2_rule": "given" if l2 is not None else f"min out-of-fold log-loss over {list(L2_GRID)}",
                 "l2_out_of_fold_log_loss": losses,
                 "newton_steps": steps, "folds": k, "fold_seeds": seeds,
                 "out_of_fold_log_loss": loss_oof, "out_of_fold_balanced_accuracy_at_threshold": bal,
                 "threshold_rule": "max balanced accuracy of the out-of-fold P(wrong)"}
        if groups:
            smaller = int(min(y.sum(), len(y) - y.sum()))
            stats.update(groups_kept=kept, groups_dropped=dropped, groups_missing=absent,
                         group_rule="groups missing on every training query left out; then backward elimination "
                                    "on the out-of-fold log-loss",
                         selection_smaller_class=smaller,
                         selection_reliable=smaller >= SELECT_MIN_SMALLER_CLASS)
            if smaller < SELECT_MIN_SMALLER_CLASS:
                log.warning("detector fit: the smaller class has %d training queries (< %d): which signal groups "
                            "it kept is close to noise; more labeled training queries make the choice",
                            smaller, SELECT_MIN_SMALLER_CLASS)
        if keys is not None:        # which queries it was fitted on: calibrate refuses their in-sample P(wrong)
            stats["training_queries_sha256_16"] = sorted(query_hash(k) for k in set(keys))
        present_share = {names[c]: float(present[:, j].mean()) for j, c in enumerate(cols)}
        stats["missing_share"] = {n: 1.0 - present_share[n] for n in names if n in MAY_BE_MISSING
                                  and n in present_share}
        return cls(tuple(names), task, mean, scale, weights, float(w_k[-1]), t, stats, impute,
                   dict(zip(keys, map(float, oof))) if keys is not None else {})

    def to_json(self) -> dict:
        return {"format": FORMAT, "task": self.task, "features": list(self.names), "mean": self.mean.tolist(),
                "scale": self.scale.tolist(), "weights": self.weights.tolist(), "bias": self.bias,
                "threshold": self.threshold, "fit": self.fit_stats,
                "impute": None if self.impute is None else self.impute.tolist()}

    def save(self, path: Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, fact_verification: bool, names: tuple[str, ...] | None = None) -> "Detector":
        """`names`: the features of another model of this form (the accept/revert comparator's)."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the detector {path}: {exc}; {REFIT}") from exc
        want = names or feature_names(fact_verification)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ConfigError(f"{path} is not a {FORMAT} file; {REFIT}")
        if tuple(raw.get("features") or ()) != want:
            raise ConfigError(f"{path} was fitted on other features ({len(raw.get('features') or [])} named, "
                              f"this version computes {len(want)} for this task); {REFIT}")
        try:
            arrays = {k: np.asarray(raw[k] if k != "impute" else (raw.get(k) or [0.0] * len(want)), dtype=np.float64)
                      for k in ("mean", "scale", "weights", "impute")}
            float(raw["bias"]), float(raw["threshold"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path} lacks a field or holds a non-number ({exc}); {REFIT}") from None
        if any(a.shape != (len(want),) or not np.all(np.isfinite(a)) for a in arrays.values()) or \
                not all(math.isfinite(float(raw[k])) for k in ("bias", "threshold")):
            raise ConfigError(f"{path} holds weights of the wrong shape or non-finite values; {REFIT}")
        return cls(want, str(raw.get("task")), arrays["mean"], arrays["scale"], arrays["weights"],
                   float(raw["bias"]), float(raw["threshold"]), dict(raw.get("fit") or {}), arrays["impute"])


def query_hash(text: str) -> str:
    """16 hex digits of sha256 of the query text: the detector file names its training queries by these."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def first_answer(fact_verification: bool, attempt) -> str:
    """The generator's answer before the UNVERIFIED gate."""
    if fact_verification:
        label = attempt.generation.label
        return label.value if label is not None else "NOT ENOUGH INFO"
    return attempt.generation.response
