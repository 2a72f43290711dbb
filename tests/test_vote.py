"""Vote across arms (issue 51 §2): the weighted tally, the arms it asks, and the pipeline's vote repair."""

from __future__ import annotations

import numpy as np
import pytest
from stand_ins import ScoreByCall, top_score_detector

from d2r_edge.budget import CostModel, MemoryProbe, Meter
from d2r_edge.config import Budget, ContextConfig
from d2r_edge.detector import Gate
from d2r_edge.diagnose import Diagnosis, Label
from d2r_edge.errors import ConfigError
from d2r_edge.generate.base import Generation
from d2r_edge.pipeline import Pipeline
from d2r_edge.policy import LinUCB
from d2r_edge.policy.features import ContextBuilder
from d2r_edge.repair import ARM_NAMES
from d2r_edge.signals import Entailment, FailureType, KGStatus
from d2r_edge.tasks import Task
from d2r_edge.vote import cheapest_fitting, tally


def test_the_heavier_group_wins_not_the_larger_one():
    # two repairs agree on REFUTES, but the first answer is trusted far more
    b = tally("c", ["SUPPORTS", "REFUTES", "REFUTES"], [0.9, 0.3, 0.3], True)
    assert b.winner == 0 and b.groups[1] == b.groups[2] != b.groups[0]
    b = tally("c", ["SUPPORTS", "REFUTES", "REFUTES"], [0.5, 0.4, 0.45], True)
    assert b.winner == 2                        # the group wins, its most trusted attempt is delivered
    assert b.totals[b.groups[1]] == pytest.approx(0.85)


def test_ties_keep_the_first_answer_and_qa_answers_group_by_normalization():
    assert tally("c", ["SUPPORTS", "REFUTES"], [0.5, 0.5], True).winner == 0
    b = tally("q", ["Paris", "the Paris", "Rome"], [0.2, 0.3, 0.45], False)
    assert b.groups[0] == b.groups[1] and b.winner == 1        # 0.5 for "Paris" beats 0.45
    with pytest.raises(ValueError):
        tally("q", ["a"], [0.1, 0.2], False)


def test_the_cheapest_arms_that_fit_the_budget_together():
    allowed = np.array([True, True, False, True])
    predicted = np.array([2.0, 1.0, 0.1, 1.5])
    assert cheapest_fitting(allowed, predicted, 2, 10.0) == [1, 3]          # arm 2 is not allowed
    assert cheapest_fitting(allowed, predicted, 3, 3.0) == [1, 3]           # 1 + 1.5 fit, + 2 would not
    assert cheapest_fitting(allowed, predicted, 3, 0.5) == [1]              # one runs even over the budget
    assert cheapest_fitting(np.zeros(4, dtype=bool), predicted, 2, 9.0) == []


class _Generator:
    """SUPPORTS on the first attempt, REFUTES on every repair."""

    name = "stub"

    def generate(self, task, style, query, passages, sample=True):
        return Generation("some text", Label.SUPPORTS if sample else Label.REFUTES, "raw")


class _Diagnoser:
    def diagnose(self, query, passages, response, label, fact_verification):
        probs = [{"entailment": 0.5, "neutral": 0.3, "contradiction": 0.2}]
        return Diagnosis(FailureType.WRONG_RESPONSE, Entailment.ENTAILMENT, Entailment.NEUTRAL, KGStatus.NO_TRIPLETS,
                         label, label, probs, probs)


def _pipeline(vote_k: int, detector="default") -> Pipeline:
    ctx = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None))
    # the first retrieval scores 3 (P(wrong) ~ 0.99), every repair's 1 (~ 0.01)
    return Pipeline(task=Task.FEVER, retriever=ScoreByCall(lambda q, n: 3.0 if n == 1 else 1.0),
                    generator=_Generator(), diagnoser=_Diagnoser(),
                    policy=LinUCB(len(ARM_NAMES), ctx.dim, 2.0), context=ctx, costs=CostModel(len(ARM_NAMES)),
                    meter=Meter(MemoryProbe(prefer_device=False)), gate=Gate.PAPER,
                    detector=top_score_detector() if detector == "default" else detector,
                    budget=Budget(latency_s=60.0), vote_k=vote_k)


def test_the_pipeline_votes_with_k_arms_and_delivers_the_winner():
    rec = _pipeline(3).run("a claim", learn=False)
    vote = rec["repair"]["vote"]
    assert len(vote["arms"]) == 3 and vote["answers"] == ["SUPPORTS", "REFUTES", "REFUTES", "REFUTES"]
    assert vote["weights"][0] < 0.05 and all(w > 0.95 for w in vote["weights"][1:])
    assert rec["repair"]["kept"] == "repaired" and rec["final_answer"] == "REFUTES"
    assert rec["repair"]["arm"] == vote["winner_arm"] and rec["repair"]["x"] is None     # no policy update
    # the arms' costs add up in the repair's latency
    assert rec["repair"]["latency_s"] > 0


def test_a_vote_needs_two_arms_and_the_detector():
    with pytest.raises(ConfigError, match="--detector"):
        _pipeline(2, detector=None)
    with pytest.raises(ConfigError, match="K >= 2"):
        _pipeline(1)
