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
  normalized answer occurs in a passage and the best passage's share of the
  answer's tokens;
- the KG check: conflict / consistent;
- the generator's own confidence: mean and min log-probability of the answer's
  tokens, where the server returns them (OpenAI-compatible `logprobs`). A
  generator that gives none (the extractive one, a server without logprobs, a
  cached answer from before) has them *missing*: `gen_logprobs_present` is 0
  and the two values are NaN in the signals, replaced at scoring time by the
  training mean of the present ones (0 if none was present), never invented
  per answer.

Fitted by `d2r-edge eval answers` and `d2r-edge train --gate calibrated` on
training queries (label: the first answer was wrong), saved as JSON with its
feature list, version and fit statistics; loading refuses a file whose features
are not the ones this code computes for the task.

The gate (`Gate`): `paper` repairs what Algorithm 1 flags; `calibrated` repairs
when P(wrong) >= the detector's threshold (chosen on the training queries) and
adds P(wrong) to the policy's context. Either way the failure *type*, and so the
arms allowed, is Algorithm 1's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np

from d2r_edge.answers import FEVER_CLASSES, normalize_answer
from d2r_edge.errors import ConfigError
from d2r_edge.signals import KGStatus

FORMAT = "d2r-edge-detector/2"
_COMMON = ("q_ent_max", "q_con_max", "q_neu_min", "q_ent_mean", "q_con_mean", "q_margin_top", "q_bearing_share",
           "r_ent_max", "r_con_max", "r_neu_min", "r_ent_mean", "r_con_mean", "r_margin_top", "r_entailing_share",
           "ret_top1", "ret_gap", "n_passages", "answer_len_log", "kg_conflict", "kg_consistent",
           "gen_logprobs_present", "gen_logprob_mean", "gen_logprob_min")
REFIT = "refit it (d2r-edge train --gate calibrated, or d2r-edge eval answers)"
# NaN when the generator gave no log-probabilities (imputed at scoring time, see the module docstring)
MAY_BE_MISSING = ("gen_logprob_mean", "gen_logprob_min")


class Gate(str, Enum):
    """Which first answers get a repair: Algorithm 1's flags, or the calibrated P(wrong) >= threshold."""

    PAPER = "paper"
    CALIBRATED = "calibrated"


def _label_feature(label: str) -> str:
    return f"label_{label.lower().replace(' ', '_')}"


def feature_names(fact_verification: bool) -> tuple[str, ...]:
    extra = tuple(map(_label_feature, FEVER_CLASSES)) if fact_verification \
        else ("qa_answer_in_passage", "qa_answer_token_recall")
    return _COMMON + extra


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
    out["gen_logprob_mean"] = float(np.mean(lp)) if lp else math.nan
    out["gen_logprob_min"] = float(np.min(lp)) if lp else math.nan
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
    return out


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

    def _filled(self, x: np.ndarray) -> np.ndarray:
        x = np.array(x, dtype=np.float64)
        gaps = np.isnan(x)
        if gaps.any():
            fill = self.impute if self.impute is not None else np.zeros(x.shape[-1])
            x[gaps] = np.broadcast_to(fill, x.shape)[gaps]
        return x

    def p_wrong_many(self, x: np.ndarray) -> np.ndarray:
        return _sigmoid(((self._filled(x) - self.mean) / self.scale) @ self.weights + self.bias)

    def assess(self, attempt, fact_verification: bool) -> tuple[float, dict[str, float]]:
        """P(wrong) of one attempt and the signals behind it (missing ones NaN)."""
        signals = features(attempt, fact_verification)
        row = np.array([[signals[n] for n in self.names]], dtype=np.float64)
        return float(self.p_wrong_many(row)[0]), signals

    @classmethod
    def fit(cls, x: np.ndarray, wrong: np.ndarray, names: tuple[str, ...], task: str, l2: float = 1.0,
            iterations: int = 50) -> "Detector":
        """Newton's method on the L2-penalized log-loss; the threshold maximizes balanced accuracy on the fit data."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(wrong, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != len(names) or len(y) != len(x):
            raise ConfigError(f"detector fit: {x.shape} features for {len(names)} names and {len(y)} labels")
        if len(y) < 10 or y.min() == y.max():
            raise ConfigError(f"detector fit needs right and wrong answers among >= 10 training queries "
                              f"(got {len(y)}, {int(y.sum())} wrong); give more --train queries")
        present = ~np.isnan(x)
        impute = np.array([float(x[present[:, j], j].mean()) if present[:, j].any() else 0.0
                           for j in range(x.shape[1])])
        x = np.where(present, x, impute)
        mean = x.mean(axis=0)
        scale = x.std(axis=0)
        scale[scale < 1e-9] = 1.0
        z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
        w = np.zeros(z.shape[1])
        reg = np.full(z.shape[1], l2)
        reg[-1] = 0.0                                 # the bias is not penalized
        for _ in range(iterations):
            p = _sigmoid(z @ w)
            grad = z.T @ (p - y) + reg * w
            hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(reg) + 1e-9 * np.eye(len(w))
            step = np.linalg.solve(hess, grad)
            w -= step
            if np.max(np.abs(step)) < 1e-8:
                break
        p = _sigmoid(z @ w)
        cands = np.unique(np.round(p, 6))
        bal = [(np.mean(p[y == 1] >= t) + np.mean(p[y == 0] < t)) / 2 for t in cands]
        t = float(cands[int(np.argmax(bal))])
        loss = float(-np.mean(y * np.log(np.clip(p, 1e-12, 1)) + (1 - y) * np.log(np.clip(1 - p, 1e-12, 1))))
        stats = {"n": int(len(y)), "n_wrong": int(y.sum()), "l2": l2, "log_loss": loss,
                 "balanced_accuracy_at_threshold": float(max(bal)),
                 "threshold_rule": "max balanced accuracy on fit data"}
        stats["missing_share"] = {n: float(1 - present[:, j].mean()) for j, n in enumerate(names)
                                  if n in MAY_BE_MISSING}
        return cls(tuple(names), task, mean, scale, w[:-1], float(w[-1]), t, stats, impute)

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
    def load(cls, path: Path, fact_verification: bool) -> "Detector":
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the detector {path}: {exc}; {REFIT}") from exc
        want = feature_names(fact_verification)
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


def first_answer(fact_verification: bool, attempt) -> str:
    """The generator's answer before the UNVERIFIED gate."""
    if fact_verification:
        label = attempt.generation.label
        return label.value if label is not None else "NOT ENOUGH INFO"
    return attempt.generation.response
