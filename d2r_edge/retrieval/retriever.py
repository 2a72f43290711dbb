"""One retrieval entry point; the repair arms only change its config."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from d2r_edge.config import coerce_enum
from d2r_edge.errors import ConfigError


class RetrieverKind(str, Enum):
    DENSE = "dense"
    BM25 = "bm25"


@dataclass(frozen=True)
class RetrievalConfig:
    """Reference default: dense, k = 5, no rerank; rerank keeps the top 3 (paper)."""

    kind: RetrieverKind = RetrieverKind.DENSE
    top_k: int = 5
    rerank: bool = False
    rerank_top_n: int = 3

    def __post_init__(self) -> None:
        coerce_enum(self, "kind", RetrieverKind)
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ConfigError(f"top_k must be an int >= 1, got {self.top_k!r}")
        if not isinstance(self.rerank_top_n, int) or self.rerank_top_n < 1:
            raise ConfigError(f"rerank_top_n must be an int >= 1, got {self.rerank_top_n!r}")

    def with_(self, **changes) -> "RetrievalConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class Passage:
    chunk_id: int
    doc_id: str
    title: str
    text: str
    score: float


class Retriever:
    def __init__(self, kb, embedder, reranker=None) -> None:
        self.kb, self.embedder, self.reranker = kb, embedder, reranker

    def embed(self, query: str) -> np.ndarray:
        return self.embedder.encode([query])[0]

    def candidates(self, query: str, cfg: RetrievalConfig,
                   query_vec: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        if cfg.kind is RetrieverKind.BM25:
            return self.kb.bm25.top_k(query, cfg.top_k)
        vec = self.embed(query) if query_vec is None else query_vec
        ids, sims = self.kb.dense.search(vec, cfg.top_k)
        return ids[0], sims[0]

    def retrieve(self, query: str, cfg: RetrievalConfig = RetrievalConfig(),
                 query_vec: np.ndarray | None = None) -> list[Passage]:
        """Passages for `query`; pass `query_vec` when the caller already embedded it."""
        ids, scores = self.candidates(query, cfg, query_vec)
        chunks = [self.kb.chunks[int(i)] for i in ids]
        if cfg.rerank and chunks:
            if self.reranker is None:
                raise ConfigError("rerank requested but no reranker model is loaded; export the "
                                  "reranker role or turn rerank off")
            rr = self.reranker.score(query, [c["embed_text"] for c in chunks])
            order = np.argsort(-rr, kind="stable")[:cfg.rerank_top_n]
            chunks, scores = [chunks[i] for i in order], rr[order]
        return [Passage(int(c["chunk_id"]), c["doc_id"], c["title"], c["text"], float(s))
                for c, s in zip(chunks, scores)]
