"""Vote across arms (issue 51 §2): where the budget allows more than one repair pass, ask several.

One arm cannot be trusted to fix a small LLM's answer: each failing query is
fixed by a different arm, and most arms break about as many answers as they fix.
Here the k cheapest allowed arms that fit the budget each answer once more, and
the answer returned is the one the attempts agree on, each attempt (the first
one included) weighted by its P(right) = 1 - the detector's P(wrong):

- answers are grouped as the self-consistency signal groups them
  (`consistency.clusters`: FEVER by label, QA by the normalized answer, merged
  by mutual entailment when an NLI is given);
- the group with the largest total weight wins (ties: the group holding the first
  answer, then the earlier attempt); within it the attempt with the highest
  weight is delivered, the first attempt when it is in the group and ties.

Which arms: the k cheapest by the cost model's predicted latency (an arm not yet
measured counts the first attempt's own time), each added only while the running
total still fits the query's budget; at least one runs. A vote with one arm is
accept-or-revert by weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from d2r_edge.consistency import clusters


@dataclass(frozen=True)
class Ballot:
    winner: int                  # index into the attempts (0: the first answer)
    groups: list[int]            # a group id per attempt
    weights: list[float]         # P(right) per attempt
    totals: dict[int, float]     # total weight per group

    def to_record(self, answers: list[str], arms: list[str]) -> dict:
        return {"arms": arms, "answers": answers, "weights": [round(w, 6) for w in self.weights],
                "groups": self.groups, "winner": self.winner, "winner_arm": (["first"] + arms)[self.winner],
                "group_weights": {str(g): round(t, 6) for g, t in self.totals.items()}}


def tally(query: str, answers: list[str], p_right: list[float], fact_verification: bool, nli=None) -> Ballot:
    """The weighted vote of the module docstring over `answers` (answers[0]: the first attempt's)."""
    if not answers or len(answers) != len(p_right):
        raise ValueError(f"a vote needs one weight per answer (got {len(answers)} answers, {len(p_right)} weights)")
    groups = clusters(query, list(answers), fact_verification, nli)
    totals: dict[int, float] = {}
    for g, w in zip(groups, p_right):
        totals[g] = totals.get(g, 0.0) + float(w)
    best = max(totals.values())
    tied = [g for g, t in totals.items() if np.isclose(t, best)]
    group = groups[0] if groups[0] in tied else min(tied, key=groups.index)
    members = [i for i, g in enumerate(groups) if g == group]
    top = max(p_right[i] for i in members)
    winner = next(i for i in members if np.isclose(p_right[i], top))
    return Ballot(winner, list(groups), [float(w) for w in p_right], totals)


def cheapest_fitting(allowed: np.ndarray, predicted_s: np.ndarray, k: int, budget_s: float) -> list[int]:
    """The k cheapest allowed arms whose predicted latencies, summed, fit `budget_s` (at least one)."""
    order = sorted(np.flatnonzero(allowed), key=lambda a: (predicted_s[a], a))
    chosen, spent = [], 0.0
    for arm in order:
        if len(chosen) == k:
            break
        if chosen and spent + predicted_s[arm] > budget_s:
            break
        chosen.append(int(arm))
        spent += float(predicted_s[arm])
    return chosen
