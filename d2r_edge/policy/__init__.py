"""Repair policies: LinUCB, Thompson Sampling, the best fixed arm, the reward, the context vector."""

from d2r_edge.policy.explore import Decision, Explorer, exploration_weights
from d2r_edge.policy.features import ContextBuilder
from d2r_edge.policy.fixed import BestFixed
from d2r_edge.policy.linucb import LinUCB
from d2r_edge.policy.reward import reward
from d2r_edge.policy.thompson import ThompsonSampling


def updates_of(policy) -> int:
    """How many updates a policy has taken (LinUCB's counts; Thompson's pseudo-counts past the prior)."""
    if isinstance(policy, (LinUCB, BestFixed)):
        return int(policy.counts.sum())
    return int(round(float(policy.successes.sum() + policy.failures.sum()) - 2 * policy.n_arms))


__all__ = ["BestFixed", "ContextBuilder", "Decision", "Explorer", "LinUCB", "ThompsonSampling",
           "exploration_weights", "reward", "updates_of"]
