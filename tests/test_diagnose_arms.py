"""Algorithm 1 over every signal combination, the arm registry, the UNVERIFIED rule."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from d2r_edge.diagnose import Diagnoser, Label, aggregate_nli, detect_failure, label_compatible
from d2r_edge.repair import ARMS, IS_RETRIEVAL, PipelineConfig, PromptStyle, allowed_arms
from d2r_edge.retrieval.retriever import RetrieverKind
from d2r_edge.signals import Entailment, FailureType, KGStatus

E, N, C = Entailment.ENTAILMENT, Entailment.NEUTRAL, Entailment.CONTRADICTION


def expected(kg, e_q, e_r, label):
    """Alg. 1 written out independently, line by line."""
    if kg == KGStatus.CONFLICT:
        return FailureType.WRONG_PREDICATE
    if e_q == N:
        return FailureType.INSUFFICIENT_EVIDENCE
    if e_r != E:
        return FailureType.WRONG_RESPONSE
    if label == Label.SUPPORTS and e_q == C:
        return FailureType.LABEL_EVIDENCE_MISMATCH
    if label == Label.REFUTES and e_q == E:
        return FailureType.LABEL_EVIDENCE_MISMATCH
    return FailureType.NO_FAILURE


@pytest.mark.parametrize("kg,e_q,e_r,label", list(itertools.product(
    list(KGStatus), list(Entailment), list(Entailment), [None, *Label])))
def test_algorithm_1_every_combination(kg, e_q, e_r, label):
    assert detect_failure(kg, e_q, e_r, label) is expected(kg, e_q, e_r, label)


def test_aggregate_nli():
    assert aggregate_nli([]) is N
    assert aggregate_nli([N, N]) is N
    assert aggregate_nli([N, C, E]) is E
    assert aggregate_nli([N, C]) is C
    assert aggregate_nli([C]) is C


def test_label_compatibility():
    assert not label_compatible(Label.SUPPORTS, C) and not label_compatible(Label.REFUTES, E)
    assert label_compatible(Label.SUPPORTS, E) and label_compatible(Label.NOT_ENOUGH_INFO, C)
    assert Label.parse("NOTENOUGHINFO") is Label.NOT_ENOUGH_INFO and Label.parse("refutes") is Label.REFUTES
    assert Label.parse("maybe") is None and Label.parse(None) is None


class StubNLI:
    """Label order deliberately not entailment-first: the diagnoser must read it from labels."""

    labels = ["contradiction", "entailment", "neutral"]

    def __init__(self, rows):
        self.rows, self.calls = np.asarray(rows, dtype=np.float32), 0

    def score(self, pairs):
        self.calls += 1
        assert len(pairs) == len(self.rows)
        return self.rows


class StubKG:
    def __init__(self, status):
        self.status = status

    def check(self, response):
        from d2r_edge.kg.check import KGResult

        return KGResult(self.status)


def test_diagnoser_one_batched_call_and_gating():
    # passages x (query, response): query rows neutral -> IE -> UNVERIFIED for FEVER
    rows = [[0, 0, 1], [0, 0, 1], [0, 1, 0], [0, 1, 0]]
    nli = StubNLI(rows)
    d = Diagnoser(nli, StubKG(KGStatus.MISSING)).diagnose("q", ["p1", "p2"], "r", Label.SUPPORTS, True)
    assert nli.calls == 1                      # all 2k pairs in one call
    assert d.failure is FailureType.INSUFFICIENT_EVIDENCE and d.gated_label is Label.UNVERIFIED
    assert d.e_q is N and d.e_r is E and d.passage_probs_q[0]["neutral"] == 1.0
    qa = Diagnoser(StubNLI(rows), StubKG(KGStatus.MISSING)).diagnose("q", ["p1", "p2"], "r", None, False)
    assert qa.failure is FailureType.INSUFFICIENT_EVIDENCE and qa.gated_label is None
    # LEM is gated too; WR is not
    lem = Diagnoser(StubNLI([[0, 1, 0], [0, 1, 0]]), StubKG(KGStatus.CONSISTENT)).diagnose(
        "q", ["p"], "r", Label.REFUTES, True)
    assert lem.failure is FailureType.LABEL_EVIDENCE_MISMATCH and lem.unverified
    wr = Diagnoser(StubNLI([[0, 1, 0], [0, 0, 1]]), StubKG(KGStatus.CONSISTENT)).diagnose(
        "q", ["p"], "r", Label.SUPPORTS, True)
    assert wr.failure is FailureType.WRONG_RESPONSE and wr.gated_label is Label.SUPPORTS


def test_empty_retrieval_is_insufficient_evidence():
    d = Diagnoser(StubNLI(np.zeros((0, 3))), StubKG(KGStatus.NO_TRIPLETS)).diagnose(
        "q", [], "", Label.SUPPORTS, True)
    assert d.failure is FailureType.INSUFFICIENT_EVIDENCE and d.e_q is N and d.e_r is N


def test_arm_registry():
    assert len(ARMS) == 16 and len({a.name for a in ARMS}) == 16
    assert IS_RETRIEVAL.sum() == 10          # the 8 dense/BM25 arms, second_hop, dense_k3
    combos = {(a.kind, a.top_k, a.refresh) for a in ARMS if a.kind is not None}
    assert combos == set(itertools.product([RetrieverKind.DENSE, RetrieverKind.BM25], [10, 20], [False, True])) \
        | {(RetrieverKind.DENSE, 3, False)}
    base = PipelineConfig()
    assert base.retrieval.kind is RetrieverKind.DENSE and base.retrieval.top_k == 5
    assert not base.retrieval.rerank and base.prompt is PromptStyle.SIMPLE
    by = {a.name: a for a in ARMS}
    cfg = by["bm25_k20_refresh"].apply(base)
    assert (cfg.retrieval.kind, cfg.retrieval.top_k, cfg.refresh) == (RetrieverKind.BM25, 20, True)
    assert by["rerank"].apply(base).retrieval.rerank and by["rerank"].apply(base).retrieval.rerank_top_n == 3
    assert by["prompt_simplify"].apply(base).prompt is PromptStyle.SIMPLIFY
    # issue 35's arms: fewer passages (a retrieval arm: it changes the evidence) and the span prompt
    assert by["dense_k3"].apply(base).retrieval.top_k == 3 and by["dense_k3"].is_retrieval
    assert by["prompt_extract"].apply(base).prompt is PromptStyle.EXTRACT and not by["prompt_extract"].is_retrieval
    assert by["prompt_paraphrase"].apply(base).retrieval == base.retrieval
    vote = by["sample_majority"].apply(base)    # the first attempt's config, answered by vote
    assert vote.majority and replace(vote, majority=False) == base and not by["sample_majority"].is_retrieval
    hop = by["second_hop"].apply(base)         # ours: a retrieval change as data, nothing else moves
    assert hop.retrieval == base.retrieval.with_(second_hop=2) and hop.prompt is base.prompt
    assert by["second_hop"].is_retrieval and base.evidence_titles and hop.evidence_titles
    assert base == PipelineConfig()            # applying never mutates the default


def test_unverified_rule():
    # + dense_k3, prompt_extract, sample_majority, reader_span
    assert allowed_arms(True).tolist() == [True] * 8 + [False] * 3 + [True, True, False, False, False]
    assert allowed_arms(False).all()
    assert allowed_arms(True, restrict_unverified=False).all()   # QA (reference HotpotQA scripts)


def test_the_unverified_rule_is_a_setting_of_the_pipeline():
    """Issue 51 §3: --no-unverified-rule lets the prompt arms act on FEVER answers the gate made UNVERIFIED."""
    from types import SimpleNamespace

    from d2r_edge.cli import _settings, build_parser
    from d2r_edge.pipeline import Pipeline
    from d2r_edge.repair import IS_RETRIEVAL
    from d2r_edge.tasks import Task

    unverified = SimpleNamespace(unverified=True)
    rule = Pipeline.allowed(SimpleNamespace(task=Task.FEVER, unverified_rule=True, arms=SimpleNamespace(mask=None)),
                            unverified)
    free = Pipeline.allowed(SimpleNamespace(task=Task.FEVER, unverified_rule=False, arms=SimpleNamespace(mask=None)),
                            unverified)
    assert rule.tolist() == IS_RETRIEVAL.tolist() and free.all()
    base = ["run", "--kb", "k", "--queries", "q.jsonl", "--out", "o.jsonl", "--task", "fever"]
    assert _settings(build_parser().parse_args(base)).unverified_rule is True
    assert _settings(build_parser().parse_args(base + ["--no-unverified-rule"])).unverified_rule is False


def test_qa_hypothesis_forms_reach_the_nli():
    from d2r_edge.hypothesis import HypothesisForm, hypothesis, statement

    assert statement("Which band released Abbey Road?", "The Beatles") == "The Beatles released Abbey Road."
    assert statement("What is the capital of France?", "Paris") == "the capital of France is Paris."
    assert statement("Who directed Jaws?", "Steven Spielberg") == "Steven Spielberg directed Jaws."
    assert statement("Are A and B both poets?", "yes") == 'The answer to "Are A and B both poets?" is yes.'
    assert hypothesis(HypothesisForm.QUESTION_ANSWER, "Who directed Jaws?", "Spielberg") == \
        "Who directed Jaws? Spielberg"
    assert hypothesis(HypothesisForm.STATEMENT, "Who directed Jaws?", "") == ""

    class Recorder:
        labels = ["entailment", "neutral", "contradiction"]

        def __init__(self):
            self.pairs = []

        def score(self, pairs):
            self.pairs.extend(pairs)
            return np.tile(np.array([[1.0, 0, 0]], dtype=np.float32), (len(pairs), 1))

    for form, want in ((HypothesisForm.BARE, "Spielberg"),
                       (HypothesisForm.STATEMENT, "Spielberg directed Jaws.")):
        nli = Recorder()
        Diagnoser(nli, StubKG(KGStatus.MISSING), form).diagnose("Who directed Jaws?", ["p"], "Spielberg", None, False)
        assert nli.pairs == [("p", "Who directed Jaws?"), ("p", want)]
    # FEVER responses are evidence sentences: judged as they are, whatever the QA form
    nli = Recorder()
    Diagnoser(nli, StubKG(KGStatus.MISSING), HypothesisForm.STATEMENT).diagnose(
        "claim", ["p"], "evidence.", Label.SUPPORTS, True)
    assert nli.pairs[1] == ("p", "evidence.")


class HashedNLI:
    """Deterministic, varied probabilities per (premise, hypothesis); counts the pairs it scores."""

    labels = ["contradiction", "entailment", "neutral"]

    def __init__(self):
        self.pairs = 0

    def score(self, pairs):
        from stand_ins import hash_nli_scores

        self.pairs += len(pairs)
        return hash_nli_scores(pairs)


@pytest.mark.parametrize("fv", [True, False])
def test_until_entailed_gives_all_pairs_verdicts_with_fewer_pairs(fv):
    """e_r aggregates "any entailment -> ENTAILMENT": stopping at the first entailing pair changes no verdict,
    and every pair it did score has the probabilities the full scoring gives."""
    from d2r_edge.diagnose import ResponseNLI

    rng = np.random.default_rng(3)
    words = "the old mill bridge was designed by agnes morrow in seventeen ninety seven stone arch river".split()
    saved = scored_all = 0
    for case in range(300):
        k = int(rng.integers(0, 7))
        passages = [" ".join(rng.choice(words, size=int(rng.integers(3, 12)))) for _ in range(k)]
        response = passages[int(rng.integers(k))] if k and rng.random() < 0.5 else " ".join(rng.choice(words, 4))
        label = [None, *Label][int(rng.integers(5))] if fv else None
        full_nli, lazy_nli = HashedNLI(), HashedNLI()
        full = Diagnoser(full_nli, StubKG(KGStatus.MISSING)).diagnose("claim?", passages, response, label, fv)
        lazy = Diagnoser(lazy_nli, StubKG(KGStatus.MISSING), response_nli=ResponseNLI.UNTIL_ENTAILED).diagnose(
            "claim?", passages, response, label, fv)
        assert (lazy.failure, lazy.e_q, lazy.e_r, lazy.kg, lazy.gated_label) == \
            (full.failure, full.e_q, full.e_r, full.kg, full.gated_label), case
        assert lazy.passage_probs_q == full.passage_probs_q
        kept = [i for i, p in enumerate(lazy.passage_probs_r) if p is not None]
        assert all(lazy.passage_probs_r[i] == pytest.approx(full.passage_probs_r[i]) for i in kept)
        assert len(lazy.passage_probs_r) == k and lazy_nli.pairs == k + len(kept) <= full_nli.pairs
        if len(kept) < k:                       # it stopped early: at the one entailing pair it scored
            tops = [max(lazy.passage_probs_r[i], key=lazy.passage_probs_r[i].get) for i in kept]
            assert lazy.e_r is E and tops.count("entailment") == 1
        saved += full_nli.pairs - lazy_nli.pairs
        scored_all += full_nli.pairs
    assert saved > 0.1 * scored_all             # it does save work on this mix


def test_until_entailed_scores_the_extracted_sentence_first():
    from d2r_edge.diagnose import ResponseNLI

    class EntailsOwnSentence(HashedNLI):
        def score(self, pairs):
            self.pairs += len(pairs)
            return np.asarray([[0, 1, 0] if h in p else [0, 0, 1] for p, h in pairs], dtype=np.float32)

    nli = EntailsOwnSentence()
    passages = ["Rivers run.", "Hills rise high.", "The mill stands by the river. It is old.", "Stone."]
    d = Diagnoser(nli, StubKG(KGStatus.MISSING), response_nli=ResponseNLI.UNTIL_ENTAILED).diagnose(
        "Is the mill old?", passages, "The mill stands by the river.", Label.SUPPORTS, True)
    assert nli.pairs == 4 + 1 and d.e_r is E                     # 4 claim pairs, then the source passage only
    assert [p is not None for p in d.passage_probs_r] == [False, False, True, False]


def test_every_prompt_style_has_a_template_for_both_tasks_and_its_reply_parses():
    from d2r_edge.generate.base import parse_output
    from d2r_edge.tasks import Task, build_prompt

    for task in Task:
        for style in PromptStyle:
            p = build_prompt(task, style, "Is {this} a query?", ["T\nsome text {x}", "U\nmore"])
            assert "Is {this} a query?" in p.user and "[2] U\nmore" in p.user and p.system
    # the span prompt's reply, keys in its order
    g = parse_output(Task.FEVER, '{"response": "The Danube empties into the Black Sea.", "label": "REFUTES"}')
    assert g.label is Label.REFUTES and g.response == "The Danube empties into the Black Sea."
    assert parse_output(Task.QA, '{"answer": "Irkutsk"}').response == "Irkutsk"
