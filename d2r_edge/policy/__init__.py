"""Repair policies: LinUCB, Thompson Sampling, the reward, the context vector."""

from d2r_edge.policy.explore import Decision, Explorer, exploration_weights
from d2r_edge.policy.features import ContextBuilder
from d2r_edge.policy.linucb import LinUCB
from d2r_edge.policy.reward import reward
from d2r_edge.policy.thompson import ThompsonSampling

__all__ = ["ContextBuilder", "Decision", "Explorer", "LinUCB", "ThompsonSampling",
           "exploration_weights", "reward"]
