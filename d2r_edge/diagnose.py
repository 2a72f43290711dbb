"""Algorithm 1: failure diagnosis from entailment and KG signals."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from d2r_edge.hypothesis import HypothesisForm, hypothesis
from d2r_edge.signals import Entailment, FailureType, KGStatus


class Label(str, Enum):
    """FEVER labels, plus the evidence-gated UNVERIFIED that D2R emits for IE/LEM."""

    SUPPORTS = "SUPPORTS"
    REFUTES = "REFUTES"
    NOT_ENOUGH_INFO = "NOT ENOUGH INFO"
    UNVERIFIED = "UNVERIFIED"

    @classmethod
    def parse(cls, value) -> "Label | None":
        if value is None:
            return None
        norm = str(value).strip().upper().replace("_", " ")
        if norm in ("NOTENOUGHINFO", "NEI", "NOT ENOUGH INFO"):
            return cls.NOT_ENOUGH_INFO
        for label in cls:
            if label.value == norm:
                return label
        return None


@dataclass(frozen=True)
class Diagnosis:
    failure: FailureType
    e_q: Entailment
    e_r: Entailment
    kg: KGStatus
    label: Label | None            # the generator's label (fact verification)
    gated_label: Label | None      # UNVERIFIED where Alg. 1 says the label is not evidence-backed
    passage_probs_q: list = field(default_factory=list)   # per passage: {label: prob}
    passage_probs_r: list = field(default_factory=list)

    @property
    def unverified(self) -> bool:
        return self.gated_label is Label.UNVERIFIED


def aggregate_nli(labels: list[Entailment]) -> Entailment:
    """Reference aggregation: all neutral (or none) -> NEUTRAL; any entailment -> ENTAILMENT; else CONTRADICTION."""
    if not labels or all(lab is Entailment.NEUTRAL for lab in labels):
        return Entailment.NEUTRAL
    if Entailment.ENTAILMENT in labels:
        return Entailment.ENTAILMENT
    return Entailment.CONTRADICTION


def label_compatible(label: Label | None, e_q: Entailment) -> bool:
    if label is Label.SUPPORTS and e_q is Entailment.CONTRADICTION:
        return False
    if label is Label.REFUTES and e_q is Entailment.ENTAILMENT:
        return False
    return True


def detect_failure(kg: KGStatus, e_q: Entailment, e_r: Entailment, label: Label | None) -> FailureType:
    """Alg. 1 l.6-18, in order."""
    if kg is KGStatus.CONFLICT:
        return FailureType.WRONG_PREDICATE
    if e_q is Entailment.NEUTRAL:
        return FailureType.INSUFFICIENT_EVIDENCE
    if e_r is not Entailment.ENTAILMENT:
        return FailureType.WRONG_RESPONSE
    if label is not None and not label_compatible(label, e_q):
        return FailureType.LABEL_EVIDENCE_MISMATCH
    return FailureType.NO_FAILURE


GATED = (FailureType.INSUFFICIENT_EVIDENCE, FailureType.LABEL_EVIDENCE_MISMATCH)


class Diagnoser:
    """Runs the signals: 2k NLI pairs in one batched call, then the KG check.

    For QA the response is a short answer; `qa_hypothesis` says how it becomes the
    hypothesis the NLI judges (see d2r_edge/hypothesis.py). FEVER responses are
    evidence sentences and are judged as they are.
    """

    def __init__(self, nli, kg_checker, qa_hypothesis: HypothesisForm = HypothesisForm.STATEMENT) -> None:
        self.nli, self.kg = nli, kg_checker
        self.qa_hypothesis = HypothesisForm(qa_hypothesis)
        self.labels = [Entailment(name.lower()) for name in nli.labels]

    def _states(self, probs: np.ndarray) -> list[Entailment]:
        return [self.labels[int(i)] for i in probs.argmax(axis=1)]

    def diagnose(self, query: str, passages: list[str], response: str, label: Label | None,
                 fact_verification: bool) -> Diagnosis:
        k = len(passages)
        hyp = response or ""
        if not fact_verification:
            hyp = hypothesis(self.qa_hypothesis, query, hyp)
        if k:
            pairs = [(p, query) for p in passages] + [(p, hyp) for p in passages]
            probs = self.nli.score(pairs)
            pq, pr = probs[:k], probs[k:]
        else:
            pq = pr = np.zeros((0, len(self.labels)), dtype=np.float32)
        e_q, e_r = aggregate_nli(self._states(pq)), aggregate_nli(self._states(pr))
        kg = self.kg.check(response).status
        failure = detect_failure(kg, e_q, e_r, label if fact_verification else None)
        gated = label
        if fact_verification and failure in GATED:
            gated = Label.UNVERIFIED
        names = [lab.value for lab in self.labels]
        as_dicts = lambda m: [dict(zip(names, map(float, row))) for row in m]  # noqa: E731
        return Diagnosis(failure, e_q, e_r, kg, label, gated, as_dicts(pq), as_dicts(pr))
