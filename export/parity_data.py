"""Parity inputs: real pairs and sentences from ../shared/data when present.

On a machine without the shared data (a user's), the tiny corpus stands in
and the manifest records which set was used.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from d2r_edge_export.tiny import tiny_corpus

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


@dataclass(frozen=True)
class ParitySet:
    name: str
    pairs: list[tuple[str, str]]     # (premise/passage, hypothesis/question)
    sentences: list[str]


def _jsonl(path: Path, limit: int, skip_heldout: bool) -> list[dict]:
    from d2r_edge_export.finetune_data import is_validation

    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if len(out) >= limit:
                break
            line = line.strip()
            if line:
                row = json.loads(line)
                if not (skip_heldout and is_validation(row["question"])):
                    out.append(row)
    return out


def _fever_dev(path: Path, limit: int, skip_heldout: bool) -> list[tuple[str, str]]:
    return [(row["question"], " ".join(row.get("pars") or []) or row["question"])
            for row in _jsonl(path, limit, skip_heldout)]


def _fever_train(data_dir: Path, limit: int) -> list[tuple[str, str]] | None:
    """FEVER train's first claims with evidence (None without the file): FEVER dev is the offline
    models' evaluation side whole, so choices such as the int8 tier are made on train's text (an
    unlabeled set: it only compares int8 with fp32)."""
    import gzip

    from d2r_edge_export import fever_train as ft

    path = data_dir / ft.FILE
    if not path.is_file():
        return None
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:      # the first rows only, not all 145k
        for line in fh:
            if len(out) >= limit:
                break
            r = json.loads(line) if line.strip() else {}
            if r.get("evidence"):
                out.append((r["claim"], " ".join(r["evidence"][:2])))
    return out


def load_parity_set(data_dir: Path | None = None, n_pairs: int = 64, skip_heldout: bool = False) -> ParitySet:
    """Pairs from the first rows of FEVER and HotpotQA.

    skip_heldout: leave out the offline models' evaluation side: FEVER pairs from FEVER train
    instead of dev, HotpotQA's held-out questions skipped (for choices made on this set, such
    as the int8 tier).
    """
    data_dir = Path(data_dir) if data_dir else DEFAULT_DATA_DIR
    fever, hotpot = data_dir / "fever" / "dev.jsonl", data_dir / "hotpotqa" / "dev.jsonl"
    if fever.is_file() and hotpot.is_file():
        pairs, sentences = [], []
        train = _fever_train(data_dir, n_pairs // 2) if skip_heldout else None
        for claim, evidence in train if train is not None else _fever_dev(fever, n_pairs // 2, skip_heldout):
            pairs.append((evidence, claim))
            sentences += [claim, evidence]
        for row in _jsonl(hotpot, n_pairs // 2, skip_heldout):
            title, sents = row["context"][0]
            pairs.append(("".join(sents), row["question"]))
            sentences += [row["question"], "".join(sents)]
        return ParitySet(f"shared-data:{data_dir}", pairs, sentences)
    log.warning("no shared data at %s; parity uses the built-in tiny corpus", data_dir)
    corpus = tiny_corpus(n_sentences=2 * n_pairs, seed=7)
    return ParitySet("tiny-corpus", list(zip(corpus[::2], corpus[1::2])), corpus)
