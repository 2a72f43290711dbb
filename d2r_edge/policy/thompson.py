"""Thompson Sampling as in the paper's baseline: Beta-Bernoulli per arm, context ignored.

select draws one Beta sample per arm in a numba kernel with the policy's own generator
(xoshiro256**, four 64-bit words kept in the policy and saved with it; Beta(a, b) as
G(a) / (G(a) + G(b)) with Marsaglia–Tsang gamma draws): one call, no numpy generator
per select. A keyed draw (a frozen policy answering a query) seeds a generator from
(seed, posterior size, crc32(key)) through splitmix64, so the same query draws the same
arm wherever it sits in the input and on whichever worker runs it.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
from numba import njit

from d2r_edge.errors import PolicyError
from d2r_edge.policy.state import (
    check_allowed,
    check_arm,
    check_reward,
    context_arrays,
    context_from,
    load_npz,
    save_npz,
    stored_array,
    stored_names,
    stored_scalar,
)

KIND = "thompson"

_U = np.uint64


@njit(cache=True, nogil=True)
def _rotl(x, k):  # pragma: no cover - jitted
    return (x << _U(k)) | (x >> _U(64 - k))


@njit(cache=True, nogil=True)
def _next(s):  # pragma: no cover - jitted
    """xoshiro256** (Blackman & Vigna): the next 64 bits of state s (4 words)."""
    result = _rotl(s[1] * _U(5), 7) * _U(9)
    t = s[1] << _U(17)
    s[2] ^= s[0]
    s[3] ^= s[1]
    s[1] ^= s[2]
    s[0] ^= s[3]
    s[2] ^= t
    s[3] = _rotl(s[3], 45)
    return result


@njit(cache=True, nogil=True)
def _splitmix(z):  # pragma: no cover - jitted
    z = (z ^ (z >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U(27))) * _U(0x94D049BB133111EB)
    return z ^ (z >> _U(31))


@njit(cache=True, nogil=True)
def _seed(s, a, b, c):  # pragma: no cover - jitted
    """State from three 64-bit words through splitmix64 (never all zero)."""
    z = _splitmix(a ^ _U(0x9E3779B97F4A7C15)) ^ _splitmix(b + _U(0x632BE59BD9B4E019)) ^ _splitmix(c)
    for i in range(4):
        z += _U(0x9E3779B97F4A7C15)
        s[i] = _splitmix(z)


@njit(cache=True, nogil=True)
def _uniform(s):  # pragma: no cover - jitted
    """A double in (0, 1]: 53 random bits."""
    return ((_next(s) >> _U(11)) + _U(1)) * (1.0 / 9007199254740992.0)


@njit(cache=True, nogil=True)
def _normal(s):  # pragma: no cover - jitted
    return math.sqrt(-2.0 * math.log(_uniform(s))) * math.cos(2.0 * math.pi * _uniform(s))


@njit(cache=True, nogil=True)
def _gamma(s, k):  # pragma: no cover - jitted
    """Gamma(k, 1), Marsaglia & Tsang (2000); k < 1 through Gamma(k + 1) * U^(1/k)."""
    boost = 1.0
    if k < 1.0:
        boost = _uniform(s) ** (1.0 / k)
        k += 1.0
    d = k - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    while True:
        x = _normal(s)
        v = 1.0 + c * x
        if v <= 0.0:
            continue
        v = v * v * v
        u = _uniform(s)
        if u < 1.0 - 0.0331 * x * x * x * x or math.log(u) < 0.5 * x * x + d * (1.0 - v + math.log(v)):
            return d * v * boost


# the two entries keep the GIL: a policy's state and scratch are shared by the threads that call it
@njit(cache=True)
def _draw(succ, fail, allowed, s, out):  # pragma: no cover - jitted
    """One Beta(successes, failures) draw per allowed arm into out (-inf elsewhere); the first argmax."""
    best, best_v = 0, -np.inf
    first = True
    for a in range(succ.shape[0]):
        if not allowed[a]:
            out[a] = -np.inf
            continue
        g = _gamma(s, succ[a])
        v = g / (g + _gamma(s, fail[a]))
        out[a] = v
        if first or v > best_v:
            best, best_v, first = a, v, False
    return best


@njit(cache=True)
def _draw_keyed(succ, fail, allowed, a, b, c, s, out):  # pragma: no cover - jitted
    _seed(s, a, b, c)
    return _draw(succ, fail, allowed, s, out)


class ThompsonSampling:
    """Beta(1, 1) priors; a reward >= `threshold` (0.4) counts as a success."""

    def __init__(self, n_arms: int, *, threshold: float = 0.4, seed: int = 0,
                 arm_names: list[str] | None = None) -> None:
        if not isinstance(n_arms, int) or n_arms < 1:
            raise PolicyError(f"n_arms must be an int >= 1, got {n_arms!r}")
        if not 0.0 <= threshold <= 1.0:
            raise PolicyError(f"threshold must be in [0, 1], got {threshold!r}")
        self.n_arms = n_arms
        self.threshold = float(threshold)
        self.seed = seed
        self.arm_names = list(arm_names) if arm_names else [str(i) for i in range(n_arms)]
        self.successes = np.ones(n_arms)
        self.failures = np.ones(n_arms)
        self.state = np.zeros(4, dtype=np.uint64)       # the stream's generator (xoshiro256**)
        _seed(self.state, _U(seed & (2**64 - 1)), _U(0), _U(0))
        self._all = np.ones(n_arms, dtype=np.bool_)
        self._out = np.empty(n_arms)
        self._keyed = np.empty(4, dtype=np.uint64)
        self.context: dict | None = None     # ContextBuilder.spec (x is ignored, kept for the record)

    def _posterior_size(self) -> int:
        return int(self.successes.sum() + self.failures.sum())

    def _run(self, allowed, key: str | None, out: np.ndarray) -> int:
        mask = self._all if allowed is None else check_allowed(allowed, self.n_arms)
        if key is None:
            return int(_draw(self.successes, self.failures, mask, self.state, out))
        return int(_draw_keyed(self.successes, self.failures, mask, _U(self.seed & (2**64 - 1)),
                               _U(self._posterior_size()), _U(zlib.crc32(key.encode("utf-8"))), self._keyed, out))

    def scores(self, x=None, allowed=None, key: str | None = None) -> np.ndarray:
        """One posterior draw per arm; -inf where not allowed. `x` is ignored.

        Without `key` the draws come from the policy's own stream (training: each update
        changes the posterior anyway). With `key` (a frozen policy answering a query) they
        come from a generator seeded by (seed, posterior size, key): the same query gets
        the same draw wherever it sits in the input and on whichever worker runs it.
        """
        out = np.empty(self.n_arms)
        self._run(allowed, key, out)
        return out

    def select(self, x=None, allowed=None, key: str | None = None) -> int:
        """The arm with the highest draw (scores' argmax, the same draws)."""
        return self._run(allowed, key, self._out)

    def choice_probabilities(self, allowed=None, samples: int = 512) -> np.ndarray:
        """Monte-Carlo P(arm is picked), for propensity logging (own RNG stream)."""
        mask = check_allowed(allowed, self.n_arms)
        rng = np.random.default_rng([self.seed, self._posterior_size()])
        draws = rng.beta(self.successes, self.failures, size=(samples, self.n_arms))
        draws[:, ~mask] = -np.inf
        return np.bincount(draws.argmax(axis=1), minlength=self.n_arms) / samples

    def update(self, arm: int, x=None, reward: float = 0.0) -> None:
        arm = check_arm(arm, self.n_arms)
        if check_reward(reward) >= self.threshold:
            self.successes[arm] += 1
        else:
            self.failures[arm] += 1

    def save(self, path: Path | str) -> None:
        save_npz(path, KIND, {
            "n_arms": np.int64(self.n_arms), "threshold": np.float64(self.threshold),
            "seed": np.int64(self.seed), "arm_names": np.array(self.arm_names, dtype=str),
            "successes": self.successes, "failures": self.failures,
            # the generator's state, so a resumed run draws what an uninterrupted one would
            "xoshiro_state": self.state.copy(),
            **context_arrays(self.context),
        })

    @classmethod
    def load(cls, path: Path | str, *, arm_names: list[str] | None = None) -> "ThompsonSampling":
        z = load_npz(path, KIND, expect_arms=arm_names)
        n = stored_scalar(z, path, "n_arms", int, 1, 10_000)
        ts = cls(n, threshold=stored_scalar(z, path, "threshold", float, 0.0, 1.0),
                 seed=stored_scalar(z, path, "seed", int, 0), arm_names=stored_names(z, path, n))
        # Beta(successes, failures): both > 0 (they start at the uniform prior's 1)
        ts.successes[:] = stored_array(z, path, "successes", (n,), positive=True)
        ts.failures[:] = stored_array(z, path, "failures", (n,), positive=True)
        from d2r_edge.errors import PolicyFileError

        if "xoshiro_state" in z:
            state = z["xoshiro_state"]
            if state.dtype != np.uint64 or state.shape != (4,) or not state.any():
                raise PolicyFileError(f"{path}: the sampler state (xoshiro_state) is damaged; restore the file or "
                                      f"retrain")
            ts.state[:] = state
        else:
            # a file from before the jitted sampler (numpy's PCG64 state): its stream cannot be continued
            # draw for draw; the new stream is seeded from that state, so it still differs per file
            try:
                old = int(str(z["rng_state"])), int(str(z["rng_inc"]))
            except (KeyError, ValueError, TypeError, OverflowError):
                raise PolicyFileError(f"{path}: the sampler state (rng_state / rng_inc) is damaged; restore the "
                                      f"file or retrain") from None
            _seed(ts.state, _U(old[0] & (2**64 - 1)), _U((old[0] >> 64) & (2**64 - 1)), _U(old[1] & (2**64 - 1)))
        ts.context = context_from(z)
        return ts
