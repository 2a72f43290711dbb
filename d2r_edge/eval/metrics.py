"""Answer metrics: FEVER 3-way accuracy and macro-F1, SQuAD EM/F1, paired bootstrap intervals."""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass

import numpy as np

FEVER_CLASSES = ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD's normalization: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, answers) -> float:
    """1.0 when the normalized prediction equals any normalized gold answer."""
    p = normalize_answer(prediction or "")
    return float(any(p == normalize_answer(a) for a in answers))


def contains_answer(prediction: str, answers) -> float:
    """1.0 when a normalized gold answer occurs, on token boundaries, in the normalized prediction.

    For generators that answer with a sentence (the extractive one): EM is 0 by construction there.
    """
    p = f" {normalize_answer(prediction or '')} "
    return float(any(g and f" {g} " in p for g in map(normalize_answer, answers)))


def _f1(prediction: str, answer: str) -> float:
    p, g = normalize_answer(prediction).split(), normalize_answer(answer).split()
    # HotpotQA's official script: yes/no/noanswer only match exactly
    if (p and p[0] in ("yes", "no", "noanswer") or g and g[0] in ("yes", "no", "noanswer")) and p != g:
        return 0.0
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, answers) -> float:
    """SQuAD token F1 against the best-matching gold answer."""
    return max((_f1(prediction or "", a) for a in answers), default=0.0)


def fever_label(value: str | None) -> str:
    """Gold or predicted label on FEVER's 3 classes; UNVERIFIED (and nothing) count as NOT ENOUGH INFO."""
    norm = str(value or "").strip().upper().replace("_", " ")
    if norm in ("SUPPORTS", "REFUTES"):
        return norm
    return "NOT ENOUGH INFO"


def macro_f1(gold: list[str], pred: list[str], classes=FEVER_CLASSES) -> float:
    scores = []
    for c in classes:
        tp = sum(g == c and p == c for g, p in zip(gold, pred))
        fp = sum(g != c and p == c for g, p in zip(gold, pred))
        fn = sum(g == c and p != c for g, p in zip(gold, pred))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores))


@dataclass(frozen=True)
class Interval:
    mean: float
    lo: float
    hi: float

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0


def paired_bootstrap(a, b, n_resamples: int = 10_000, seed: int = 0, level: float = 0.95) -> Interval:
    """Mean of b - a over paired per-query scores, with a percentile bootstrap interval.

    Queries are resampled with replacement, the same indices for both methods, so the
    interval reflects the per-query differences rather than two independent spreads.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or not len(a):
        raise ValueError(f"paired_bootstrap needs two equal-length non-empty 1-D arrays, got {a.shape} {b.shape}")
    diff = b - a
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples)
    for start in range(0, n_resamples, 1000):   # bounded memory for large query sets
        stop = min(n_resamples, start + 1000)
        idx = rng.integers(0, len(diff), size=(stop - start, len(diff)))
        means[start:stop] = diff[idx].mean(axis=1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return Interval(float(diff.mean()), float(lo), float(hi))


def flips(first, final) -> tuple[int, int]:
    """(wrong -> right, right -> wrong) counts between per-query correctness vectors."""
    first, final = np.asarray(first, dtype=bool), np.asarray(final, dtype=bool)
    return int(np.sum(~first & final)), int(np.sum(first & ~final))


def percentiles(values, qs=(50, 95)) -> list[float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return [None for _ in qs]
    return [float(v) for v in np.percentile(values, qs)]
