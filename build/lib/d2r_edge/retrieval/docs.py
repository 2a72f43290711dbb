"""Reading document files (JSONL: id, title, text, other fields kept as metadata)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from d2r_edge.errors import InputError
from d2r_edge.jsonl import loads as json_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str
    metadata: dict = field(default_factory=dict)

    @property
    def indexed_text(self) -> str:
        """What the KB indexes: the title gives short passages their subject."""
        return f"{self.title}\n{self.text}" if self.title else self.text


@dataclass
class ReadReport:
    documents: list[Document]
    bad_lines: list[tuple[int, str]]      # (line number, why)
    empty_texts: list[int]                # line numbers of documents with no text


def read_documents(path: Path, known_ids: set[str] | None = None) -> ReadReport:
    """Parse a JSONL file; broken lines are reported with their numbers, the rest kept.

    Duplicate ids (within the file or against `known_ids`) are rejected as a
    whole, naming the lines, because silently keeping one would change the KB.
    """
    path = Path(path)
    try:
        fh = open(path, encoding="utf-8", errors="strict")
    except OSError as exc:
        raise InputError(f"cannot read documents file {path}: {exc}") from None
    docs, bad, empty = [], [], []
    seen: dict[str, int] = {}
    dupes: list[str] = []
    known_ids = known_ids or set()
    with fh:
        try:
            lines = list(enumerate(fh, start=1))
        except UnicodeDecodeError as exc:
            raise InputError(f"{path} is not UTF-8 ({exc.reason}); re-encode it") from None
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            row = json_line(line)
        except json.JSONDecodeError as exc:
            bad.append((lineno, f"invalid JSON ({exc.msg})"))
            continue
        if not isinstance(row, dict) or "id" not in row or not isinstance(row.get("text", ""), str):
            bad.append((lineno, "needs an object with 'id' and a string 'text'"))
            continue
        doc_id = str(row["id"])
        if doc_id in seen or doc_id in known_ids:
            first = f"line {seen[doc_id]}" if doc_id in seen else "the existing KB"
            dupes.append(f"{doc_id!r} on line {lineno} (first: {first})")
            continue
        seen[doc_id] = lineno
        text = row.get("text") or ""
        if not text.strip():
            empty.append(lineno)
            continue
        meta = {k: v for k, v in row.items() if k not in ("id", "title", "text")}
        docs.append(Document(doc_id, str(row.get("title") or ""), text, meta))
    if dupes:
        raise InputError(f"{path}: duplicate document ids: {'; '.join(dupes[:10])}"
                         + (f" and {len(dupes) - 10} more" if len(dupes) > 10 else ""))
    for lineno, why in bad:
        log.warning("%s line %d skipped: %s", path, lineno, why)
    if empty:
        log.warning("%s: %d document(s) with empty text skipped (lines %s)", path, len(empty),
                    ", ".join(map(str, empty[:10])))
    if not docs:
        raise InputError(f"{path} holds no usable document (bad lines: {len(bad)}, empty: {len(empty)})")
    return ReadReport(docs, bad, empty)
