"""One retrieval entry point; the repair arms only change its config."""

from __future__ import annotations

import re
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
    """Reference default: dense, k = 5, no rerank; rerank keeps the top 3 (paper).

    `second_hop`: add up to this many passages whose title the top passage
    names (a multi-hop question's bridge entity: "... directed by Ridley
    Scott" -> the passage titled "Ridley Scott"); 0 = off.
    """

    kind: RetrieverKind = RetrieverKind.DENSE
    top_k: int = 5
    rerank: bool = False
    rerank_top_n: int = 3
    second_hop: int = 0

    def __post_init__(self) -> None:
        coerce_enum(self, "kind", RetrieverKind)
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ConfigError(f"top_k must be an int >= 1, got {self.top_k!r}")
        if not isinstance(self.rerank_top_n, int) or self.rerank_top_n < 1:
            raise ConfigError(f"rerank_top_n must be an int >= 1, got {self.rerank_top_n!r}")
        if not isinstance(self.second_hop, int) or self.second_hop < 0:
            raise ConfigError(f"second_hop must be an int >= 0, got {self.second_hop!r}")

    def with_(self, **changes) -> "RetrievalConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class Passage:
    chunk_id: int
    doc_id: str
    title: str
    text: str
    score: float


def evidence_text(p: Passage, titles: bool = True) -> str:
    """What the generator and the NLI read for one passage: ``title\ntext``.

    The offline NLI and reranker are fine-tuned on premises written this way
    (export/finetune_data.py), and a FEVER evidence sentence often names its
    subject only through the page title ("He was born in 1970."). Serving the
    bare text was a train/serve mismatch: on the 300 held-out FEVER dev claims
    used to design the repairs, per-passage NLI verdicts were right for 58.0%
    of the claims untitled and 67.0% titled. `titles=False` gives the bare text
    (for an NLI trained without titles).
    """
    return f"{p.title}\n{p.text}" if titles and p.title else p.text


def split_evidence(evidence: str) -> tuple[str, str]:
    """`evidence_text`'s inverse for one who gets only the string: (title, text); title "" when none.

    An untitled text may hold line breaks too: a first line that ends like a sentence is text."""
    title, sep, text = evidence.partition("\n")
    if not sep or title.rstrip().endswith((".", "!", "?")):
        return "", evidence
    return title, text


_WORDS = re.compile(r"\S+")
MAX_TITLE_WORDS = 8


class TitleIndex:
    """Title -> first chunk of its document, for the second hop; follows KB refreshes."""

    def __init__(self, kb) -> None:
        self.kb, self.by_title, self.indexed = kb, {}, 0

    def _sync(self) -> None:
        for c in self.kb.chunks[self.indexed:]:
            title = " ".join(str(c.get("title") or "").split())
            if len(title) > 1 and title[0].isupper() and len(title.split()) <= MAX_TITLE_WORDS:
                self.by_title.setdefault(title, int(c["chunk_id"]))
        self.indexed = len(self.kb.chunks)

    def named_in(self, text: str, exclude: set[str], limit: int, have: set[int] = frozenset()) -> list[int]:
        """Up to `limit` chunks of the documents whose exact title occurs in `text`, in order of
        mention, leaving out titles in `exclude` and chunks in `have`; at each position the
        longest title wins ("New York City" over "New York")."""
        self._sync()
        words = [w.strip(".,;:!?\"'()[]") for w in _WORDS.findall(text)]
        out: list[int] = []
        i = 0
        while i < len(words) and len(out) < limit:
            step = 1
            for n in range(min(MAX_TITLE_WORDS, len(words) - i), 0, -1):
                title = " ".join(words[i:i + n])
                cid = self.by_title.get(title)
                if cid is not None:
                    if title not in exclude and cid not in have and cid not in out:
                        out.append(cid)
                    step = n
                    break
            i += step
        return out


class Retriever:
    def __init__(self, kb, embedder, reranker=None) -> None:
        self.kb, self.embedder, self.reranker = kb, embedder, reranker
        self.titles = TitleIndex(kb)

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
        if cfg.second_hop and chunks:
            hops = self.titles.named_in(chunks[0]["text"], {chunks[0]["title"]}, cfg.second_hop,
                                        have={int(c["chunk_id"]) for c in chunks})
            chunks = chunks + [self.kb.chunks[i] for i in hops]
            scores = np.concatenate([np.asarray(scores, dtype=float), np.zeros(len(hops))])
        return [Passage(int(c["chunk_id"]), c["doc_id"], c["title"], c["text"], float(s))
                for c, s in zip(chunks, scores)]
