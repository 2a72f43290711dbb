"""LinUCB (Eq. 1, 3) with Sherman–Morrison updates, numba-jitted.

Per arm we keep `A` (for the periodic exact re-inversion), `A_inv` (rank-one
updated), `b`, and `theta = A_inv b` (refreshed at update time), stacked in
contiguous (n_arms, d, d) / (n_arms, d) float64 arrays. `select` is then one
quadratic form per allowed arm, a streaming read of A_inv: memory-bound at
large d. (Reading only the upper triangle of the symmetric A_inv halves the
bytes but breaks numba's vectorization of the inner loop: measured 3-5x
slower, so rows are read whole.)

`select` reads a float32 mirror of A_inv instead (half the bytes) and does the
quadratic forms' inner sums in float32 too (the context scaled by a power of
two into [-1, 1]: no overflow, no rounding from the scaling), with a rigorous
bound on what the float32 storage and arithmetic can change in each quadratic
form. Arms the bounds cannot separate from the best are recomputed from the
float64 A_inv, so the choice is always the one the float64 computation makes.
`scores` stays float64. d = 147, 11 arms, this VM: 63 -> 36 us p50
(benchmarks/bench_policy.py).
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import numpy as np
from numba import njit

from d2r_edge.config import LinUCBConfig
from d2r_edge.errors import PolicyError
from d2r_edge.policy.state import (
    check_allowed,
    check_arm,
    check_reward,
    check_x,
    context_arrays,
    context_from,
    load_npz,
    save_npz,
    stored_array,
    stored_names,
    stored_scalar,
)

log = logging.getLogger(__name__)

KIND = "linucb"


_F32_EPS = 2.0 ** -24      # unit roundoff of float32 (relative error of one rounding)
_F64_EPS = 2.0 ** -53
_F32_UNDERFLOW = 2.0 ** -150   # absolute error of one float32 rounding into the subnormal range


@njit(cache=True, fastmath=True, nogil=True)
def _quad64(a_inv, a, x):  # pragma: no cover - jitted
    """x^T A_inv[a] x in float64, rows read whole (vectorizes)."""
    d = x.shape[0]
    quad = 0.0
    for i in range(d):
        acc = 0.0
        for j in range(d):
            acc += a_inv[a, i, j] * x[j]
        quad += acc * x[i]
    return quad


@njit(cache=True, fastmath=True, nogil=True)
def _mean(theta, a, x):  # pragma: no cover - jitted
    t = theta[a]
    out = 0.0
    for i in range(x.shape[0]):
        out += t[i] * x[i]
    return out


@njit(cache=True, fastmath=True, nogil=True)
def _ucb_scores(a_inv, theta, x, alpha, allowed, out):  # pragma: no cover - jitted
    for a in range(theta.shape[0]):
        if not allowed[a]:
            out[a] = -np.inf
            continue
        out[a] = _mean(theta, a, x) + alpha * math.sqrt(max(_quad64(a_inv, a, x), 0.0))


# reassociation lets the reductions vectorize; no nnan/ninf: this code compares against -inf
@njit(cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, nogil=True)
def _ucb_select(a_inv, a_inv32, theta, x, alpha, allowed, lo, hi, x32):  # pragma: no cover - jitted
    """The argmax `_ucb_scores` gives (lowest index on ties), reading mostly the float32 mirror.

    Error bound of the float32 path, per arm, relative to mag = sum_ij |A_ij x_i x_j|: every
    inner sum has d float32 products and d - 1 additions in any order (gamma_d), the row's
    product by x_i one more rounding, x's and A's float32 storage one each per factor (3), the
    outer float64 sum and the float64 path's own sums 4 (d + 2) float64 roundings. Roundings
    into the subnormal range add an absolute 2^-150 each (at most 4 per term and one per row,
    with |A_ij| <= 1 as A = I + sum x x^T and |x| <= 1 after scaling). The computed mag is
    itself within gamma_(d+2) of the true one: the 1.01 covers it and gamma's denominators.
    """
    n, d = theta.shape
    big = 0.0
    for j in range(d):
        big = max(big, abs(x[j]))
    _, exp = math.frexp(big)                 # big < 2^exp: x / 2^exp is in (-1, 1), exactly
    inv_scale = math.ldexp(1.0, -exp)
    scale2 = math.ldexp(1.0, 2 * exp)
    for j in range(d):
        x32[j] = x[j] * inv_scale
    slack = (d + 8) * _F32_EPS * 1.01 + 4.0 * (d + 2) * _F64_EPS
    floor = (4.0 * d * d + d) * _F32_UNDERFLOW * 1.01 * scale2
    best_lo = -np.inf
    for a in range(n):
        lo[a] = -np.inf
        hi[a] = -np.inf
        if not allowed[a]:
            continue
        quad = 0.0
        mag = 0.0
        for i in range(d):
            acc = np.float32(0.0)
            acc_abs = np.float32(0.0)
            for j in range(d):
                v = a_inv32[a, i, j] * x32[j]
                acc += v
                acc_abs += abs(v)
            quad += acc * x32[i]
            mag += acc_abs * abs(x32[i])
        quad *= scale2
        err = mag * scale2 * slack + floor
        mean = _mean(theta, a, x)
        if not (math.isfinite(quad) and math.isfinite(err)):
            hi[a] = np.inf                  # no bound: always a candidate, decided in float64
            continue
        lo[a] = mean + alpha * math.sqrt(max(quad - err, 0.0))
        hi[a] = mean + alpha * math.sqrt(max(quad + err, 0.0))
        lo[a] -= 1e-12 * abs(lo[a])
        hi[a] += 1e-12 * abs(hi[a])
        if lo[a] > best_lo:
            best_lo = lo[a]
    winner, n_cand = -1, 0
    for a in range(n):
        if allowed[a] and hi[a] >= best_lo:
            n_cand += 1
            if winner < 0:
                winner = a
    if n_cand <= 1:
        return max(winner, 0)
    # the bounds overlap: decide between the candidates in float64, with _ucb_scores' own arithmetic
    best, best_score = -1, -np.inf
    for a in range(n):
        if allowed[a] and hi[a] >= best_lo:
            score = _mean(theta, a, x) + alpha * math.sqrt(max(_quad64(a_inv, a, x), 0.0))
            if best < 0 or score > best_score:
                best, best_score = a, score
    return best


@njit(cache=True, fastmath=True, nogil=True)
def _sherman_morrison(a_mat, a_inv, a_inv32, b, theta, x, reward, u):  # pragma: no cover - jitted
    d = x.shape[0]
    # u = A_inv x ; A_inv symmetric
    for i in range(d):
        acc = 0.0
        row = a_inv[i]
        for j in range(d):
            acc += row[j] * x[j]
        u[i] = acc
    denom = 1.0
    for i in range(d):
        denom += x[i] * u[i]
    inv = 1.0 / denom
    for i in range(d):
        ui = u[i] * inv
        xi = x[i]
        ra = a_inv[i]
        rm = a_mat[i]
        r32 = a_inv32[i]
        for j in range(d):
            ra[j] -= ui * u[j]
            r32[j] = ra[j]
            rm[j] += xi * x[j]
        b[i] += reward * xi
    for i in range(d):
        acc = 0.0
        row = a_inv[i]
        for j in range(d):
            acc += row[j] * b[j]
        theta[i] = acc


def exact_inverse(a_mat: np.ndarray) -> np.ndarray:
    """Inverse of an SPD matrix through its Cholesky factor, symmetrized."""
    chol = np.linalg.cholesky(a_mat)
    l_inv = np.linalg.solve(chol, np.eye(a_mat.shape[0]))
    inv = l_inv.T @ l_inv
    return 0.5 * (inv + inv.T)


# What `reinvert_every` (default 1000) guarantees: between two exact re-inversions the rank-one
# updates keep ||A_inv - inv(A)||_F / ||inv(A)||_F under this. Measured at d = 147 over 100k updates of
# one arm with mixed-scale contexts (cond(A) ~ 1e7): worst 1.7e-14 just before a re-inversion, 9e-14
# after 200k updates with none (tests/test_policy.py; docs/results.md, issue 25).
DRIFT_BOUND = 1e-10


class LinUCB:
    """Disjoint LinUCB over `n_arms` arms and `dim`-dimensional contexts."""

    def __init__(self, n_arms: int, dim: int, alpha: float = 2.0, *,
                 reinvert_every: int = 1000, arm_names: list[str] | None = None) -> None:
        if not isinstance(n_arms, int) or n_arms < 1:
            raise PolicyError(f"n_arms must be an int >= 1, got {n_arms!r}")
        if not isinstance(dim, int) or dim < 1:
            raise PolicyError(f"dim must be an int >= 1, got {dim!r}")
        self.config = LinUCBConfig(alpha=alpha, reinvert_every=reinvert_every)
        self.n_arms, self.dim = n_arms, dim
        self.arm_names = list(arm_names) if arm_names else [str(i) for i in range(n_arms)]
        if len(self.arm_names) != n_arms:
            raise PolicyError(f"{len(self.arm_names)} arm names for {n_arms} arms")
        eye = np.eye(dim)
        self.A = np.ascontiguousarray(np.broadcast_to(eye, (n_arms, dim, dim)).copy())
        self.A_inv = self.A.copy()
        self._a_inv32 = self.A_inv.astype(np.float32)     # select's mirror, kept in step
        self.b = np.zeros((n_arms, dim))
        self.theta = np.zeros((n_arms, dim))
        self.counts = np.zeros(n_arms, dtype=np.int64)
        self._since_reinvert = np.zeros(n_arms, dtype=np.int64)
        self.context: dict | None = None     # ContextBuilder.spec of the contexts it learns from
        self._local = threading.local()

    @property
    def alpha(self) -> float:
        return self.config.alpha

    def scores(self, x: np.ndarray, allowed=None) -> np.ndarray:
        """UCB of every arm (Eq. 1); -inf where not allowed."""
        x = check_x(x, self.dim)
        mask = check_allowed(allowed, self.n_arms)
        out = np.empty(self.n_arms)
        _ucb_scores(self.A_inv, self.theta, x, float(self.alpha), mask, out)
        return out

    def select(self, x: np.ndarray, allowed=None, key: str | None = None) -> int:
        """argmax of the UCB over allowed arms; ties go to the lowest index (`key` is unused:
        the choice is a function of `x` alone)."""
        x = check_x(x, self.dim)
        mask = check_allowed(allowed, self.n_arms)
        lo, hi, x32 = self._scratch()
        return int(_ucb_select(self.A_inv, self._a_inv32, self.theta, x, float(self.alpha), mask, lo, hi, x32))

    def _scratch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """select's scratch, one set per thread: the kernel releases the GIL, so a shared set raced."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = (np.empty(self.n_arms), np.empty(self.n_arms),
                                       np.empty(self.dim, dtype=np.float32))
        return bufs

    def update(self, arm: int, x: np.ndarray, reward: float) -> None:
        """Eq. 3 for the played arm only, by a rank-one Sherman–Morrison update."""
        arm = check_arm(arm, self.n_arms)
        x = check_x(x, self.dim)
        reward = check_reward(reward)
        _sherman_morrison(self.A[arm], self.A_inv[arm], self._a_inv32[arm], self.b[arm], self.theta[arm], x,
                          reward, np.empty(self.dim))
        self.counts[arm] += 1
        self._since_reinvert[arm] += 1
        every = self.config.reinvert_every
        if every and self._since_reinvert[arm] >= every:
            self.reinvert(arm)

    def reinvert(self, arm: int) -> None:
        """Exact A_inv (Cholesky) for one arm; resets the accumulated rounding."""
        self.A_inv[arm] = exact_inverse(self.A[arm])
        self._a_inv32[arm] = self.A_inv[arm]
        self.theta[arm] = self.A_inv[arm] @ self.b[arm]
        self._since_reinvert[arm] = 0

    # --- persistence (npz, no pickle, atomic) --------------------------------
    def save(self, path: Path | str) -> None:
        save_npz(path, KIND, {
            "n_arms": np.int64(self.n_arms), "dim": np.int64(self.dim),
            "alpha": np.float64(self.alpha), "reinvert_every": np.int64(self.config.reinvert_every),
            "arm_names": np.array(self.arm_names, dtype=str), "A": self.A, "A_inv": self.A_inv,
            "b": self.b, "theta": self.theta, "counts": self.counts,
            "since_reinvert": self._since_reinvert, **context_arrays(self.context),
        })

    @classmethod
    def load(cls, path: Path | str, *, dim: int | None = None,
             arm_names: list[str] | None = None) -> "LinUCB":
        """Load a saved policy; `dim` / `arm_names`, when given, must match the file."""
        z = load_npz(path, KIND, expect_dim=dim, expect_arms=arm_names)
        # every entry checked before anything is allocated from it (a damaged dim must not ask for TiBs)
        n, d = stored_scalar(z, path, "n_arms", int, 1, 10_000), stored_scalar(z, path, "dim", int, 1, 100_000)
        names = stored_names(z, path, n)
        arrays = {"A": stored_array(z, path, "A", (n, d, d)), "A_inv": stored_array(z, path, "A_inv", (n, d, d)),
                  "b": stored_array(z, path, "b", (n, d)), "theta": stored_array(z, path, "theta", (n, d)),
                  "counts": stored_array(z, path, "counts", (n,), counts=True),
                  "since_reinvert": stored_array(z, path, "since_reinvert", (n,), counts=True)}
        with np.errstate(all="ignore"):
            residual = np.abs(arrays["A"] @ arrays["A_inv"] - np.eye(d)).max(initial=0.0)
        if not residual <= 1e-3 or np.abs(arrays["A_inv"]).max(initial=0.0) > 1e30:
            from d2r_edge.errors import PolicyFileError

            raise PolicyFileError(f"{path}: A_inv is not the inverse of A (max |A A_inv - I| = {residual:.3g}); the "
                                  f"file is damaged: restore it or retrain")
        pol = cls(n, d, stored_scalar(z, path, "alpha", float, 0.0),
                  reinvert_every=stored_scalar(z, path, "reinvert_every", int, 0), arm_names=names)
        pol.A[:] = arrays["A"]
        pol.A_inv[:] = arrays["A_inv"]
        pol._a_inv32[:] = pol.A_inv
        pol.b[:] = arrays["b"]
        pol.theta[:] = arrays["theta"]
        pol.counts[:] = arrays["counts"]
        pol._since_reinvert[:] = arrays["since_reinvert"]
        pol.context = context_from(z)
        return pol
