"""Thompson Sampling as in the paper's baseline: Beta-Bernoulli per arm, context ignored."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

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
        self.rng = np.random.default_rng(seed)
        self.context: dict | None = None     # ContextBuilder.spec (x is ignored, kept for the record)

    def scores(self, x=None, allowed=None, key: str | None = None) -> np.ndarray:
        """One posterior draw per arm; -inf where not allowed. `x` is ignored.

        Without `key` the draws come from the policy's own stream (training: each update
        changes the posterior anyway). With `key` (a frozen policy answering a query) they
        come from a generator seeded by (seed, posterior size, key): the same query gets
        the same draw wherever it sits in the input and on whichever worker runs it.
        """
        mask = check_allowed(allowed, self.n_arms)
        rng = self.rng if key is None else np.random.default_rng(
            [self.seed, int(self.successes.sum() + self.failures.sum()), zlib.crc32(key.encode("utf-8"))])
        draws = rng.beta(self.successes, self.failures)
        return np.where(mask, draws, -np.inf)

    def select(self, x=None, allowed=None, key: str | None = None) -> int:
        return int(np.argmax(self.scores(x, allowed, key)))

    def choice_probabilities(self, allowed=None, samples: int = 512) -> np.ndarray:
        """Monte-Carlo P(arm is picked), for propensity logging (own RNG stream)."""
        mask = check_allowed(allowed, self.n_arms)
        rng = np.random.default_rng([self.seed, int(self.successes.sum() + self.failures.sum())])
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
            "rng_state": np.array(repr(self.rng.bit_generator.state["state"]["state"])),
            "rng_inc": np.array(repr(self.rng.bit_generator.state["state"]["inc"])),
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
        state = ts.rng.bit_generator.state
        try:
            state["state"] = {"state": int(str(z["rng_state"])), "inc": int(str(z["rng_inc"]))}
            ts.rng.bit_generator.state = state
        except (KeyError, ValueError, TypeError, OverflowError):
            from d2r_edge.errors import PolicyFileError

            raise PolicyFileError(f"{path}: the sampler state (rng_state / rng_inc) is damaged; restore the "
                                  f"file or retrain") from None
        ts.context = context_from(z)
        return ts
