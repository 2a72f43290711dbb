"""LinUCB (Eq. 1, 3), numba-jitted, in two exact forms per arm.

An arm's design matrix is A = I + sum_t x_t x_t^T (lambda = 1). Its UCB needs x^T A^-1 x per
select, and how that is stored decides what select reads:

- **Low-rank form**, while the arm has seen t <= (d + 1) / 4 updates. With X the t x d matrix of
  its contexts, A^-1 = I - W^T W where W = R^-1 X and R R^T = I + X X^T (Cholesky). So
  x^T A^-1 x = |x|^2 - |W x|^2: t * d multiply-adds instead of d^2. W grows by one row per
  update in O(t d) (the Cholesky factor's new row: r = W x, rho^2 = 1 + x^T A^-1 x >= 1,
  w_new = (x - W^T r) / rho), so nothing is inverted. It is evaluated in float64.
- **Dense form** from then on: A^-1 in packed symmetric storage (upper triangle, row by row),
  rank-one Sherman–Morrison updates and an exact Cholesky re-inversion every `reinvert_every`
  updates (and once at the switch). select reads a float32 mirror of it (a quarter of the
  bytes of a full float64 matrix) with a rigorous bound on what the float32 storage and
  arithmetic can change in each quadratic form; arms the bounds cannot separate from the best
  are decided in float64, so the choice is always the one float64 arithmetic makes.

`scores` and `select` run the same kernel (`_ucb`), so `select(x) == argmax(scores(x))` holds
exactly, ties to the lowest index. The switch point is where the two forms read the same bytes
(t d float64 against d (d + 1) / 2 float32). State per arm: packed A and A^-1 in float64, the
float32 mirror and W's (d + 1) / 4 rows: ~1.5x the float64 floor of one d x d matrix
(benchmarks/bench_policy.py reports the bytes).
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
DENSE = -1                 # `rank` of an arm kept in the dense form


def switch_rank(dim: int) -> int:
    """The most rows W holds: the next update moves the arm to the dense form. There t * d float64
    reads (low-rank) reach d (d + 1) / 2 float32 reads (the dense mirror)."""
    return max(1, (dim + 1) // 4)


# --- kernels ------------------------------------------------------------------------------------
# reassociation lets the reductions vectorize; no nnan/ninf: this code compares against -inf and
# checks finiteness

_FM = {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, fastmath=_FM, nogil=True)
def _lowrank_quad(w, a, t, x):  # pragma: no cover - jitted
    """|x|^2 - |W x|^2 over the arm's first t rows of W, in float64."""
    d = x.shape[0]
    quad = 0.0
    for j in range(d):
        quad += x[j] * x[j]
    for k in range(t):
        acc = 0.0
        for j in range(d):
            acc += w[a, k, j] * x[j]
        quad -= acc * acc
    return quad


@njit(cache=True, fastmath=_FM, nogil=True)
def _packed_quad(p, a, x):  # pragma: no cover - jitted
    """x^T P x for a symmetric P stored as its packed upper triangle, in float64."""
    d = x.shape[0]
    quad = 0.0
    off = 0
    for i in range(d):
        n = d - i
        row = p[a, off:off + n]          # a row as its own view: the loop vectorizes (index sums did not)
        xs = x[i:]
        acc = 0.0
        for j in range(1, n):
            acc += row[j] * xs[j]
        quad += (2.0 * acc + row[0] * x[i]) * x[i]
        off += n
    return quad


@njit(cache=True, fastmath=_FM, nogil=True)
def _dot(v, a, x):  # pragma: no cover - jitted
    out = 0.0
    for i in range(x.shape[0]):
        out += v[a, i] * x[i]
    return out


@njit(cache=True, fastmath=_FM, nogil=True)
def _ucb(p64, p32, w, rank, theta, x, alpha, allowed, exact, buf, x32):  # pragma: no cover - jitted
    """The arm with the highest UCB among `allowed` (lowest index on ties); -1 if x holds a NaN/inf.

    exact=True: every allowed arm's float64 UCB goes to buf[2] (what `scores` returns). Otherwise
    dense arms are first bounded from the float32 mirror (buf[0] <= UCB <= buf[1]) and only the arms
    the bounds cannot separate from the best are computed in float64 - by the same loop as exact=True.

    Error bound of the float32 path, per arm, relative to mag = sum_ij |A_ij x_i x_j|: every inner
    sum has at most d float32 products and d - 1 additions in any order (gamma_d), the row's product
    by x_i one more rounding, x's and A's float32 storage one each per factor (3), the outer float64
    sum and the float64 path's own sums 4 (d + 2) float64 roundings. A packed row i computes
    (2 sum_{j>i} v_j + v_i) x_i with v_j = A_ij x_j: its error is at most gamma times
    (2 sum_{j>i} |v_j| + |v_i|) |x_i|, which is the row's share of mag (the doubling is in both).
    Roundings into the subnormal range add an absolute 2^-150 each (at most 4 per term, off-diagonal
    terms counted twice, and one per row, with |A_ij| <= 1 as A = I + sum x x^T and |x| <= 1 after
    scaling). The computed mag is itself within
    gamma_(d+2) of the true one: the 1.01 covers it and gamma's denominators.
    """
    n, d = theta.shape
    lo, hi, score = buf[0], buf[1], buf[2]
    big = 0.0
    for j in range(d):
        v = x[j]
        if not math.isfinite(v):
            return -1
        big = max(big, abs(v))
    _, exp = math.frexp(big)                 # big < 2^exp: x / 2^exp is in (-1, 1), exactly
    inv_scale = math.ldexp(1.0, -exp)
    scale2 = math.ldexp(1.0, 2 * exp)
    scaled = False
    slack = (d + 8) * _F32_EPS * 1.01 + 4.0 * (d + 2) * _F64_EPS
    floor = (4.0 * d * d + d) * _F32_UNDERFLOW * 1.01 * scale2
    best_lo = -np.inf
    for a in range(n):
        lo[a] = -np.inf
        hi[a] = -np.inf
        score[a] = -np.inf
        if not allowed[a]:
            continue
        if rank[a] != DENSE:                 # low-rank: the float64 value itself, cheap (both modes)
            s = _dot(theta, a, x) + alpha * math.sqrt(max(_lowrank_quad(w, a, rank[a], x), 0.0))
            lo[a] = s
            hi[a] = s
            score[a] = s
        elif exact:
            continue                         # computed in float64 below
        else:
            if not scaled:
                for j in range(d):
                    x32[j] = x[j] * inv_scale
                scaled = True
            quad = 0.0
            mag = 0.0
            off = 0
            for i in range(d):
                m = d - i
                row = p32[a, off:off + m]
                xs = x32[i:]
                acc = np.float32(0.0)
                acc_abs = np.float32(0.0)
                for j in range(1, m):
                    v = row[j] * xs[j]
                    acc += v
                    acc_abs += abs(v)
                diag = row[0] * x32[i]
                quad += (2.0 * acc + diag) * x32[i]
                mag += (2.0 * acc_abs + abs(diag)) * abs(x32[i])
                off += m
            quad *= scale2
            err = mag * scale2 * slack + floor
            mean = _dot(theta, a, x)
            if not (math.isfinite(quad) and math.isfinite(err)):
                hi[a] = np.inf              # no bound: always a candidate, decided in float64
                continue
            lo[a] = mean + alpha * math.sqrt(max(quad - err, 0.0))
            hi[a] = mean + alpha * math.sqrt(max(quad + err, 0.0))
            lo[a] -= 1e-12 * abs(lo[a])
            hi[a] += 1e-12 * abs(hi[a])
        if lo[a] > best_lo:
            best_lo = lo[a]
    if not exact:
        winner, n_cand = -1, 0
        for a in range(n):
            if allowed[a] and hi[a] >= best_lo:
                n_cand += 1
                if winner < 0:
                    winner = a
        if n_cand <= 1:
            return max(winner, 0)
    # dense arms in float64: every allowed one (exact) or the candidates the bounds left; one loop for both
    best, best_score = -1, -np.inf
    for a in range(n):
        if not allowed[a]:
            continue
        if not exact and not hi[a] >= best_lo:
            continue
        if rank[a] == DENSE:
            score[a] = _dot(theta, a, x) + alpha * math.sqrt(max(_packed_quad(p64, a, x), 0.0))
        if best < 0 or score[a] > best_score:
            best, best_score = a, score[a]
    return best


@njit(cache=True, fastmath=_FM, nogil=True)
def _sym_matvec(p, v, out):  # pragma: no cover - jitted
    """out = P v for one packed symmetric P."""
    d = v.shape[0]
    for i in range(d):
        out[i] = 0.0
    off = 0
    for i in range(d):
        n = d - i
        row = p[off:off + n]            # views per row, the reduction and the scatter as two loops:
        vs = v[i:]                      # each vectorizes
        os_ = out[i:]
        vi = v[i]
        s = 0.0
        for j in range(n):
            s += row[j] * vs[j]
        for j in range(1, n):
            os_[j] += row[j] * vi
        out[i] += s
        off += n
    return out


@njit(cache=True, fastmath=_FM, nogil=True)
def _add_outer(p, x, scale):  # pragma: no cover - jitted
    """P += scale * x x^T, packed."""
    d = x.shape[0]
    off = 0
    for i in range(d):
        n = d - i
        row = p[off:off + n]
        xs = x[i:]
        xi = scale * x[i]
        for j in range(n):
            row[j] += xi * xs[j]
        off += n


@njit(cache=True, fastmath=_FM, nogil=True)
def _dense_update(a_p, inv_p, inv32_p, b, theta, x, reward, u):  # pragma: no cover - jitted
    """Sherman–Morrison on one arm's packed A^-1, its float32 mirror, A, b and theta = A^-1 b."""
    d = x.shape[0]
    _sym_matvec(inv_p, x, u)
    denom = 1.0
    for i in range(d):
        denom += x[i] * u[i]
    inv = 1.0 / denom
    off = 0
    for i in range(d):
        n = d - i
        ri = inv_p[off:off + n]
        r32 = inv32_p[off:off + n]
        ra = a_p[off:off + n]
        us = u[i:]
        xs = x[i:]
        ui = u[i] * inv
        xi = x[i]
        for j in range(n):
            ri[j] -= ui * us[j]
            r32[j] = ri[j]
            ra[j] += xi * xs[j]
        b[i] += reward * xi
        off += n
    _sym_matvec(inv_p, b, theta)


@njit(cache=True, fastmath=_FM, nogil=True)
def _lowrank_update(a_p, w, t, b, theta, x, reward, r):  # pragma: no cover - jitted
    """Appends row t of W for context x (returns False, changing nothing, if rho^2 - which is
    1 + x^T A^-1 x >= 1 exactly - came out below 1/2: then the caller re-inverts exactly)."""
    d = x.shape[0]
    rho2 = 1.0
    for j in range(d):
        rho2 += x[j] * x[j]
    for k in range(t):
        acc = 0.0
        for j in range(d):
            acc += w[k, j] * x[j]
        r[k] = acc
        rho2 -= acc * acc
    if not (rho2 >= 0.5) or not math.isfinite(rho2):
        return False
    inv_rho = 1.0 / math.sqrt(rho2)
    row = w[t]
    for j in range(d):
        row[j] = x[j]
    for k in range(t):
        rk = r[k]
        for j in range(d):
            row[j] -= rk * w[k, j]
    for j in range(d):
        row[j] *= inv_rho
    _add_outer(a_p, x, 1.0)
    for j in range(d):
        b[j] += reward * x[j]
    # theta = b - W^T (W b)
    for j in range(d):
        theta[j] = b[j]
    for k in range(t + 1):
        acc = 0.0
        for j in range(d):
            acc += w[k, j] * b[j]
        for j in range(d):
            theta[j] -= acc * w[k, j]
    return True


# --- packing ------------------------------------------------------------------------------------

def _triu(dim: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(dim)


def pack(full: np.ndarray) -> np.ndarray:
    """The packed upper triangles (row by row) of a stack of symmetric matrices (..., d, d)."""
    i, j = _triu(full.shape[-1])
    return np.ascontiguousarray(full[..., i, j])


def unpack(packed: np.ndarray, dim: int) -> np.ndarray:
    """Full symmetric matrices from packed upper triangles (..., d (d + 1) / 2)."""
    i, j = _triu(dim)
    out = np.zeros((*packed.shape[:-1], dim, dim))
    out[..., i, j] = packed
    out[..., j, i] = packed
    return out


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
        self._alpha = float(alpha)
        self.n_arms, self.dim = n_arms, dim
        self.arm_names = list(arm_names) if arm_names else [str(i) for i in range(n_arms)]
        if len(self.arm_names) != n_arms:
            raise PolicyError(f"{len(self.arm_names)} arm names for {n_arms} arms")
        eye = pack(np.eye(dim))
        self._a_p = np.ascontiguousarray(np.broadcast_to(eye, (n_arms, eye.size)).copy())   # A, packed
        self._inv_p = self._a_p.copy()              # A^-1, packed (dense-form arms)
        self._inv32_p = self._inv_p.astype(np.float32)   # select's mirror, kept in step
        self._w = np.zeros((n_arms, switch_rank(dim), dim))   # low-rank form: A^-1 = I - W^T W
        self.rank = np.zeros(n_arms, dtype=np.int64)           # W's rows in use, or DENSE
        self.b = np.zeros((n_arms, dim))
        self.theta = np.zeros((n_arms, dim))
        self.counts = np.zeros(n_arms, dtype=np.int64)
        self._since_reinvert = np.zeros(n_arms, dtype=np.int64)
        self._all = np.ones(n_arms, dtype=np.bool_)
        self.context: dict | None = None     # ContextBuilder.spec of the contexts it learns from
        self._local = threading.local()

    @property
    def alpha(self) -> float:
        return self.config.alpha

    # full matrices, built on demand (inspection, persistence, tests): not the hot path
    @property
    def A(self) -> np.ndarray:  # noqa: N802 - the paper's name
        """Every arm's A (n_arms, d, d), a copy."""
        return unpack(self._a_p, self.dim)

    @property
    def A_inv(self) -> np.ndarray:  # noqa: N802
        """Every arm's A^-1 (n_arms, d, d) as the policy holds it (either form), a copy."""
        out = unpack(self._inv_p, self.dim)
        for arm in np.flatnonzero(self.rank != DENSE):
            w = self._w[arm, : self.rank[arm]]
            out[arm] = np.eye(self.dim) - w.T @ w
        return out

    @property
    def state_bytes(self) -> int:
        """Bytes of the per-arm state (all arms)."""
        return sum(a.nbytes for a in (self._a_p, self._inv_p, self._inv32_p, self._w, self.rank, self.b,
                                      self.theta, self.counts, self._since_reinvert))

    def scores(self, x: np.ndarray, allowed=None) -> np.ndarray:
        """UCB of every arm (Eq. 1) in float64; -inf where not allowed."""
        x = check_x(x, self.dim)
        mask = check_allowed(allowed, self.n_arms)
        buf, x32 = self._scratch()
        _ucb(self._inv_p, self._inv32_p, self._w, self.rank, self.theta, x, self._alpha, mask, True, buf, x32)
        return buf[2].copy()

    def select(self, x: np.ndarray, allowed=None, key: str | None = None) -> int:
        """argmax of the UCB over allowed arms; ties go to the lowest index (`key` is unused:
        the choice is a function of `x` alone). The context's finiteness is checked in the kernel."""
        if type(x) is not np.ndarray or x.dtype != np.float64 or x.shape != (self.dim,) \
                or not x.flags.c_contiguous:
            x = check_x(x, self.dim)
        mask = self._all if allowed is None else check_allowed(allowed, self.n_arms)
        buf, x32 = self._scratch()
        arm = _ucb(self._inv_p, self._inv32_p, self._w, self.rank, self.theta, x, self._alpha, mask, False,
                   buf, x32)
        if arm < 0:
            check_x(x, self.dim)        # names the bad index
            raise PolicyError("context x has a NaN/inf; check the features that fill it")
        return arm

    def _scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """select's scratch, one set per thread: the kernel releases the GIL, so a shared set raced."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = (np.empty((3, self.n_arms)), np.empty(self.dim, dtype=np.float32))
        return bufs

    def update(self, arm: int, x: np.ndarray, reward: float) -> None:
        """Eq. 3 for the played arm only: a new row of W (low-rank form) or a rank-one
        Sherman–Morrison update (dense form)."""
        arm = check_arm(arm, self.n_arms)
        x = check_x(x, self.dim)
        reward = check_reward(reward)
        t = int(self.rank[arm])
        grown = False
        if t != DENSE and t < self._w.shape[1]:
            grown = _lowrank_update(self._a_p[arm], self._w[arm], t, self.b[arm], self.theta[arm], x, reward,
                                    np.empty(max(t, 1)))
            if grown:
                self.rank[arm] = t + 1
        if not grown:
            if t != DENSE:                  # the switch (or a low-rank step that lost accuracy): exact
                _add_outer(self._a_p[arm], x, 1.0)
                self.b[arm] += reward * x
                self.counts[arm] += 1
                self._to_dense(arm)
                return
            _dense_update(self._a_p[arm], self._inv_p[arm], self._inv32_p[arm], self.b[arm], self.theta[arm], x,
                          reward, np.empty(self.dim))
        self.counts[arm] += 1
        self._since_reinvert[arm] += 1
        every = self.config.reinvert_every
        if every and self._since_reinvert[arm] >= every:
            self.reinvert(arm)

    def _to_dense(self, arm: int) -> None:
        self.rank[arm] = DENSE
        self._w[arm] = 0.0
        self.reinvert(arm)

    def reinvert(self, arm: int) -> None:
        """Exact A^-1 (Cholesky) for one arm; resets the accumulated rounding (an arm in the
        low-rank form moves to the dense form)."""
        if self.rank[arm] != DENSE:
            self._to_dense(arm)
            return
        inv = exact_inverse(unpack(self._a_p[arm], self.dim))
        self._inv_p[arm] = pack(inv)
        self._inv32_p[arm] = self._inv_p[arm]
        self.theta[arm] = inv @ self.b[arm]
        self._since_reinvert[arm] = 0

    # --- persistence (npz, no pickle, atomic) --------------------------------
    def save(self, path: Path | str) -> None:
        save_npz(path, KIND, {
            "n_arms": np.int64(self.n_arms), "dim": np.int64(self.dim),
            "alpha": np.float64(self.alpha), "reinvert_every": np.int64(self.config.reinvert_every),
            "arm_names": np.array(self.arm_names, dtype=str), "A": self.A, "A_inv": self.A_inv,
            "b": self.b, "theta": self.theta, "counts": self.counts,
            "since_reinvert": self._since_reinvert, "rank": self.rank, "W": self._w,
            **context_arrays(self.context),
        })

    @classmethod
    def load(cls, path: Path | str, *, dim: int | None = None,
             arm_names: list[str] | None = None) -> "LinUCB":
        """Load a saved policy; `dim` / `arm_names`, when given, must match the file."""
        from d2r_edge.errors import PolicyFileError

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
            raise PolicyFileError(f"{path}: A_inv is not the inverse of A (max |A A_inv - I| = {residual:.3g}); the "
                                  f"file is damaged: restore it or retrain")
        pol = cls(n, d, stored_scalar(z, path, "alpha", float, 0.0),
                  reinvert_every=stored_scalar(z, path, "reinvert_every", int, 0), arm_names=names)
        pol._a_p[:] = pack(arrays["A"])
        pol.b[:] = arrays["b"]
        pol.theta[:] = arrays["theta"]
        pol.counts[:] = arrays["counts"]
        pol._since_reinvert[:] = arrays["since_reinvert"]
        if "rank" in z or "W" in z:          # files before the low-rank form hold every arm dense
            t_max = switch_rank(d)
            rank = stored_array(z, path, "rank", (n,))
            if rank.dtype.kind not in "iu" or not np.all((rank == DENSE) | ((rank >= 0) & (rank <= t_max))):
                raise PolicyFileError(f"{path}: 'rank' must hold {DENSE} or 0..{t_max} per arm; the file is "
                                      f"damaged: restore it or retrain")
            pol._w[:] = stored_array(z, path, "W", (n, t_max, d))
            pol.rank[:] = rank
        else:
            pol.rank[:] = DENSE
        pol._inv_p[:] = pack(arrays["A_inv"])
        pol._inv32_p[:] = pol._inv_p
        for arm in np.flatnonzero(pol.rank != DENSE):
            w = pol._w[arm, : pol.rank[arm]]
            pol._w[arm, pol.rank[arm]:] = 0.0
            if not np.abs(np.eye(d) - w.T @ w - arrays["A_inv"][arm]).max(initial=0.0) <= 1e-6 * max(
                    1.0, float(np.abs(arrays["A_inv"][arm]).max())):
                raise PolicyFileError(f"{path}: arm {arm}'s W does not match its A_inv; the file is damaged: "
                                      f"restore it or retrain")
        pol.context = context_from(z)
        return pol
