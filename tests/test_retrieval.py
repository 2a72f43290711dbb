"""Chunking, BM25 (parity with rank-bm25), HNSW vs exact, the KB store and its refresh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from d2r_edge.errors import ConfigError, InputError
from d2r_edge.eval.datasets import paragraphs, write_docs
from d2r_edge.onnx.encoders import CrossEncoder, Embedder
from d2r_edge.onnx.manifest import load_manifest
from d2r_edge.retrieval.bm25 import BM25Index, tokenize
from d2r_edge.retrieval.chunker import ChunkConfig, Chunker
from d2r_edge.retrieval.dense import DenseIndex, HNSWConfig, exact_top_k
from d2r_edge.retrieval.docs import Document, read_documents
from d2r_edge.retrieval.kb import KBConfig, KBError, KBModelMismatchError, KnowledgeBase, PoolRefresh
from d2r_edge.retrieval.retriever import RetrievalConfig, Retriever, RetrieverKind

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def embedder(tiny_models):
    return Embedder(load_manifest(tiny_models))


@pytest.fixture(scope="module")
def hotpot(shared_data):
    return paragraphs(shared_data / "hotpotqa" / "dev.jsonl")


def test_chunker_windows_and_spans(embedder):
    chunker = Chunker(embedder.tokenizer, ChunkConfig(chunk_tokens=128, overlap_tokens=16))
    text = " ".join(f"word{i}" for i in range(400))
    chunks = chunker.chunk("d", text)
    ntok = [len(chunker.tok.encode(c.text, add_special_tokens=False).ids) for c in chunks]
    assert all(n <= 128 for n in ntok) and ntok[0] == 128
    for c in chunks:
        assert text[c.start_char:c.end_char] == c.text
    # consecutive windows share 16 tokens
    a = chunker.tok.encode(chunks[0].text, add_special_tokens=False).ids
    b = chunker.tok.encode(chunks[1].text, add_special_tokens=False).ids
    assert a[-16:] == b[:16]
    assert chunker.chunk("e", "   ") == []
    with pytest.raises(ConfigError):
        ChunkConfig(chunk_tokens=16, overlap_tokens=16)


def test_bm25_matches_rank_bm25(hotpot):
    from rank_bm25 import BM25Okapi

    docs, queries = hotpot
    texts = [d.indexed_text for d in docs]
    ours = BM25Index()
    ours.add(texts[:1000])
    ours.add(texts[1000:])          # incremental add gives the same index as one build
    ref = BM25Okapi([tokenize(t) for t in texts])
    for q in queries[:60]:
        want = ref.get_scores(tokenize(q.text))
        got = ours.scores(q.text)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-4)
        ids, scores = ours.top_k(q.text, 10)
        # same top-10 under the same tokenization (ties may order either way)
        assert np.allclose(np.sort(want)[::-1][:10], want[ids], rtol=1e-5, atol=1e-4)


def test_bm25_persistence(tmp_path, hotpot):
    docs, queries = hotpot
    idx = BM25Index()
    idx.add([d.indexed_text for d in docs[:300]])
    idx.save(tmp_path / "b.npz")
    back = BM25Index.load(tmp_path / "b.npz")
    assert np.array_equal(back.scores(queries[0].text), idx.scores(queries[0].text))
    assert BM25Index().top_k("anything", 5)[0].size == 0


def test_hnsw_recall_against_exact(embedder, hotpot):
    docs, queries = hotpot
    vecs = embedder.encode([d.indexed_text for d in docs[:1500]])
    dense = DenseIndex(vecs.shape[1], HNSWConfig(exact_below_chunks=100))
    dense.add(vecs[:1000])
    dense.add(vecs[1000:])           # resize + add_items
    assert dense.index is not None and dense.n == 1500
    q = embedder.encode([x.text for x in queries[:100]])
    got, _ = dense.search(q, 10)
    want, _ = exact_top_k(vecs, q, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, want)])
    assert recall >= 0.98, recall


def _kb(tmp_path, embedder, docs, **cfg) -> KnowledgeBase:
    path = write_docs(docs, tmp_path / "docs.jsonl")
    return KnowledgeBase.build(path, tmp_path / "kb", embedder, KBConfig(**cfg))


def test_kb_build_open_retrieve_and_refresh(tmp_path, embedder, tiny_models, hotpot):
    docs, queries = hotpot
    kb = _kb(tmp_path, embedder, docs[:400])
    assert kb.stats()["n_docs"] == 400 and kb.version == 1
    kb = KnowledgeBase.open(tmp_path / "kb", embedder)
    ce = CrossEncoder(load_manifest(tiny_models), allow_random_weights=True)
    r = Retriever(kb, embedder, ce)
    q = queries[0].text
    assert len(r.retrieve(q, RetrievalConfig(kind=RetrieverKind.DENSE, top_k=10))) == 10
    assert len(r.retrieve(q, RetrievalConfig(kind="bm25", top_k=20))) == 20
    reranked = r.retrieve(q, RetrievalConfig(top_k=10, rerank=True))
    assert len(reranked) == 3
    with pytest.raises(ConfigError, match="reranker"):
        Retriever(kb, embedder).retrieve(q, RetrievalConfig(rerank=True))
    # add + refresh: new documents become retrievable, version bumps, queue consumed
    new = [Document("fresh-1", "Zorblatt Festival", "The Zorblatt Festival is held every June in Quenwick.")]
    write_docs(new, tmp_path / "new.jsonl")
    assert kb.queue(tmp_path / "new.jsonl") == 1
    assert kb.stats()["queued"] == 1
    assert kb.refresh(embedder, persist=True) == 1
    kb = KnowledgeBase.open(tmp_path / "kb", embedder)
    assert kb.version == 2 and kb.stats()["queued"] == 0 and kb.stats()["delta_shards"] == 1
    hits = Retriever(kb, embedder).retrieve("When is the Zorblatt Festival held?", RetrievalConfig(top_k=1))
    assert hits[0].doc_id == "fresh-1"
    assert Retriever(kb, embedder).retrieve("Zorblatt Quenwick", RetrievalConfig(kind="bm25"))[0].doc_id == "fresh-1"
    with pytest.raises(InputError, match="duplicate"):
        kb.queue(tmp_path / "new.jsonl")   # already in the KB


def test_kb_refuses_other_embedder(tmp_path, embedder, tiny_models, hotpot):
    from d2r_edge.onnx.manifest import Variant

    _kb(tmp_path, embedder, hotpot[0][:50])
    fp32 = Embedder(load_manifest(tiny_models), variant=Variant.FP32)
    with pytest.raises(KBModelMismatchError, match="rebuild"):
        KnowledgeBase.open(tmp_path / "kb", fp32)


def test_bad_document_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InputError, match="no usable document"):
        read_documents(empty)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"id": "a", "text": "z"}\n')
    with pytest.raises(InputError, match=r"'a' on line 3 \(first: line 1\)"):
        read_documents(dup)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"id": "a", "text": "fine"}\n{not json\n["list"]\n{"id": "e", "text": ""}\n'
                     '{"id": "b", "text": "also fine", "source": "kept"}\n')
    rep = read_documents(mixed)
    assert [d.id for d in rep.documents] == ["a", "b"]
    assert [n for n, _ in rep.bad_lines] == [2, 3] and rep.empty_texts == [4]
    assert rep.documents[1].metadata == {"source": "kept"}


def test_huge_document_is_chunked(tmp_path, embedder):
    text = " ".join(f"token{i % 977} filler" for i in range(30_000))
    kb = _kb(tmp_path, embedder, [Document("huge", "Huge", text)])
    assert kb.stats()["n_chunks"] > 100
    assert all(c["doc_id"] == "huge" for c in kb.chunks)


_BUILD = """
import sys
from d2r_edge.onnx.encoders import Embedder
from d2r_edge.onnx.manifest import load_manifest
from d2r_edge.retrieval.kb import KBConfig, KnowledgeBase
emb = Embedder(load_manifest(sys.argv[1]))
KnowledgeBase.build(sys.argv[2], sys.argv[3], emb, KBConfig(shard_chunks=64))
print("built")
"""


def test_kill_during_build_then_rerun(tmp_path, tiny_models, embedder, hotpot):
    docs = write_docs(hotpot[0][:600], tmp_path / "docs.jsonl")
    kb_dir = tmp_path / "kb"
    shards = tmp_path / "kb.partial" / "shards"
    proc = subprocess.Popen([sys.executable, "-c", _BUILD, str(tiny_models), str(docs), str(kb_dir)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not (shards.is_dir() and len(list(shards.glob("emb-*.npy"))) >= 2):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not kb_dir.exists()                       # never a half-written KB
    done_before = len(list(shards.glob("emb-*.npy")))
    assert done_before >= 2
    kb = KnowledgeBase.build(docs, kb_dir, embedder, KBConfig(shard_chunks=64))  # resumes
    assert not (tmp_path / "kb.partial").exists()
    clean = KnowledgeBase.build(docs, tmp_path / "kb2", embedder, KBConfig(shard_chunks=64))
    assert np.allclose(kb.dense.vectors, clean.dense.vectors, atol=1e-6)
    assert KnowledgeBase.open(kb_dir, embedder).stats()["n_chunks"] == clean.stats()["n_chunks"]


def test_pool_refresh_is_seeded_and_consumes_the_pool():
    pool = [Document(f"p{i}", "", f"passage {i}") for i in range(250)]
    a, b = PoolRefresh(pool, seed=3), PoolRefresh(pool, seed=3)
    draws_a = [len(a.draw()) for _ in range(8)]
    assert draws_a == [len(b.draw()) for _ in range(8)]
    assert set(draws_a) <= {0, 100, 50} and sum(draws_a) <= 250
    always = PoolRefresh(pool, probability=1.0)
    assert [d.id for d in always.draw()][:2] == ["p0", "p1"] and always.draw()[0].id == "p100"
    assert PoolRefresh(pool, probability=0.0).draw() == []


def test_second_hop_adds_the_passages_the_top_passage_names(tmp_path, embedder):
    docs = [
        Document("h", "The Quiet Harbor", "The Quiet Harbor is a 1994 film directed by Mara Ellison and shot "
                                          "in Port Vell, with music by Mara Ellison."),
        Document("m", "Mara Ellison", "Mara Ellison is a film director born in Cork in 1958."),
        Document("pv", "Port Vell", "Port Vell is the old harbour of a coastal city."),
        Document("p", "Port", "A port is a place where ships load and unload."),
        Document("x", "Granite", "Granite is a coarse-grained igneous rock."),
    ]
    kb = _kb(tmp_path, embedder, docs)
    r = Retriever(kb, embedder)
    q = "Quiet Harbor 1994 film"
    top = r.retrieve(q, RetrievalConfig(kind="bm25", top_k=1))
    assert [p.doc_id for p in top] == ["h"]
    two = r.retrieve(q, RetrievalConfig(kind="bm25", top_k=1, second_hop=2))
    # in order of mention, once each, the longest title ("Port Vell", not "Port"), never the top passage's own
    assert [p.doc_id for p in two] == ["h", "m", "pv"] and two[1].title == "Mara Ellison"
    assert [p.doc_id for p in r.retrieve(q, RetrievalConfig(kind="bm25", top_k=1, second_hop=1))] == ["h", "m"]
    # a named passage already retrieved is not added twice; the hop fills up with the next one
    have = r.retrieve(q, RetrievalConfig(kind="bm25", top_k=2, second_hop=1))
    assert len({p.doc_id for p in have}) == len(have) == 3 and have[0].doc_id == "h"
    with pytest.raises(ConfigError, match="second_hop"):
        RetrievalConfig(second_hop=-1)
    # documents added by a refresh can be hopped to
    write_docs([Document("c", "Cork", "Cork is a city in the south of Ireland.")], tmp_path / "new.jsonl")
    kb.queue(tmp_path / "new.jsonl")
    kb.refresh(embedder)
    m = r.retrieve("Mara Ellison film director born", RetrievalConfig(kind="bm25", top_k=1, second_hop=1))
    assert [p.doc_id for p in m] == ["m", "c"]


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_refresh_is_append_only_and_a_run_never_writes_the_kb(tmp_path, embedder, hotpot, monkeypatch):
    """Issue 27.5: the refresh arm ingests in memory at the cost of the new documents (no
    recalibration, no rewrite of the KB's files); `index refresh` appends a delta shard and
    bumps the manifest, leaving the base files (and the KG store) as they were."""
    docs, _ = hotpot
    kb = _kb(tmp_path, embedder, docs[:300], hnsw=HNSWConfig(exact_below_chunks=100))
    assert kb.dense.index is not None
    (tmp_path / "kb" / "kg").mkdir()
    (tmp_path / "kb" / "kg" / "triples.jsonl").write_text("{}\n")
    before = _files(tmp_path / "kb")
    calls = []
    monkeypatch.setattr(DenseIndex, "calibrate", lambda self, *a, **k: calls.append(1) or 1.0)
    new = [Document(f"fresh-{i}", f"Zorblatt {i}", f"The Zorblatt Festival number {i} is held in Quenwick.")
           for i in range(3)]
    kb.queue(write_docs(new[:1], tmp_path / "q.jsonl"))
    queued = _files(tmp_path / "kb")
    # in memory (the refresh arm of a run): the KB on disk is untouched, the memory sees the docs
    assert kb.refresh(embedder, extra=new[1:2]) == 2 and kb.session_docs == 2 and not calls
    assert _files(tmp_path / "kb") == queued
    hits = Retriever(kb, embedder).retrieve("Zorblatt Quenwick", RetrievalConfig(kind="bm25", top_k=2))
    assert {h.doc_id for h in hits} == {"fresh-0", "fresh-1"}
    assert kb.refresh(embedder, extra=new[1:2]) == 0            # already in: nothing twice
    with pytest.raises(KBError, match="in memory"):
        kb.refresh(embedder, extra=new[2:], persist=True)
    # persisted (`index refresh`): a delta shard and the manifest; base files and kg/ unchanged
    kb = KnowledgeBase.open(tmp_path / "kb", embedder)
    calls.clear()
    assert kb.refresh(embedder, extra=new[2:], persist=True) == 2 and not calls
    after = _files(tmp_path / "kb")
    changed = {k for k in before if before[k] != after.get(k)}
    assert changed == {"manifest.json"}, changed
    assert {k for k in after if k.startswith("deltas/")} == {"deltas/000002/chunks.jsonl", "deltas/000002/docs.jsonl",
                                                             "deltas/000002/embeddings.npy"}
    monkeypatch.undo()
    again = KnowledgeBase.open(tmp_path / "kb", embedder)
    assert again.version == 2 and len(again.chunks) == len(kb.chunks) and again.dense.n == again.bm25.n_docs
    assert {"fresh-0", "fresh-2"} <= again.doc_ids
    # compaction folds the delta into the base files and keeps the KG store
    again.compact()
    done = KnowledgeBase.open(tmp_path / "kb", embedder)
    assert done.stats()["delta_shards"] == 0 and len(done.chunks) == len(kb.chunks)
    assert (tmp_path / "kb" / "kg" / "triples.jsonl").is_file()
    q = "Zorblatt Festival number 2 Quenwick"
    assert (Retriever(done, embedder).retrieve(q, RetrievalConfig(kind="bm25"))[0].doc_id
            == Retriever(again, embedder).retrieve(q, RetrievalConfig(kind="bm25"))[0].doc_id == "fresh-2")


def test_the_distractor_paragraphs_are_distinct_and_reproducible(shared_data, tmp_path):
    """`d2r-edge eval distractors`: the FEVER evaluations' --extra-docs, written the same way each time."""
    import json

    from d2r_edge.cli import main
    from d2r_edge.eval.datasets import distractors

    docs = distractors(shared_data)
    assert len({d.text for d in docs}) == len(docs) > 1000
    assert [d.id for d in docs] == [f"qa:{i}" for i in range(len(docs))] and all(d.text.strip() for d in docs)
    out = tmp_path / "d.jsonl"
    assert main(["eval", "distractors", "--data", str(shared_data), "--out", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows == [{"id": d.id, "title": d.title, "text": d.text} for d in docs]
