"""The doctor's knowledge base and the search function its repairs call."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from d2r_edge.doctor.evaluate import observation_docs
from d2r_edge.doctor.parse import TrajectoryFormat, parse_file
from d2r_edge.eval.querysets import load_queryset
from d2r_edge.retrieval.retriever import RetrievalConfig, Retriever


def build_doctor_kb(trajectories: list[Path], extra: list[Path], out: Path, embedder,
                    fmt: TrajectoryFormat = TrajectoryFormat.AUTO):
    """Observations of every trajectory + paragraphs of `extra` query files; cached by input hash."""
    from d2r_edge.retrieval.kb import KnowledgeBase

    docs, seen = [], set()
    for path in trajectories:
        for d in observation_docs(parse_file(path, fmt).trajectories):
            if d.id not in seen:
                seen.add(d.id)
                docs.append({"id": d.id, "title": d.title, "text": d.text})
    for path in extra:
        for d in load_queryset(path).documents:
            if d.id not in seen:
                seen.add(d.id)
                docs.append({"id": d.id, "title": d.title, "text": d.text})
    out.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    digest = hashlib.sha256(text.encode()).hexdigest()
    docs_path, stamp, kb_dir = out / "kb-docs.jsonl", out / "kb.input-sha256", out / "kb"
    if stamp.is_file() and stamp.read_text().strip() == digest and (kb_dir / "manifest.json").is_file():
        return KnowledgeBase.open(kb_dir, embedder)
    docs_path.write_text(text, encoding="utf-8")
    kb = KnowledgeBase.build(docs_path, kb_dir, embedder)
    stamp.write_text(digest + "\n")
    return kb


def kb_search(kb, embedder, reranker=None, candidates: int = 10) -> Callable[[str, int], list[str]]:
    """search(query, k): dense top `candidates`, reranked to k when a reranker is loaded."""
    retriever = Retriever(kb, embedder, reranker)

    def search(query: str, k: int) -> list[str]:
        cfg = RetrievalConfig(top_k=max(k, candidates) if reranker else k, rerank=reranker is not None,
                              rerank_top_n=k)
        return [f"{p.title}\n{p.text}" if p.title else p.text for p in retriever.retrieve(query, cfg)]

    return search
