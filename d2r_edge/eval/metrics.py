"""Answer metrics: FEVER 3-way accuracy and macro-F1, SQuAD EM/F1 (from d2r_edge.answers), paired
bootstrap intervals."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from d2r_edge.answers import FEVER_CLASSES, contains_answer, exact_match, fever_label, normalize_answer, token_f1

__all__ = ["FEVER_CLASSES", "contains_answer", "exact_match", "fever_label", "normalize_answer", "token_f1",
           "macro_f1", "paired_bootstrap", "flips", "percentiles", "Interval"]


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
