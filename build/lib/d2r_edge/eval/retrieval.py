"""Recall@k of gold evidence for BM25, dense and their union on the shared samples.

FEVER: gold evidence sentences among all dev evidence sentences, with HotpotQA
and MuSiQue paragraphs as distractors; queries are claims with evidence.
HotpotQA: supporting paragraphs among all dev paragraphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from d2r_edge.eval.datasets import (
    GoldQuery,
    fever_evidence,
    musique_paragraphs,
    paragraphs,
    write_docs,
)
from d2r_edge.retrieval.kb import KnowledgeBase
from d2r_edge.retrieval.retriever import Retriever

log = logging.getLogger(__name__)
KS = (5, 10, 20)


@dataclass(frozen=True)
class RecallRow:
    dataset: str
    retriever: str
    n_queries: int
    n_chunks: int
    recall: dict[int, float]


def _doc_ranking(kb: KnowledgeBase, ids: np.ndarray) -> list[str]:
    """Chunk ids -> doc ids in rank order, first occurrence kept."""
    seen, out = set(), []
    for i in ids:
        d = kb.chunks[int(i)]["doc_id"]
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def recall_table(kb: KnowledgeBase, retriever: Retriever, queries: list[GoldQuery],
                 dataset: str) -> list[RecallRow]:
    queries = [q for q in queries if q.gold_doc_ids]
    kmax = max(KS)
    # ask for more chunks than kmax so that kmax distinct documents survive dedup
    depth = 3 * kmax
    vecs = retriever.embedder.encode([q.text for q in queries])
    dense_ids, _ = kb.dense.search(vecs, depth)
    hits = {name: {k: [] for k in KS} for name in ("bm25", "dense", "union")}
    for qi, q in enumerate(queries):
        bm = _doc_ranking(kb, kb.bm25.top_k(q.text, depth)[0])
        de = _doc_ranking(kb, dense_ids[qi])
        for k in KS:
            sets = {"bm25": set(bm[:k]), "dense": set(de[:k]), "union": set(bm[:k]) | set(de[:k])}
            for name, got in sets.items():
                hits[name][k].append(len(got & q.gold_doc_ids) / len(q.gold_doc_ids))
    return [RecallRow(dataset, name, len(queries), len(kb.chunks),
                      {k: float(np.mean(v)) for k, v in per_k.items()})
            for name, per_k in hits.items()]


def build_eval_kbs(data_dir: Path, work: Path, embedder, fever_limit: int | None = None):
    """(fever kb, fever queries), (hotpot kb, hotpot queries), built once in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    fdocs, fq = fever_evidence(data_dir / "fever" / "dev.jsonl", fever_limit)
    hdocs, hq = paragraphs(data_dir / "hotpotqa" / "dev.jsonl")
    mdocs = musique_paragraphs(data_dir / "musique" / "dev.jsonl")
    out = []
    for name, docs, queries in (("fever", fdocs + hdocs + mdocs, fq), ("hotpotqa", hdocs, hq)):
        kb_dir = work / f"kb-{name}"
        try:
            kb = KnowledgeBase.open(kb_dir, embedder)
        except Exception:  # absent or stale: build it
            kb = KnowledgeBase.build(write_docs(docs, work / f"{name}-docs.jsonl"), kb_dir, embedder)
        out.append((name, kb, queries))
    return out


def markdown(rows: list[RecallRow]) -> str:
    lines = ["| dataset | retriever | queries | chunks | " + " | ".join(f"recall@{k}" for k in KS) + " |",
             "|---|---|---|---|" + "---|" * len(KS)]
    for r in rows:
        lines.append(f"| {r.dataset} | {r.retriever} | {r.n_queries} | {r.n_chunks} | "
                     + " | ".join(f"{r.recall[k]:.3f}" for k in KS) + " |")
    return "\n".join(lines)


def evaluate(data_dir: Path, work: Path, embedder, fever_limit: int | None = None) -> str:
    rows = []
    for name, kb, queries in build_eval_kbs(data_dir, work, embedder, fever_limit):
        rows += recall_table(kb, Retriever(kb, embedder), queries, name)
    return markdown(rows)
