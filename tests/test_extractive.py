"""The extractive generator: answers are sentences of the passages, labels come from the NLI."""

from __future__ import annotations

import numpy as np

from d2r_edge.diagnose import Label
from d2r_edge.generate.extractive import Extractive, sentences
from d2r_edge.repair import PromptStyle
from d2r_edge.tasks import Task

PASSAGES = ["Old Mill Bridge\nThe Old Mill Bridge is a stone arch bridge. It was completed in 1792 by Agnes Morrow.",
            "Glass Hall\nThe Glass Hall is a concert venue."]


class RecordingReranker:
    """Scores a text by whether it holds 'Morrow'; keeps what it was asked."""

    def __init__(self):
        self.seen = []

    def score(self, query, texts):
        self.seen.append(list(texts))
        return np.array([1.0 if "Morrow" in t else 0.0 for t in texts])


class FixedNLI:
    labels = ["entailment", "neutral", "contradiction"]

    def __init__(self, rows):
        self.rows = np.asarray(rows, dtype=np.float32)

    def score(self, pairs):
        return self.rows[: len(pairs)]


def test_qa_answer_is_a_sentence_of_the_text_scored_with_its_title():
    rr = RecordingReranker()
    gen = Extractive(FixedNLI([[1, 0, 0]]), reranker=rr).generate(
        Task.QA, PromptStyle.SIMPLE, "Who designed the Old Mill Bridge?", PASSAGES)
    assert gen.response == "It was completed in 1792 by Agnes Morrow."      # no title line glued on
    assert gen.label is None and "sentence 2 of 3" in gen.raw
    assert rr.seen == [["Old Mill Bridge\nThe Old Mill Bridge is a stone arch bridge.",
                        "Old Mill Bridge\nIt was completed in 1792 by Agnes Morrow.",
                        "Glass Hall\nThe Glass Hall is a concert venue."]]


def test_qa_without_models_uses_word_overlap_and_untitled_passages():
    gen = Extractive(FixedNLI([[1, 0, 0]])).generate(
        Task.QA, PromptStyle.SIMPLE, "Which concert venue?", ["The Glass Hall is a concert venue. It has seats."])
    assert gen.response == "The Glass Hall is a concert venue."
    assert Extractive(FixedNLI([[1, 0, 0]])).generate(Task.QA, PromptStyle.SIMPLE, "q", []).response == ""


def test_fever_label_from_the_nli_and_the_closest_sentence():
    nli = FixedNLI([[0.1, 0.2, 0.7], [0.2, 0.7, 0.1]])        # passage 1 contradicts
    gen = Extractive(nli).generate(Task.FEVER, PromptStyle.SIMPLE, "Agnes Morrow completed it in 1800.", PASSAGES)
    assert gen.label is Label.REFUTES and gen.response == "It was completed in 1792 by Agnes Morrow."
    assert sentences("A. B!  C?") == ["A.", "B!", "C?"]


def test_an_untitled_text_with_line_breaks_keeps_its_first_line():
    """Passages are untitled with `evidence_titles` off or a document without a title: a first line
    ending like a sentence is a candidate answer, not a title."""
    rr = RecordingReranker()
    gen = Extractive(FixedNLI([[1, 0, 0]]), reranker=rr).generate(
        Task.QA, PromptStyle.SIMPLE, "Who built it?", ["Agnes Morrow built it.\nIt has five spans."])
    assert gen.response == "Agnes Morrow built it."
    assert rr.seen == [["Agnes Morrow built it.", "It has five spans."]]
