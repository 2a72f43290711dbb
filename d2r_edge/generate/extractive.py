"""A generator with no LLM: labels from NLI over the evidence, answers are extracted sentences.

For offline use and as a baseline. Prompt styles do not change what it
does (it has no prompt), so the two prompt arms are no-ops with it.
"""

from __future__ import annotations

import re

import numpy as np

from d2r_edge.diagnose import Label, aggregate_nli, shared_words
from d2r_edge.generate.base import Generation
from d2r_edge.repair import PromptStyle
from d2r_edge.retrieval.retriever import split_evidence
from d2r_edge.signals import Entailment
from d2r_edge.tasks import Task

_SENT = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENT.split(text) if s.strip()]


class Extractive:
    name = "extractive"
    prompt_sensitive = False   # no prompt: the two prompt arms reproduce the default attempt

    def __init__(self, nli, reranker=None, embedder=None) -> None:
        self.nli, self.reranker, self.embedder = nli, reranker, embedder
        self.labels = [Entailment(n.lower()) for n in nli.labels]

    def generate(self, task: Task, style: PromptStyle, query: str, passages: list[str],
                 sample: bool = True) -> Generation:
        if task.fact_verification:
            return self._verify(query, passages)
        return self._answer(query, passages)

    def _verify(self, claim: str, passages: list[str]) -> Generation:
        if not passages:
            return Generation("", Label.NOT_ENOUGH_INFO, "extractive: no passages")
        probs = self.nli.score([(p, claim) for p in passages])
        states = [self.labels[int(i)] for i in probs.argmax(axis=1)]
        agg = aggregate_nli(states)
        label = {Entailment.ENTAILMENT: Label.SUPPORTS, Entailment.CONTRADICTION: Label.REFUTES,
                 Entailment.NEUTRAL: Label.NOT_ENOUGH_INFO}[agg]
        best = int(np.argmax(probs[:, self.labels.index(agg)]))
        sents = sentences(passages[best]) or [passages[best]]
        response = max(sents, key=lambda s: shared_words(s, claim))
        return Generation(response, label, f"extractive: {agg.value} from passage {best + 1}")

    def _answer(self, question: str, passages: list[str]) -> Generation:
        # a passage is "title\ntext" (retriever.evidence_text): the answer is a sentence of the
        # text, scored with its title line as the reranker was trained ("It was completed by ...")
        sents, scored = [], []
        for p in passages:
            title, body = split_evidence(p)
            for s in sentences(body):
                sents.append(s)
                scored.append(f"{title}\n{s}" if title else s)
        if not sents:
            return Generation("", None, "extractive: no passages")
        if self.reranker is not None:
            scores = self.reranker.score(question, scored)
        elif self.embedder is not None:
            v = self.embedder.encode([question] + scored)
            scores = v[1:] @ v[0]
        else:
            scores = np.array([shared_words(s, question) for s in scored])
        best = int(np.argmax(scores))
        return Generation(sents[best], None, f"extractive: sentence {best + 1} of {len(sents)}")
