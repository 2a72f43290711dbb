"""The doctor's knowledge base and the search function its repairs call."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from d2r_edge.doctor.evaluate import observation_docs
from d2r_edge.doctor.parse import TrajectoryFormat, parse_file
from d2r_edge.eval.querysets import load_queryset
from d2r_edge.retrieval.docs import Document
from d2r_edge.retrieval.retriever import RetrievalConfig, Retriever, evidence_text


def build_doctor_kb(trajectories: list[Path], extra: list[Path], out: Path, embedder,
                    fmt: TrajectoryFormat = TrajectoryFormat.AUTO):
    """Observations of every trajectory + paragraphs of `extra` query files; cached by input hash."""
    from d2r_edge.retrieval.kb import KnowledgeBase

    docs: dict[str, Document] = {}
    for path in trajectories:
        for d in observation_docs(parse_file(path, fmt).trajectories):
            docs.setdefault(d.id, d)
    for path in extra:
        for d in load_queryset(path).documents:
            docs.setdefault(d.id, d)
    return KnowledgeBase.cached(list(docs.values()), out, embedder)


def kb_search(kb, embedder, reranker=None, candidates: int = 10) -> Callable[[str, int], list[str]]:
    """search(query, k): dense top `candidates`, reranked to k when a reranker is loaded."""
    retriever = Retriever(kb, embedder, reranker)

    def search(query: str, k: int) -> list[str]:
        cfg = RetrievalConfig(top_k=max(k, candidates) if reranker else k, rerank=reranker is not None,
                              rerank_top_n=k)
        return [evidence_text(p) for p in retriever.retrieve(query, cfg)]

    return search
