"""General NLI pairs: held out by source, deduplicated against the validation split, filterable."""

from __future__ import annotations

import gzip
import json

import pytest
from d2r_edge_export.nli_general import HELDOUT_PAIRS_PER_GROUP, dedupe_key, load_general, parse_sources

from d2r_edge.errors import ExportError


def _write(tmp_path, rows):
    (tmp_path / "nli").mkdir(parents=True)
    with gzip.open(tmp_path / "nli" / "train.jsonl.gz", "wt") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return tmp_path


def _row(p, h, lab="entailment", src="snli_dev"):
    return {"premise": p, "hypothesis": h, "label": lab, "source": src}


def test_heldout_premises_never_train_and_validation_texts_are_removed(tmp_path):
    rows = [_row(f"mnli premise {i // 3}", f"hyp {i}", "neutral", "mnli_dev_taxinli") for i in range(3300)]
    rows += [_row(f"anli premise {i}", f"anli hyp {i}", "contradiction", "anli_r2_dev") for i in range(1500)]
    rows += [_row("A dog runs.", "An animal moves.", src="sick"),
             _row("Some premise.", "The Eiffel Tower is in Paris!", src="snli_dev"),   # = a validation claim
             _row("Paris is the capital of France", "It is a city.", src="snli_test")]   # = validation evidence
    data = _write(tmp_path, rows)
    val = {dedupe_key("the eiffel tower is in  Paris."), dedupe_key("Paris is the capital of France.")}
    g = load_general(data, val)
    assert {k: len(v) for k, v in g.heldout.items()} == {"mnli_dev": 1002, "anli_dev": 1000}  # whole premises
    held_premises = {p for rows_ in g.heldout.values() for p, _, _ in rows_}
    assert not held_premises & {p for p, _, _ in g.train}
    assert g.stats["removed_matching_validation"] == 2
    assert ("A dog runs.", "An animal moves.", 0) in g.train
    assert len(g.train) == len(rows) - 2002 - 2 and g.stats["train_pairs"] == len(g.train)
    assert {lab for _, _, lab in g.heldout["anli_dev"]} == {2}
    # the held-out choice does not depend on the row order of the file
    again = load_general(_write(tmp_path / "b", rows[::-1]), val)
    assert sorted(again.heldout["mnli_dev"]) == sorted(g.heldout["mnli_dev"])


def test_sources_filter_and_errors(tmp_path):
    rows = [_row("p1", "h1", src="sick"), _row("p2", "h2", src="snli_dev"),
            _row("p3", "h3", src="breaking_nli", lab="contradiction")]
    data = _write(tmp_path, rows)
    assert [p for p, _, _ in load_general(data, set(), "all,-sick").train] == ["p2", "p3"]
    only = load_general(data, set(), "sick,breaking_nli")
    assert [p for p, _, _ in only.train] == ["p1", "p3"] and only.stats["left_out_by_source_filter"] == 1
    assert parse_sources("all") is None and parse_sources(" all ") is None
    with pytest.raises(ExportError, match="unknown NLI source"):
        load_general(data, set(), "all,-nope_nope")
    with pytest.raises(ExportError, match="empty"):
        parse_sources(" , ")
    with pytest.raises(ExportError, match="nli_general_epochs=0"):
        load_general(tmp_path / "missing", set())
    assert HELDOUT_PAIRS_PER_GROUP == 1000


def test_real_file_heldout_and_dedupe(shared_data):
    from d2r_edge_export.finetune_data import build_pairs

    if not (shared_data / "nli" / "train.jsonl.gz").is_file():
        pytest.skip("no general NLI file in the shared data")
    sets = build_pairs(shared_data, general_sources="all")
    g = sets.general
    assert g.stats["rows"] == 94854 and {k: len(v) for k, v in g.heldout.items()} == {"mnli_dev": 1000,
                                                                                    "anli_dev": 1000}
    heldout = {(p, h) for rows in g.heldout.values() for p, h, _ in rows}
    assert not heldout & {(p, h) for p, h, _ in g.train}
    val = {dedupe_key(h) for _, h, _ in sets.nli_val}
    assert not val & {dedupe_key(h) for _, h, _ in g.train}


def test_a_slice_samples_across_sources(tmp_path):
    rows = [_row(f"p{i}", f"h{i}", src="sick") for i in range(50)] + [_row(f"q{i}", f"g{i}", src="snli_dev")
                                                                       for i in range(50)]
    g = load_general(_write(tmp_path, rows), set(), max_pairs=20)
    assert len(g.train) == 20 and {p[0] for p, _, _ in g.train} == {"p", "q"}
    assert g.train == load_general(_write(tmp_path / "b", rows), set(), max_pairs=20).train   # seeded
