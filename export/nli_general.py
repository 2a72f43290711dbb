"""General-domain NLI pairs (../shared/data/nli/train.jsonl.gz) for the offline NLI's first stage.

94,854 deduplicated 3-way pairs from SNLI, MultiNLI, XNLI, ANLI, SICK and
others (the file's SOURCE.md lists them with their licenses). Two things
happen before any of them trains:

- held out by source: 1,000 MultiNLI-dev and 1,000 ANLI-dev pairs, chosen by
  a hash of the premise (all hypotheses of a held-out premise stay out), so
  the manifest can show the model's general ability next to its FEVER figure;
- deduplicated against the offline models' validation split: a pair whose
  premise or hypothesis, normalized, is a held-out FEVER claim, a held-out
  evidence sentence or a held-out QA question never trains (the count removed
  goes into the manifest).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from d2r_edge.errors import ExportError
from d2r_edge.eval.split import normalize_text

GENERAL_FILE = "nli/train.jsonl.gz"
ENT, NEU, CON = 0, 1, 2           # id2label of the offline NLI model (every pair builder uses these)
ID2LABEL = {ENT: "entailment", NEU: "neutral", CON: "contradiction"}
LABELS = {name: i for i, name in ID2LABEL.items()}
# held-out groups: name -> the sources it draws from
HELDOUT_GROUPS = {"mnli_dev": ("mnli_dev_taxinli",), "anli_dev": ("anli_r1_dev", "anli_r2_dev", "anli_r3_dev")}
HELDOUT_PAIRS_PER_GROUP = 1000


@dataclass
class GeneralPairs:
    train: list[tuple[str, str, int]] = field(default_factory=list)
    heldout: dict[str, list[tuple[str, str, int]]] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


def dedupe_key(text: str) -> str:
    """Lowercased words only: "X is a film." and "x is a film" match."""
    return " ".join(re.findall(r"\w+", text.lower()))


def _hash(text: str) -> str:
    return hashlib.sha256(normalize_text(text).encode()).hexdigest()


def parse_sources(spec: str) -> tuple[str, ...] | None:
    """'all' -> None (every source); 'all,-sick,-anli_r3_dev' or 'snli_dev,snli_test' -> a filter."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise ExportError("nli_general_sources is empty; use 'all', 'all,-SOURCE' or a list of sources")
    return None if parts == ["all"] else tuple(sorted(parts))


def _wanted(source: str, spec: tuple[str, ...] | None) -> bool:
    if spec is None:
        return True
    if "all" in spec:
        return f"-{source}" not in spec
    return source in spec


def load_general(data: Path, validation_texts: set[str], sources: str = "all",
                 max_pairs: int | None = None, seed: int = 0) -> GeneralPairs:
    """Training pairs and held-out groups from the general NLI file under `data`.

    validation_texts: dedupe_key() of every text of the validation split.
    """
    path = data / GENERAL_FILE
    if not path.is_file():
        raise ExportError(f"the general NLI stage needs {path}; pass --data-dir pointing at the shared "
                          f"data folder, or set nli_general_epochs=0 to train on the FEVER/QA pairs only")
    spec = parse_sources(sources)
    raw = path.read_bytes()
    rows = [json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip()]
    known = {r["source"] for r in rows}
    named = {s.lstrip("-") for s in spec or () if s != "all"}
    if named - known:
        raise ExportError(f"unknown NLI source(s) {', '.join(sorted(named - known))}; "
                          f"known: {', '.join(sorted(known))}")
    group_of = {src: g for g, srcs in HELDOUT_GROUPS.items() for src in srcs}
    # held out: premises in hash order until the group has its pairs (always, whatever the filter)
    by_premise: dict[str, dict[str, list[dict]]] = {g: {} for g in HELDOUT_GROUPS}
    for r in rows:
        if r["source"] in group_of:
            by_premise[group_of[r["source"]]].setdefault(_hash(r["premise"]), []).append(r)
    held_ids: set[int] = set()
    out = GeneralPairs()
    for g, premises in by_premise.items():
        chosen: list[dict] = []
        for h in sorted(premises):
            if len(chosen) >= HELDOUT_PAIRS_PER_GROUP:
                break
            chosen += premises[h]
        held_ids.update(id(r) for r in chosen)
        out.heldout[g] = [(r["premise"], r["hypothesis"], LABELS[r["label"]]) for r in chosen]
    removed_validation, filtered = 0, 0
    for r in rows:
        if id(r) in held_ids:
            continue
        if not _wanted(r["source"], spec):
            filtered += 1
            continue
        if dedupe_key(r["premise"]) in validation_texts or dedupe_key(r["hypothesis"]) in validation_texts:
            removed_validation += 1
            continue
        out.train.append((r["premise"], r["hypothesis"], LABELS[r["label"]]))
    if max_pairs and len(out.train) > max_pairs:
        # a seeded sample across sources (the file is grouped by source: its head is two of them)
        import numpy as np

        keep = np.sort(np.random.default_rng(seed).permutation(len(out.train))[:max_pairs])
        out.train = [out.train[i] for i in keep]
    out.stats = {"file": GENERAL_FILE, "file_sha256": hashlib.sha256(raw).hexdigest(), "rows": len(rows),
                 "sources": "all" if spec is None else list(spec),
                 "sources_used": sorted({r["source"] for r in rows if _wanted(r["source"], spec)}),
                 "heldout": {g: {"sources": list(HELDOUT_GROUPS[g]), "pairs": len(v)} for g, v in out.heldout.items()},
                 "removed_matching_validation": removed_validation, "left_out_by_source_filter": filtered,
                 "train_pairs": len(out.train)}
    return out
