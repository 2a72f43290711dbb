"""FEVER-train pairs for the offline NLI: labels, look-alikes, titles, FEVER dev's texts kept out."""

from __future__ import annotations

import gzip
import json

import pytest
from d2r_edge_export.fever_train import CON, ENT, FILE, NEU, build, claim_subject, names
from d2r_edge_export.finetune_data import _qa_rows, _rows, evaluation_texts
from d2r_edge_export.nli_general import dedupe_key

pytestmark = pytest.mark.export


def test_claim_subject_and_naming():
    assert claim_subject("Roald Dahl is a writer.") == "Roald Dahl"
    assert claim_subject("The Walking Dead premiered in 2010.") == "The Walking Dead"
    assert claim_subject("Randy Orton's nickname is The Legend Killer.") == "Randy Orton"
    assert claim_subject("House of Cards is a TV series.") == "House of Cards"
    assert claim_subject("iPhone sales fell.") is None
    assert names("Dahl was born in Wales .", "Roald Dahl") and not names("He was born in Wales .", "Roald Dahl")


@pytest.fixture(scope="module")
def val_texts(shared_data):
    if not (shared_data / FILE).is_file():
        pytest.skip("needs ../shared/data/fever_train")
    return evaluation_texts(_rows(shared_data / "fever" / "dev.jsonl"), _qa_rows(shared_data))


@pytest.fixture(scope="module")
def train_rows(shared_data, val_texts):
    out: dict[str, list[dict]] = {}       # FEVER repeats a claim text under several ids
    with gzip.open(shared_data / FILE, "rt", encoding="utf-8") as fh:
        for r in map(json.loads, fh):
            out.setdefault(r["claim"], []).append(r)
    return out


def test_pairs_follow_the_labels_and_keep_validation_out(shared_data, val_texts, train_rows):
    evidence = {s for rs in train_rows.values() for r in rs for s in r["evidence"]}
    got = build(shared_data, 300, val_texts, titles="subject", max_sentences=2, seed=0)
    assert got.stats["pairs"] == len(got.pairs) == 300
    labels = {lab for *_, lab in got.pairs}
    assert labels == {ENT, NEU, CON}
    for premise, claim, lab in got.pairs:
        rows = train_rows[claim]
        assert dedupe_key(claim) not in val_texts
        title, _, text = premise.partition("\n")
        assert title and text          # subject mode: a title line, then the sentences
        if lab == NEU:
            assert any(r["label"] == "NOT ENOUGH INFO" and not r["evidence"] for r in rows)
            assert text not in {s for r in rows for s in r["evidence"]}      # never the claim's own evidence
            assert text in evidence
        else:
            want = "SUPPORTS" if lab == ENT else "REFUTES"
            assert any(r["label"] == want and text == " ".join(list(dict.fromkeys(r["evidence"]))[:2])
                       for r in rows)
            assert title == claim_subject(claim)
        assert not any(dedupe_key(s) in val_texts for s in [text])
    again = build(shared_data, 300, val_texts, titles="subject", max_sentences=2, seed=0)
    assert again.pairs == got.pairs                           # seeded


def test_title_modes(shared_data, val_texts):
    bare = build(shared_data, 100, val_texts, titles="bare", seed=1)
    assert all("\n" not in p for p, _, _ in bare.pairs)
    drop = build(shared_data, 100, val_texts, titles="drop", seed=1)
    assert all("\n" not in p for p, _, _ in drop.pairs) and drop.stats["removed"]["no_sentence_left"] > 0
