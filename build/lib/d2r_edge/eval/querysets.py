"""Evaluation query files in the layouts of ../shared/data, with their documents and gold evidence.

Layouts (detected from the first usable line):
- FEVER: `{id, question|claim, label, derived_evidence_sentences}`; documents are the
  evidence sentences, `<page>#<sentence>`.
- HotpotQA distractor / fullwiki and 2Wiki: `{_id, question, answer, context: [[title,
  [sentences]]], supporting_facts}`; documents are the context paragraphs.
- HotpotQA IRCoT subsample: `{question_id, question_text, answers_objects, contexts}`.
- MuSiQue: `{id, question, answer, answer_aliases, paragraphs}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from d2r_edge.errors import InputError
from d2r_edge.eval.datasets import fever_title
from d2r_edge.eval.split import Split
from d2r_edge.jsonl import loads as json_line
from d2r_edge.retrieval.docs import Document


class Layout(str, Enum):
    FEVER = "fever"
    HOTPOT = "hotpotqa"          # also fullwiki and 2Wiki
    IRCOT = "ircot"
    MUSIQUE = "musique"

    @property
    def is_fever(self) -> bool:
        return self is Layout.FEVER


@dataclass(frozen=True)
class EvalQuery:
    id: str
    text: str
    label: str | None = None                     # FEVER gold label
    answers: tuple[str, ...] = ()                # QA gold answer and its aliases
    gold_doc_ids: frozenset[str] = frozenset()

    @property
    def answer(self) -> str | None:
        return self.answers[0] if self.answers else None


@dataclass
class QuerySet:
    path: Path
    layout: Layout
    queries: list[EvalQuery]
    documents: list[Document] = field(default_factory=list)


def detect_layout(row: dict) -> Layout | None:
    if "derived_evidence_sentences" in row or (isinstance(row.get("label"), str) and "evidence" in row):
        return Layout.FEVER
    if "question_text" in row and "contexts" in row:
        return Layout.IRCOT
    if "paragraphs" in row and "question" in row:
        return Layout.MUSIQUE
    if "context" in row and "question" in row:
        return Layout.HOTPOT
    return None


def _fever(row: dict, docs: dict[str, Document]) -> EvalQuery:
    gold = set()
    for page, sent_id, text in row.get("derived_evidence_sentences") or []:
        doc_id = f"{page}#{sent_id}"
        gold.add(doc_id)
        docs.setdefault(doc_id, Document(doc_id, fever_title(page), text))
    text = row.get("question") or row.get("claim")
    return EvalQuery(str(row["id"]), text, label=str(row["label"]), gold_doc_ids=frozenset(gold))


def _hotpot(row: dict, docs: dict[str, Document]) -> EvalQuery:
    support = {t for t, _ in row.get("supporting_facts") or []}
    gold = set()
    for title, sents in row.get("context") or []:
        text = "".join(sents) if isinstance(sents, list) else str(sents)
        docs.setdefault(title, Document(title, title, text))
        if title in support:
            gold.add(title)
    return EvalQuery(str(row.get("_id") or row.get("id")), row["question"],
                     answers=(str(row["answer"]),), gold_doc_ids=frozenset(gold))


def _ircot(row: dict, docs: dict[str, Document]) -> EvalQuery:
    gold = set()
    for c in row.get("contexts") or []:
        docs.setdefault(c["title"], Document(c["title"], c["title"], c.get("paragraph_text", "")))
        if c.get("is_supporting"):
            gold.add(c["title"])
    answers = tuple(str(s) for a in row.get("answers_objects") or [] for s in a.get("spans") or [])
    return EvalQuery(str(row["question_id"]), row["question_text"], answers=answers, gold_doc_ids=frozenset(gold))


def _musique(row: dict, docs: dict[str, Document]) -> EvalQuery:
    gold = set()
    for p in row.get("paragraphs") or []:
        # MuSiQue titles repeat with different texts: the id keeps the paragraph apart
        doc_id = f"{p.get('title', '')}#{p.get('paragraph_text', '')[:40]}"
        docs.setdefault(doc_id, Document(doc_id, p.get("title", ""), p.get("paragraph_text", "")))
        if p.get("is_supporting"):
            gold.add(doc_id)
    answers = (str(row["answer"]), *map(str, row.get("answer_aliases") or []))
    return EvalQuery(str(row["id"]), row["question"], answers=answers, gold_doc_ids=frozenset(gold))


_READERS = {Layout.FEVER: _fever, Layout.HOTPOT: _hotpot, Layout.IRCOT: _ircot, Layout.MUSIQUE: _musique}


def load_queryset(path: Path | str, split: Split = Split.ALL, limit: int | None = None,
                  skip_ids: frozenset[str] = frozenset()) -> QuerySet:
    """Queries of `split` (first `limit` after `skip_ids`), and the documents of every row.

    Documents come from every row of the file, not only the kept queries: the other
    rows' evidence is the distractor pool a real index would hold.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read query file {path}: {exc}") from None
    layout, docs, queries, bad, seen = None, {}, [], 0, set()
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json_line(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if not isinstance(row, dict):
            bad += 1
            continue
        if layout is None:
            layout = detect_layout(row)
            if layout is None:
                raise InputError(
                    f"{path} line {n}: layout not recognized (keys {sorted(row)[:8]}); expected FEVER "
                    "{id, question, label, derived_evidence_sentences}, HotpotQA/2Wiki {_id, question, "
                    "answer, context}, IRCoT {question_id, question_text, contexts} or MuSiQue "
                    "{id, question, answer, paragraphs}")
        try:
            q = _READERS[layout](row, docs)
            if not isinstance(q.text, str) or not all(isinstance(a, str) for a in q.answers):
                raise TypeError("the question and the answers must be strings")
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:   # a row of other shapes
            bad += 1
            if bad <= 3:
                import logging

                logging.getLogger(__name__).warning("%s line %d skipped: %s", path, n, exc)
            continue
        if not q.text or q.id in seen:
            bad += 1
            continue
        seen.add(q.id)
        if q.id in skip_ids or not split.keeps(q.text):
            continue
        if layout.is_fever or q.answers:
            queries.append(q)
    if layout is None:
        raise InputError(f"{path} has no usable line: give a JSONL query file in one of the ../shared/data layouts")
    if limit is not None:
        queries = queries[:limit]
    if not queries:
        raise InputError(f"{path} has no query on the {split.value} split"
                         f"{' after the training slice' if skip_ids else ''} ({bad} broken line(s))")
    return QuerySet(path, layout, queries, [d for d in docs.values() if d.text.strip()])
