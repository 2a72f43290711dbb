"""Training-time exploration (reference code) with the propensity of every decision logged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from d2r_edge.config import ExplorationConfig
from d2r_edge.policy.state import check_allowed


@dataclass(frozen=True)
class Decision:
    arm: int
    propensity: float      # P(this arm | context, policy state) under the behaviour policy
    explored: bool         # drawn at random rather than by the policy


def exploration_weights(is_retrieval: np.ndarray, allowed: np.ndarray,
                        cfg: ExplorationConfig) -> np.ndarray:
    """Retrieval arms share `retrieval_share`; each other arm weighs `other_arm_weight`."""
    is_retrieval = np.asarray(is_retrieval, dtype=bool)
    w = np.zeros(is_retrieval.shape[0])
    retr = is_retrieval & allowed
    if retr.any():
        w[retr] = cfg.retrieval_share / retr.sum()
    w[~is_retrieval & allowed] = cfg.other_arm_weight
    if w.sum() <= 0:  # e.g. only retrieval arms allowed and their share is 0
        w[allowed] = 1.0
    return w / w.sum()


class Explorer:
    """With probability `rate`, draw a weighted random arm instead of the policy's."""

    def __init__(self, is_retrieval: np.ndarray, cfg: ExplorationConfig = ExplorationConfig()) -> None:
        self.is_retrieval = np.asarray(is_retrieval, dtype=bool)
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)

    def decide(self, policy, x, allowed=None) -> Decision:
        mask = check_allowed(allowed, self.is_retrieval.shape[0])
        weights = exploration_weights(self.is_retrieval, mask, self.cfg)
        stochastic = hasattr(policy, "choice_probabilities")   # TS draws on every select
        greedy_probs = policy.choice_probabilities(mask) if stochastic else None
        greedy = None if stochastic else policy.select(x, mask)
        explored = self.cfg.rate > 0 and self.rng.random() < self.cfg.rate
        if explored:
            arm = int(self.rng.choice(len(weights), p=weights))
        else:
            arm = policy.select(x, mask) if stochastic else greedy
        greedy_p = float(greedy_probs[arm]) if stochastic else float(arm == greedy)
        propensity = self.cfg.rate * float(weights[arm]) + (1 - self.cfg.rate) * greedy_p
        return Decision(arm=arm, propensity=propensity, explored=explored)
