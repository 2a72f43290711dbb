"""Answers with a stated error rate: a threshold on P(wrong) certified by Learn-then-Test (issue 52).

A user who shows only the answers marked *trusted* asks how often those are
wrong. `certify` chooses a threshold λ on a failure score (trusted: score <= λ)
from labeled calibration queries so that, with probability at least 1 - δ over
the calibration draw, the error rate among trusted answers on new exchangeable
queries is at most ε (Angelopoulos et al. 2021, "Learn then Test"):

- the candidate thresholds are a fixed grid (GRID: 0.01 .. 1.00, chosen before
  any data);
- for each λ, the null "the error among answers with score <= λ exceeds ε" is
  tested with the exact binomial tail: given n_λ trusted calibration answers,
  their errors are Binomial(n_λ, R(λ)), so p_λ = P(Binomial(n_λ, ε) <= k_λ) is a
  valid p-value (k_λ: the wrong ones among them);
- the family-wise error is held at δ by fixed-sequence testing with several
  starts (LTT §4): from each start in STARTS (0.1 .. 0.9, fixed in advance) the
  grid is walked upward, rejecting while p_λ <= δ / |STARTS| and stopping at the
  first λ that is not rejected; every rejected λ is certified at once (a union
  bound over the starts, fixed-sequence within each), and the largest one (the
  most coverage) is chosen. Bonferroni over the whole grid would test each λ at
  δ / 100: several starts keep most of fixed-sequence testing's power without
  having to guess where the detector's scores lie.

Nothing is certified when no λ is rejected: `certify` then raises with how
many labeled queries it would take (`InsufficientCalibration`). The guarantee
holds for answers scored like the calibration ones (first answers, scored by the
same detector); `d2r-edge eval answers` checks it over random re-splits.

AURC (area under the risk-coverage curve) ranks scores without a threshold:
answers are accepted from the lowest score up, and the error among the accepted
is averaged over every coverage level (tied scores enter together).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from d2r_edge.errors import ConfigError

FORMAT = "d2r-edge-trust/1"
GRID = tuple(round(i / 100, 2) for i in range(1, 101))    # 0.01 .. 1.00, fixed before any data
STARTS = tuple(round(i / 10, 1) for i in range(1, 10))      # where fixed-sequence walks begin
EPSILONS = (0.05, 0.10, 0.20, 0.25, 0.30, 0.40)           # the error rates eval answers certifies
DELTA = 0.10
METHOD = ("Learn-then-Test: exact binomial p-values, fixed-sequence testing upward from 9 starts "
          "(0.1 .. 0.9, Bonferroni over the starts) on a grid of 100 thresholds")
RECALIBRATE = "calibrate again (d2r-edge calibrate)"


class InsufficientCalibration(ConfigError):
    """The labeled queries cannot certify the asked error rate (the message says how many would)."""


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), summed exactly in log space."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    i = np.arange(1, k + 1, dtype=np.float64)
    # log pmf(i) = log pmf(i - 1) + log((n - i + 1) / i) + log(p / (1 - p)), from log pmf(0) = n log(1 - p)
    logs = n * math.log1p(-p) + np.concatenate([[0.0], np.cumsum(np.log((n - i + 1) / i) + math.log(p / (1 - p)))])
    top = float(logs.max())
    return min(1.0, math.exp(top) * float(np.exp(logs - top).sum()))


def p_value(errors: int, n: int, epsilon: float) -> float:
    """The p-value of "error rate > epsilon" after `errors` wrong among `n` trusted answers (1 for n=0)."""
    return 1.0 if n == 0 else binom_cdf(errors, n, epsilon)


def min_trusted(epsilon: float, delta: float, starts: int = len(STARTS)) -> int:
    """The fewest trusted calibration answers (all of them right) that can certify `epsilon` at `delta`."""
    return math.ceil(math.log(delta / starts) / math.log1p(-epsilon))


def _needed(rate: float, coverage: float, epsilon: float, level: float) -> int | None:
    """Labeled queries needed to certify, if trusted answers kept this error rate and coverage."""
    if rate >= epsilon or coverage <= 0:
        return None
    n = 1
    while n < 10_000_000:
        if binom_cdf(math.floor(rate * n), n, epsilon) <= level:
            return math.ceil(n / coverage)
        n = max(n + 1, int(n * 1.05))
    return None


@dataclass(frozen=True)
class Certificate:
    """A threshold on a failure score with its guarantee: trusted iff score <= threshold."""

    score: str                   # what was thresholded: "calibrated" (the detector's P(wrong)), "alg1_nli"
    epsilon: float
    delta: float
    threshold: float
    n_calibration: int
    n_trusted: int               # calibration answers at or under the threshold
    errors_trusted: int
    coverage_calibration: float
    p_value: float
    method: str = METHOD
    detector_sha256: str | None = None      # the detector whose P(wrong) was calibrated

    def trusted(self, score: float) -> bool:
        return bool(score <= self.threshold)

    def to_record(self) -> dict:
        return {"epsilon": self.epsilon, "delta": self.delta, "threshold": self.threshold}

    def save(self, path: Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, **asdict(self)}, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, detector_path: Path | None = None) -> "Certificate":
        """Read a certificate; with `detector_path`, refuse one calibrated on another detector."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the trust certificate {path}: {exc}; {RECALIBRATE}") from exc
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ConfigError(f"{path} is not a {FORMAT} file; {RECALIBRATE}")
        raw.pop("format")
        try:
            cert = cls(**raw)
            values = (cert.epsilon, cert.delta, cert.threshold, cert.coverage_calibration)
            ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in values) and \
                0 < cert.epsilon < 1 and 0 < cert.delta < 1
        except TypeError as exc:
            raise ConfigError(f"{path} lacks a field or holds an unknown one ({exc}); {RECALIBRATE}") from None
        if not ok:
            raise ConfigError(f"{path} holds an epsilon/delta outside (0, 1) or a non-number; {RECALIBRATE}")
        if detector_path is not None and cert.detector_sha256 not in (None, file_sha256(detector_path)):
            raise ConfigError(f"{path} was calibrated on another detector than {detector_path} (sha256 "
                              f"{str(cert.detector_sha256)[:12]}...); {RECALIBRATE} with this detector")
        return cert


def labeled_scores(records, p_wrong_of, training_hashes=frozenset(), query_hash=None) -> tuple[list, list, dict]:
    """(scores, wrong, counts) of run records that can calibrate: an answer judged against gold
    (`first_correct` true/false), its detector signals recorded, no error. `p_wrong_of(signals)`:
    the detector's P(wrong) of those signals (the detector being calibrated, whatever the run used).
    Records of queries the detector was fitted on (`training_hashes`, by `query_hash(text)`) are left
    out: their P(wrong) is in-sample."""
    scores, wrong = [], []
    counts = {"records": 0, "no_gold": 0, "no_signals": 0, "errors": 0, "detector_training_queries": 0}
    for rec in records:
        counts["records"] += 1
        if rec.get("error"):
            counts["errors"] += 1
        elif rec.get("first_correct") not in (True, False):
            counts["no_gold"] += 1
        elif not isinstance(rec.get("detector_signals"), dict):
            counts["no_signals"] += 1
        elif query_hash is not None and query_hash(str(rec.get("query", ""))) in training_hashes:
            counts["detector_training_queries"] += 1
        else:
            scores.append(p_wrong_of(rec["detector_signals"]))
            wrong.append(rec["first_correct"] is False)
    return scores, wrong, counts


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _checked(scores, wrong) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(wrong, dtype=bool)
    if s.ndim != 1 or s.shape != y.shape:
        raise ConfigError(f"calibration: {s.shape} scores for {y.shape} labels")
    if not np.all(np.isfinite(s)):
        raise ConfigError(f"calibration: {int((~np.isfinite(s)).sum())} scores are not finite; find the "
                          f"queries that produced them")
    return s, y


def _walk(s: np.ndarray, y: np.ndarray, epsilon: float, level: float, grid: np.ndarray,
          starts: tuple[float, ...]):
    """(the largest grid index rejected by any start's fixed-sequence walk or None, the memoized test:
    grid index -> (trusted n, wrong k, p-value))."""
    order = np.argsort(s, kind="stable")
    s_sorted, cum_wrong = s[order], np.concatenate([[0], np.cumsum(y[order])])
    tested: dict[int, tuple[int, int, float]] = {}

    def test(j: int) -> tuple[int, int, float]:
        if j not in tested:
            n = int(np.searchsorted(s_sorted, grid[j], side="right"))
            k = int(cum_wrong[n])
            tested[j] = (n, k, p_value(k, n, epsilon))
        return tested[j]

    best = None
    for start in starts:
        j = int(np.searchsorted(grid, start - 1e-9))
        if best is not None and j <= best:
            continue            # an earlier walk already passed this start: it would retrace the same steps
        while j < len(grid) and test(j)[2] <= level:
            best = j if best is None or j > best else best
            j += 1
    return best, test


def certify(scores, wrong, epsilon: float, delta: float = DELTA, score: str = "calibrated",
            grid: tuple[float, ...] = GRID, starts: tuple[float, ...] = STARTS,
            detector_sha256: str | None = None) -> Certificate:
    """The threshold that certifies error <= `epsilon` among trusted answers at 1 - `delta`
    (module docstring); raises InsufficientCalibration when no threshold can be certified."""
    if not 0 < epsilon < 1 or not 0 < delta < 1:
        raise ConfigError(f"epsilon and delta must lie in (0, 1), got {epsilon!r} / {delta!r}")
    s, y = _checked(scores, wrong)
    level = delta / len(starts)
    need0 = min_trusted(epsilon, delta, len(starts))
    if len(s) < need0:
        raise InsufficientCalibration(
            f"{len(s)} labeled queries cannot certify an error of {epsilon:g} at delta {delta:g}: even if every "
            f"trusted answer were right, it takes >= {need0} trusted ones; give more labeled queries")
    best, test = _walk(s, y, epsilon, level, np.asarray(grid, dtype=np.float64), starts)
    if best is None:
        # the grid's rates and coverages: how many queries would certify the most promising one
        rows = [test(j) for j in range(len(grid))]
        cands = [(n, k) for n, k, _ in rows if n > 0 and k / n < epsilon]
        need = [v for v in (_needed(k / n, n / len(s), epsilon, level) for n, k in cands) if v is not None]
        lowest = min((k / n for n, k, _ in rows if n >= min(need0, len(s))), default=None)
        if need:
            how = f"about {min(need)} labeled queries would, if the trusted answers kept the error rate seen here"
        elif lowest is not None:
            how = (f"no number of queries would: the most trusted answers here are wrong at a rate of "
                   f"{lowest:.2f} >= {epsilon:g}")
        else:
            how = "no threshold of the grid trusts enough of them"
        raise InsufficientCalibration(
            f"{len(s)} labeled queries ({int(y.sum())} wrong) certify no threshold at error {epsilon:g}, delta "
            f"{delta:g}: {how}; give more labeled queries, a larger --target-error, or a better detector")
    n, k, p = test(best)
    return Certificate(score, float(epsilon), float(delta), float(grid[best]), int(len(s)), n, k,
                       n / len(s), float(p), detector_sha256=detector_sha256)


def applied(cert: Certificate, scores, wrong) -> dict:
    """What a certificate does on labeled queries it was not calibrated on: coverage, error among trusted."""
    return _at(cert.threshold, *_checked(scores, wrong))


def _at(threshold: float, s: np.ndarray, y: np.ndarray) -> dict:
    keep = s <= threshold
    n = int(keep.sum())
    return {"n": int(len(s)), "trusted": n, "coverage": n / len(s) if len(s) else 0.0,
            "errors": int(y[keep].sum()), "error": float(y[keep].mean()) if n else None}


def risk_coverage(scores, wrong) -> tuple[np.ndarray, np.ndarray]:
    """(coverage, error among accepted) accepting from the lowest score up; tied scores enter together."""
    s, y = _checked(scores, wrong)
    if not len(s):
        return np.zeros(0), np.zeros(0)
    vals, inv = np.unique(s, return_inverse=True)
    n_at = np.bincount(inv, minlength=len(vals))
    wrong_at = np.bincount(inv, weights=y.astype(np.float64), minlength=len(vals))
    seen, errs = np.cumsum(n_at), np.cumsum(wrong_at)
    return seen / len(s), errs / seen


def aurc(scores, wrong) -> float | None:
    """Area under the risk-coverage curve: the error among accepted, averaged over every answer
    accepted in turn (a tie group's answers all take the group's error). None without queries."""
    s, y = _checked(scores, wrong)
    if not len(s):
        return None
    vals, inv = np.unique(s, return_inverse=True)
    n_at = np.bincount(inv, minlength=len(vals))
    errs = np.cumsum(np.bincount(inv, weights=y.astype(np.float64), minlength=len(vals))) / np.cumsum(n_at)
    return float(np.sum(errs * n_at) / len(s))


def resplit_check(scores, wrong, epsilons=EPSILONS, delta: float = DELTA, splits: int = 200, seed: int = 0,
                  score: str = "calibrated") -> list[dict]:
    """The guarantee itself: over `splits` random halvings of labeled queries (calibrate on one half,
    apply on the other), per epsilon, the share of splits whose realized error among trusted test
    answers exceeds epsilon (must be <= delta), how often nothing could be certified, and the coverage."""
    s, y = _checked(scores, wrong)
    grid = np.asarray(GRID, dtype=np.float64)
    rng = np.random.default_rng(seed)
    out = {e: {"violations": 0, "refused": 0, "coverage": [], "error": []} for e in epsilons}
    for _ in range(splits):
        perm = rng.permutation(len(s))
        cal, test = perm[: len(s) // 2], perm[len(s) // 2:]
        for e in epsilons:
            best, _ = _walk(s[cal], y[cal], e, delta / len(STARTS), grid, STARTS) \
                if len(cal) >= min_trusted(e, delta) else (None, None)
            if best is None:        # what certify would refuse
                out[e]["refused"] += 1
                out[e]["coverage"].append(0.0)
                continue
            got = _at(float(grid[best]), s[test], y[test])
            out[e]["coverage"].append(got["coverage"])
            if got["error"] is not None:
                out[e]["error"].append(got["error"])
                out[e]["violations"] += got["error"] > e
    return [{"score": score, "epsilon": e, "delta": delta, "splits": splits, "n": int(len(s)),
             "violation_rate": v["violations"] / splits, "refused_share": v["refused"] / splits,
             "coverage_mean": float(np.mean(v["coverage"])), "coverage_sd": float(np.std(v["coverage"])),
             "error_mean": float(np.mean(v["error"])) if v["error"] else None}
            for e, v in out.items()]
