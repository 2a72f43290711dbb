"""The best fixed arm as a policy: one arm for every repair, the one with the best mean Eq. 2 reward.

Table 1's `best_fixed` row, deployable. On issue 51's fresh FEVER slice it beat LinUCB on the
test claims (+6.3 vs +4.7 points over naive) and, where the default is chosen, on the training
claims by 5-fold cross-validation (+6.0 [+2.0, +10.7] vs -1.3 [-6.0, +3.3]; docs/runs/fever-t1fresh):
with ~75 repaired training queries a per-context model has too little to learn from, one
well-chosen arm does not.

Learning is full-information where it can be (`full_information`): `d2r-edge train` tries every
allowed arm of each query it repairs and updates each arm's mean, as `eval answers` chooses its
best_fixed arm from every allowed arm's outcome (Pipeline.learn_every_arm). Where only the chosen
arm is seen (online updates while serving) its mean is refined. The choice: the allowed arm with the
best mean reward among those tried; ties and untried arms go to the lowest index (an untrained
policy repairs with the first allowed arm, as an untrained LinUCB's tied scores do). The context is
ignored.

What "best" means is the reward's: Eq. 2's indicators by default. `train --reward-quality label`
scores each tried arm by whether its answer is right by the query's gold, so (with --unweighted) the
means become the arms' shares of right answers on the repaired training queries each was tried on:
`eval answers`' best_fixed_labeled choice, deployable. The two agree where every arm is allowed on
the same queries; best_fixed_labeled ranks by fixed minus broken over the queries each arm may
repair, this mean by the share right over them, and Eq. 2's cost terms (on by default) favour cheap
arms. On HotpotQA Eq. 2's indicators picked reader_span, which fixed 0 and broke 4 gated training
answers, over bm25_k10's 11 / 4 (docs/runs/qa-t1reader).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

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

KIND = "fixed"


class BestFixed:
    """Per-arm reward sums and counts; select = the allowed arm with the best mean among those tried."""

    kind = KIND
    full_information = True          # train tries every allowed arm of a repaired query

    def __init__(self, n_arms: int, *, arm_names: list[str] | None = None) -> None:
        self.n_arms = int(n_arms)
        self.arm_names = list(arm_names) if arm_names is not None else [str(i) for i in range(self.n_arms)]
        self.sums = np.zeros(self.n_arms)
        self.counts = np.zeros(self.n_arms, dtype=np.int64)
        self.context: dict | None = None

    def means(self) -> np.ndarray:
        """Mean reward per arm; NaN for an arm never tried."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.counts > 0, self.sums / np.maximum(self.counts, 1), np.nan)

    def scores(self, x=None, allowed=None, key: str | None = None) -> np.ndarray:
        """The means, -inf where not allowed or never tried."""
        mask = check_allowed(allowed, self.n_arms)
        m = self.means()
        return np.where(mask & ~np.isnan(m), m, -np.inf)

    def select(self, x=None, allowed=None, key: str | None = None) -> int:
        mask = check_allowed(allowed, self.n_arms)
        s = self.scores(None, mask)
        if np.isfinite(s).any():
            return int(np.argmax(s))                 # the first of tied best means
        return int(np.flatnonzero(mask)[0])

    def update(self, arm: int, x=None, reward: float = 0.0) -> None:
        arm = check_arm(arm, self.n_arms)
        self.sums[arm] += check_reward(reward)
        self.counts[arm] += 1

    def save(self, path: Path | str) -> None:
        save_npz(path, KIND, {"n_arms": np.int64(self.n_arms), "arm_names": np.array(self.arm_names, dtype=str),
                              "sums": self.sums, "counts": self.counts, **context_arrays(self.context)})

    @classmethod
    def load(cls, path: Path | str, *, arm_names: list[str] | None = None) -> "BestFixed":
        z = load_npz(path, KIND, expect_arms=arm_names)
        n = stored_scalar(z, path, "n_arms", int, 1, 10_000)
        pol = cls(n, arm_names=stored_names(z, path, n))
        pol.counts[:] = stored_array(z, path, "counts", (n,), counts=True)
        pol.sums[:] = stored_array(z, path, "sums", (n,))
        if (pol.sums < 0).any() or (pol.sums > pol.counts).any():
            from d2r_edge.errors import PolicyFileError

            raise PolicyFileError(f"{path}: reward sums outside [0, count] (Eq. 2 rewards are in [0, 1]); the file "
                                  f"is damaged: restore it or retrain")
        pol.context = context_from(z)
        return pol
