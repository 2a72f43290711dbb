"""Loaders for the shared data layouts (FEVER, HotpotQA, MuSiQue, 2Wiki) as KB documents."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from d2r_edge.jsonl import loads as json_line
from d2r_edge.retrieval.docs import Document


def _jsonl(path: Path, limit: int | None = None):
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                return
            if line.strip():
                yield json_line(line)


# FEVER escapes brackets and colons in page titles
_TITLE_ESCAPES = {"-LRB-": "(", "-RRB-": ")", "-LSB-": "[", "-RSB-": "]", "-LCB-": "{", "-RCB-": "}",
                  "-COLON-": ":"}


def fever_title(page: str) -> str:
    """'Psych_-LRB-season_2-RRB-' -> 'Psych (season 2)', as the page is titled on Wikipedia.

    The offline NLI and reranker are trained on passages titled this way
    (export/finetune_data.py), so the knowledge base titles them the same.
    """
    for k, v in _TITLE_ESCAPES.items():
        page = page.replace(k, v)
    return page.replace("_", " ")


@dataclass(frozen=True)
class GoldQuery:
    id: str
    text: str
    gold_doc_ids: frozenset[str]
    label: str | None = None
    answer: str | None = None


def fever_evidence(path: Path, limit: int | None = None) -> tuple[list[Document], list[GoldQuery]]:
    """Each gold evidence sentence becomes a document `<page>#<sentence>`; claims become queries."""
    docs: dict[str, Document] = {}
    queries = []
    for row in _jsonl(path, limit):
        gold = set()
        for page, sent_id, text in row.get("derived_evidence_sentences") or []:
            doc_id = f"{page}#{sent_id}"
            gold.add(doc_id)
            docs.setdefault(doc_id, Document(doc_id, fever_title(page), text))
        queries.append(GoldQuery(str(row["id"]), row["question"], frozenset(gold), label=row.get("label")))
    return list(docs.values()), queries


def paragraphs(path: Path, limit: int | None = None, prefix: str = "") -> tuple[list[Document], list[GoldQuery]]:
    """HotpotQA-style rows: every context paragraph is a document; supporting ones are gold."""
    docs: dict[str, Document] = {}
    queries = []
    for row in _jsonl(path, limit):
        qid = str(row.get("_id") or row.get("id"))
        gold = set()
        support = {t for t, _ in row.get("supporting_facts") or []}
        for title, sents in row.get("context") or []:
            text = "".join(sents) if isinstance(sents, list) else str(sents)
            doc_id = f"{prefix}{title}"
            docs.setdefault(doc_id, Document(doc_id, title, text))
            if title in support:
                gold.add(doc_id)
        queries.append(GoldQuery(qid, row["question"], frozenset(gold), answer=row.get("answer")))
    return list(docs.values()), queries


def musique_paragraphs(path: Path, limit: int | None = None) -> list[Document]:
    docs = {}
    for row in _jsonl(path, limit):
        for p in row.get("paragraphs") or []:
            doc_id = f"musique:{p.get('title', '')}:{p.get('idx', len(docs))}:{row.get('id')}"
            docs.setdefault(doc_id, Document(doc_id, p.get("title", ""), p.get("paragraph_text", "")))
    return [d for d in docs.values() if d.text.strip()]


def distractors(data_dir: Path) -> list[Document]:
    """Off-topic documents for a FEVER KB: every HotpotQA (distractor setting) and MuSiQue dev
    paragraph, one per distinct text, ids `qa:N` in file order (the LLM-setting evaluations'
    `--extra-docs`; 4,780 paragraphs on the shared data)."""
    seen: dict[str, Document] = {}
    hotpot = paragraphs(data_dir / "hotpotqa" / "dev.jsonl")[0]
    for d in [*hotpot, *musique_paragraphs(data_dir / "musique" / "dev.jsonl")]:
        seen.setdefault(d.text, d)
    return [Document(f"qa:{i}", d.title, d.text) for i, d in enumerate(seen.values())]


def write_docs(docs: list[Document], path: Path) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"id": d.id, "title": d.title, "text": d.text, **d.metadata},
                                ensure_ascii=False) + "\n")
    return path
