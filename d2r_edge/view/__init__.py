"""`d2r-edge report`: a run's records as one self-contained HTML page (summary, filters, one card per query)."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from d2r_edge.view.cards import card, passage_titles, read_records, summarize
from d2r_edge.view.page import render_page

log = logging.getLogger(__name__)

__all__ = ["card", "passage_titles", "read_records", "render_page", "summarize", "write_report"]


def write_report(records: Path, out: Path, kb: Path | None = None, title: str | None = None) -> dict:
    """Writes the page for a records file (atomically) and returns its summary."""
    rows, bad = read_records(Path(records))
    titles = passage_titles(kb)
    cards = [card(r, titles) for r in rows]
    summary = summarize(cards)
    note = f"{records.name}: {len(rows)} records"
    if bad:
        lines = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
        note += f"; {len(bad)} lines skipped (not a record: line {lines})"
        log.warning("%s: %d lines are not records (first: %d); skipped", records, len(bad), bad[0])
    if kb is None:
        note += "; passage titles: give --kb to show them"
    page = render_page(cards, summary, title=title or f"d2r-edge report: {records.name}", note=note)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(page)
        os.chmod(tmp, 0o644)        # a report like any other output file (mkstemp makes it 0600)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return summary
