"""KG check: every status on hand-made triples; the plumbing end to end on the tiny models."""

from __future__ import annotations

import numpy as np
import pytest

from d2r_edge.kg.check import KG_PRESETS, KGChecker, KGThresholds, aggregate
from d2r_edge.kg.store import StoredTriple, TripleStore, build_store
from d2r_edge.onnx.seq2seq import Triple
from d2r_edge.signals import KGStatus


class FakeEmbedder:
    """Hand-placed unit vectors: names that should match share a vector."""

    def __init__(self, table: dict[str, np.ndarray]):
        self.table, self.dim = table, 4

    def encode(self, texts):
        return np.stack([self.table[t] for t in texts]).astype(np.float32)


def _unit(*v):
    a = np.asarray(v, dtype=np.float32)
    return a / np.linalg.norm(a)


E = {
    "Paris": _unit(1, 0, 0, 0), "paris": _unit(1, 0, 0, 0), "Lyon": _unit(0.2, 1, 0, 0),
    "capital of": _unit(0, 0, 1, 0), "capital": _unit(0, 0, 1, 0.05),
    "France": _unit(0, 0, 0, 1), "Spain": _unit(0, 1, 0, -1), "river in": _unit(0, 1, 1, 1),
    "located in": _unit(1, 1, 0, 0),
}


class FakeExtractor:
    def __init__(self, triples):
        self.triples = triples

    def extract(self, texts):
        return [list(self.triples) for _ in texts]


def _checker(response_triples, thresholds=KGThresholds(0.9, 0.9, 0.5)):
    kb = [StoredTriple("Paris", "capital of", "France", 7)]
    store = TripleStore.from_triples(kb, FakeEmbedder(E))
    return KGChecker(store, FakeExtractor(response_triples), FakeEmbedder(E), thresholds)


@pytest.mark.parametrize("triples,status", [
    ([Triple("paris", "capital", "France")], KGStatus.CONSISTENT),
    ([Triple("Paris", "capital of", "Spain")], KGStatus.CONFLICT),      # right s, r; wrong o
    ([Triple("Lyon", "capital of", "France")], KGStatus.MISSING),       # subject unknown
    ([Triple("Paris", "river in", "France")], KGStatus.MISSING),        # relation unknown
    ([Triple("Lyon", "capital of", "France"), Triple("Paris", "capital of", "Spain")], KGStatus.CONFLICT),
    ([Triple("paris", "capital", "France"), Triple("Lyon", "capital of", "France")], KGStatus.MISSING),
    ([], KGStatus.NO_TRIPLETS),
])
def test_statuses(triples, status):
    res = _checker(triples).check("Paris is the capital of France.")
    assert res.status is status
    if triples:
        assert len(res.verdicts) == len(triples)


def test_conflict_verdict_points_at_the_kb_triple():
    v = _checker([Triple("Paris", "capital of", "Spain")]).check("x").verdicts[0]
    assert v.kb_chunk_id == 7 and v.subject_sim > 0.99 and v.object_sim < 0.5


def test_empty_input_and_absent_model(caplog):
    assert _checker([]).check("   ").status is KGStatus.EMPTY_INPUT
    store = TripleStore.from_triples([], FakeEmbedder(E))
    checker = KGChecker(store, None, FakeEmbedder(E), KG_PRESETS["fever"])
    assert checker.check("Paris is in France.").status is KGStatus.NO_TRIPLETS
    assert any("no triples model" in r.getMessage() for r in caplog.records)


def test_thresholds_are_per_task_data():
    # the same triples, CONFLICT under HotpotQA's object threshold, CONSISTENT under FEVER's
    kb = [StoredTriple("Paris", "capital of", "France", 0)]
    emb = dict(E, Francia=_unit(0, 0, 2, 1))   # cosine 0.45 with France
    store = TripleStore.from_triples(kb, FakeEmbedder(emb))
    trip = [Triple("Paris", "capital of", "Francia")]
    fever = KGChecker(store, FakeExtractor(trip), FakeEmbedder(emb), KG_PRESETS["fever"])
    qa = KGChecker(store, FakeExtractor(trip), FakeEmbedder(emb), KG_PRESETS["qa"])
    assert fever.check("x").status is KGStatus.CONSISTENT
    assert qa.check("x").status is KGStatus.CONFLICT
    with pytest.raises(Exception):
        KGThresholds(1.5, 0.9, 0.1)


def test_aggregate_order():
    C, M, K = KGStatus.CONFLICT, KGStatus.MISSING, KGStatus.CONSISTENT
    assert aggregate([K, M, C]) is C and aggregate([K, M]) is M and aggregate([K]) is K


@pytest.mark.export
def test_end_to_end_on_tiny_models(tmp_path, tiny_models, shared_data):
    """Random REBEL: statuses mean nothing, the plumbing (store, resume, check) must work."""
    from d2r_edge.eval.datasets import paragraphs, write_docs
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.onnx.seq2seq import Seq2SeqModel, Triples
    from d2r_edge.retrieval.kb import KnowledgeBase

    manifest = load_manifest(tiny_models)
    emb = Embedder(manifest)
    docs, _ = paragraphs(shared_data / "hotpotqa" / "dev.jsonl", limit=3)
    kb = KnowledgeBase.build(write_docs(docs, tmp_path / "d.jsonl"), tmp_path / "kb", emb)
    tri = Triples(Seq2SeqModel(manifest, allow_random_weights=True))
    # a partial run left behind (one finished chunk and a torn line) is resumed
    (kb.directory / "kg").mkdir()
    (kb.directory / "kg" / "partial.jsonl").write_text(
        '{"chunk_id": 0, "triples": [["A", "r", "B"]]}\n{"chunk_id": 1, "tri')
    store = build_store(kb, tri, emb, batch_chunks=8)
    assert store.triples[0] == StoredTriple("A", "r", "B", 0)
    back = TripleStore.load(kb.directory / "kg")
    assert len(back) == len(store) and back.heads.shape == (len(store), emb.dim)
    res = KGChecker(back, tri, emb, KG_PRESETS["qa"]).check("The old bridge was designed by two architects.")
    assert isinstance(res.status, KGStatus)
