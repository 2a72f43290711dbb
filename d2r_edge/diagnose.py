"""Algorithm 1: failure diagnosis from entailment and KG signals."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from d2r_edge.consistency import signals as consistency_signals
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
    passage_probs_r: list = field(default_factory=list)   # ... None where ResponseNLI.UNTIL_ENTAILED skipped it
    consistency: dict | None = None   # self-consistency signals (d2r_edge.consistency); None: no samples
    reader: dict | None = None        # QA: the reader's span of the passages (Span.to_json + its seconds)

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


class ResponseNLI(str, Enum):
    """Which (passage, response) pairs e_r scores. Both give the same e_r, so the same Alg. 1 verdict:
    the aggregation is "any entailment -> ENTAILMENT", so once one pair entails, the rest cannot change it."""

    ALL = "all"                        # every pair: records hold every passage's probabilities (eval, detector)
    UNTIL_ENTAILED = "until_entailed"  # passages sharing most words with the response first; stop at an entailment


_WORD = re.compile(r"\w+")


def shared_words(text: str, target: str) -> float:
    """Share of `target`'s words that occur in `text` (a sentence extracted from a passage: 1.0)."""
    wt = set(_WORD.findall(target.lower()))
    return len(wt & set(_WORD.findall(text.lower()))) / max(1, len(wt))


class Diagnoser:
    """Runs the signals: the k (passage, query) NLI pairs and the (passage, response) pairs `response_nli`
    asks for (ALL: all 2k in one batched call; UNTIL_ENTAILED: the k, then one at a time), then the KG check.

    For QA the response is a short answer; `qa_hypothesis` says how it becomes the
    hypothesis the NLI judges (see d2r_edge/hypothesis.py). FEVER responses are
    evidence sentences and are judged as they are.
    """

    def __init__(self, nli, kg_checker, qa_hypothesis: HypothesisForm = HypothesisForm.STATEMENT,
                 response_nli: ResponseNLI = ResponseNLI.ALL, reader=None) -> None:
        self.nli, self.kg = nli, kg_checker
        self.reader = reader          # QA: an independent extractive reader (onnx.encoders.Reader), or None
        self.qa_hypothesis = HypothesisForm(qa_hypothesis)
        self.response_nli = ResponseNLI(response_nli)
        self.labels = [Entailment(name.lower()) for name in nli.labels]

    def _states(self, probs: np.ndarray) -> list[Entailment]:
        return [self.labels[int(i)] for i in probs.argmax(axis=1)]

    def diagnose(self, query: str, passages: list[str], response: str, label: Label | None,
                 fact_verification: bool, samples: tuple[str, ...] | None = None,
                 read: dict | None = None) -> Diagnosis:
        """Alg. 1's verdict; with the generator's `samples`, the self-consistency signals too. `read`: the
        reader's span of these same passages for this query, already read (an arm that re-answers on the
        first attempt's passages): kept, not read again."""
        k = len(passages)
        hyp = response or ""
        if not fact_verification:
            hyp = hypothesis(self.qa_hypothesis, query, hyp)
        if k and self.response_nli is ResponseNLI.ALL:
            probs = self.nli.score([(p, query) for p in passages] + [(p, hyp) for p in passages])
            pq, pr = probs[:k], probs[k:]
        elif k:
            pq, pr = self.nli.score([(p, query) for p in passages]), self._until_entailed(passages, hyp)
        else:
            pq = pr = np.zeros((0, len(self.labels)), dtype=np.float32)
        scored = ~np.isnan(pr).any(axis=1)
        e_q, e_r = aggregate_nli(self._states(pq)), aggregate_nli(self._states(pr[scored]))
        kg = self.kg.check(response).status
        failure = detect_failure(kg, e_q, e_r, label if fact_verification else None)
        gated = label
        if fact_verification and failure in GATED:
            gated = Label.UNVERIFIED
        names = [lab.value for lab in self.labels]
        as_dicts = lambda m: [None if np.isnan(row).any() else dict(zip(names, map(float, row)))  # noqa: E731
                              for row in m]
        greedy = (label.value if label is not None else "NOT ENOUGH INFO") if fact_verification else response
        sc = consistency_signals(query, greedy, samples, fact_verification, self.nli) if samples else None
        return Diagnosis(failure, e_q, e_r, kg, label, gated, as_dicts(pq), as_dicts(pr), sc,
                         None if fact_verification else (read if read is not None else self._read(query, passages)))

    def _read(self, query: str, passages: list[str]) -> dict | None:
        """The reader's answer to the query from the passages, what it took; None without a reader."""
        if self.reader is None:
            return None
        t0 = time.perf_counter()
        span = self.reader.read(query, passages)
        return None if span is None else {**span.to_json(), "seconds": time.perf_counter() - t0}

    def _until_entailed(self, passages: list[str], hyp: str) -> np.ndarray:
        """(passage, response) probabilities, NaN rows for the pairs not scored: one pair at a time, the
        passages that share most words with the response first (ties in retrieval order), until one
        entails. On a CPU a pair costs the same alone or batched; on a GPU, ResponseNLI.ALL batches."""
        out = np.full((len(passages), len(self.labels)), np.nan, dtype=np.float32)
        entail = self.labels.index(Entailment.ENTAILMENT) if Entailment.ENTAILMENT in self.labels else -1
        for i in sorted(range(len(passages)), key=lambda i: -shared_words(passages[i], hyp)):
            out[i] = self.nli.score([(passages[i], hyp)])[0]
            if int(out[i].argmax()) == entail:
                break
        return out
