"""Issue 53: the reader's cloze pretraining set from FEVER train - spans, questions, what it holds out."""

from __future__ import annotations

import pytest

from d2r_edge_export.nli_general import dedupe_key
from d2r_edge_export.reader_cloze import build_cloze, claim_spans, cloze_question, detokenize, shingles, words
from d2r_edge_export.reader_data import find_answer


def test_fever_wiki_text_reads_as_plain_text():
    assert detokenize("Fox -LRB- US -RRB- , inc . is `` big '' ; Dylan 's song .") == \
        'Fox (US), inc. is "big"; Dylan\'s song.'
    assert words("Fox -LRB- US -RRB- , inc .") == words("Fox (US), Inc.") == ["fox", "us", "inc"]
    assert shingles("a b c", n=2) == {"a b", "b c"} and shingles("a b", n=8) == {"a b"}


def test_claim_spans_are_names_and_numbers():
    assert claim_spans("The Walking Dead premiered in 2010.") == ["The Walking Dead", "2010"]
    # a number ends a name, and a name after a year is its own span; "of" joins two capitalized words
    assert claim_spans("Farrah Fawcett acted in the 1997 American drama The Apostle.") == \
        ["Farrah Fawcett", "1997", "American", "The Apostle"]
    assert claim_spans("Apollo 11 landed on the Moon.") == ["Apollo 11", "Moon"]
    assert claim_spans("A Tale of Two Cities was written by Charles Dickens.") == \
        ["A Tale of Two Cities", "Charles Dickens"]
    assert claim_spans("It is the capital of France.") == ["France"]       # "It" names nothing
    assert claim_spans("there is nothing here.") == []


def test_the_question_asks_for_the_span_with_its_wh_word():
    assert cloze_question("Jennifer Grey was born in 1960.", "1960") == "Jennifer Grey was born in what year?"
    assert cloze_question("He has 3 children.", "3") == "He has how many children?"
    assert cloze_question("Paris hosts the French Open.", "Paris") == "What hosts the French Open?"
    assert cloze_question("Romeo met Juliet.", "Rome") is None                    # word boundaries


def _row(claim: str, *evidence: str, label: str = "SUPPORTS") -> dict:
    return {"claim": claim, "label": label, "evidence": list(evidence)}


ROWS = [
    _row("Jennifer Grey was born in 1960.", "Jennifer Grey -LRB- born March 26 , 1960 -RRB- is an American actress ."),
    _row("Paris hosts the French Open.", "Paris hosts the annual French Open tennis tournament ."),
    _row("Mango is the national fruit of India.", "It is the national fruit of India , Pakistan ."),
    _row("Oslo is in Norway.", "Oslo is the capital of Norway ."),
    _row("Rome is in Italy.", "Rome is the capital of Italy ."),
    _row("Lima is in Peru.", "Lima is the capital of Peru .", label="REFUTES"),        # not a SUPPORTS claim
    _row("nothing named here.", "nothing named here either ."),                          # no shared span
]


def test_cloze_examples_point_at_their_answers_and_negatives_lack_them():
    cloze = build_cloze(ROWS, 10, set(), set(), seed=1, negatives=1)
    pos = [e for e in cloze.examples if e.answer_start is not None]
    neg = [e for e in cloze.examples if e.answer_start is None]
    assert len(pos) == 5 == cloze.stats["positives"] and cloze.stats["removed"]["no_shared_span"] == 1
    assert not any("Lima" in e.passage for e in pos)
    for e in pos:
        assert e.passage[e.answer_start:e.answer_start + len(e.answer)] == e.answer
        assert e.answer not in e.question and e.question.endswith("?")
        assert "-LRB-" not in e.passage and " ," not in e.passage
    by_question = {e.question: e.answer for e in pos}
    assert len(neg) == cloze.stats["negatives"] > 0
    for e in neg:
        assert e.answer == "" and find_answer(e.passage, by_question[e.question]) is None


def test_cloze_leaves_out_evaluation_texts_and_sentences_of_held_out_passages():
    evaluation = {dedupe_key("Oslo is in Norway."), dedupe_key("Rome is the capital of Italy .")}
    # the same sentence as the held-out paragraph renders it (a dash, no space before the period)
    blocked = shingles("Paris\nParis is a city. Paris hosts the annual French Open tennis tournament - in May.")
    cloze = build_cloze(ROWS, 10, evaluation, blocked, negatives=0)
    answers = {e.answer for e in cloze.examples}
    assert not answers & {"Oslo", "Norway", "Rome", "Italy", "Paris", "French Open"}
    assert cloze.stats["removed"] == {"claim_in_evaluation": 1, "evidence_in_evaluation": 1,
                                      "evidence_in_blocked_passage": 1, "no_shared_span": 1}
    assert cloze.stats["positives"] == 2


def test_the_reader_s_cloze_set_holds_no_sentence_of_a_held_out_question(shared_data):
    """With HotpotQA excluded, no cloze passage shares a 12-word run with its paragraphs (FEVER and HotpotQA read
    the same Wikipedia introductions, each rendering dashes and quotes its own way: whole-sentence keys let 5 of
    2,000 through)."""
    from d2r_edge_export.reader_cloze import cloze_for_reader
    from d2r_edge_export.reader_data import build_reader_sets

    sets = build_reader_sets(shared_data, ("hotpotqa/dev.jsonl", "hotpotqa_fullwiki/dev.jsonl"))
    before = sets.train_sha256()
    cloze_for_reader(sets, shared_data, 2000)
    held_out = set().union(*(shingles(p, n=12) for p in sets.heldout_passages))
    assert len(held_out) > 100_000
    pos = [e for e in sets.pretrain if e.answer_start is not None]
    assert len(pos) == 2000 and sets.stats["cloze"]["removed"]["evidence_in_blocked_passage"] > 0
    assert not any(shingles(e.passage, n=12) & held_out for e in pos)
    assert sets.train_sha256() != before and "fever_train/train.jsonl.gz" in sets.files_sha256


def test_the_cloze_settings_shape_the_reader_s_key_only_when_on():
    pytest.importorskip("torch")
    from d2r_edge_export.finetune import FinetuneSettings

    off = FinetuneSettings(reader_cloze_examples=0).for_role("reader")
    on = FinetuneSettings(reader_cloze_examples=10).for_role("reader")
    assert not any(k.startswith("reader_cloze_") for k in off)
    assert on["reader_cloze_examples"] == 10 and on["reader_cloze_epochs"] == 1
