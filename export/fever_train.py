"""NLI pairs from FEVER 1.0 *train* (../shared/data/fever_train, 145k claims) for the offline NLI.

The file gives each SUPPORTS / REFUTES claim the text of its gold evidence
sentences (the union of all annotated sets, in annotation order) and NOT ENOUGH
INFO claims nothing; no page titles (see its SOURCE.md). Pairs, one per claim:

- SUPPORTS / REFUTES: the first `max_sentences` distinct evidence sentences
  (annotation order puts the first set first) -> entailment / contradiction.
- NOT ENOUGH INFO: the best BM25 match for the claim among *other* claims'
  evidence sentences -> neutral (Nie et al. 2019): text that looks like
  evidence for the claim and is not.

Titles: the runtime serves passages as ``title\\ntext`` and FEVER sentences often
name their subject only through the page ("He was born in 1970."). `titles`:
- "bare": the sentences alone;
- "subject": the claim's subject (its leading capitalized span, e.g. "Roald
  Dahl" in "Roald Dahl is a writer.") as the title line; a look-alike premise
  carries the subject of the claim it was evidence for;
- "drop": bare, keeping only sentences that name the subject themselves.

Pairs whose claim or any premise sentence is a text of the evaluation side
(dedupe_key, as for the general NLI pairs: every claim and evidence sentence of
../fever/dev.jsonl) are removed and counted, and no such sentence enters the
look-alike pool. The same pool gives the reranker its FEVER queries
(`rerank_groups`) and the held-out NOT ENOUGH INFO claims their premises
(`LookAlikes.best`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from d2r_edge_export.nli_general import CON, ENT, NEU, dedupe_key

from d2r_edge.errors import ExportError
from d2r_edge.retrieval.bm25 import BM25Index

TITLE_MODES = ("bare", "subject", "drop")
FILE = "fever_train/train.jsonl.gz"
_CONNECTORS = {"of", "the", "and", "de", "von", "van", "la", "le", "del", "da", "du", "des", "y", "&", "-", "on",
               "in", "for", "a", "an", "to"}
_TOKEN = re.compile(r"\S+")


def claim_subject(claim: str, max_words: int = 8) -> str | None:
    """The claim's leading capitalized span: "The Walking Dead premiered in 2010." -> "The Walking Dead".

    Lowercase connectors ("of", "the", ...) count only between capitalized words;
    None when the claim does not start with a capitalized word or a number.
    """
    words = _TOKEN.findall(claim)
    span: list[str] = []
    for i, w in enumerate(words[:max_words + 4]):
        w = w.rstrip(".,;:!?")
        if not w:
            break
        if w[0].isupper() or w[0].isdigit():
            span.append(w)
        elif w in _CONNECTORS and span and i + 1 < len(words) and words[i + 1][:1].isupper():
            span.append(w)
        else:
            break
        if len(span) > max_words:
            return None                     # a capitalized sentence, not a name
        if words[i] != w:                   # punctuation ends the name
            break
    if span:
        span[-1] = span[-1].removesuffix("'s")     # "Randy Orton's nickname" -> "Randy Orton"
    return " ".join(w for w in span if w) or None


def names(sentence: str, subject: str) -> bool:
    """Does the sentence name the subject itself (its last word, e.g. "Hemsworth" for "Chris Hemsworth")?"""
    last = subject.split()[-1].lower()
    return re.search(rf"\b{re.escape(last)}\b", sentence.lower()) is not None


@dataclass
class FeverTrainPairs:
    pairs: list[tuple[str, str, int]] = field(default_factory=list)
    # the SUPPORTS / REFUTES pairs as (premise, claim, FEVER label): what the negation / number
    # mutations of export/finetune_data.py rewrite
    labeled: list[tuple[str, str, str]] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    file_sha256: str = ""


def _read(path: Path) -> tuple[list[dict], str]:
    """The rows and the sha256 of the file's bytes, read once."""
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw).decode("utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()], hashlib.sha256(raw).hexdigest()
    except (OSError, ValueError, EOFError) as exc:
        raise ExportError(f"cannot read {path}: {exc}; it should be FEVER train as described in its SOURCE.md") from exc


def read(data: Path) -> tuple[list[dict], str]:
    path = data / FILE
    if not path.is_file():
        raise ExportError(f"{path} is missing; pass --data-dir pointing at the shared data folder "
                          f"(FEVER's train split is where every FEVER training pair comes from)")
    return _read(path)


def _titled(title: str | None, text: str, titles: str) -> str:
    return f"{title}\n{text}" if titles == "subject" and title else text


class LookAlikes:
    """Every FEVER-train evidence sentence that is not a text of the evaluation side, with the subject
    of the claim it was evidence for; BM25 over them, built on first use."""

    def __init__(self, rows: list[dict], evaluation_texts: set[str]) -> None:
        self.subject: dict[str, str | None] = {}
        for r in rows:
            subj = claim_subject(r["claim"])
            for s in r.get("evidence") or []:
                if dedupe_key(s) not in evaluation_texts:
                    self.subject.setdefault(s, subj)
        self.texts = list(self.subject)
        self._index: BM25Index | None = None

    def top(self, query: str, n: int, exclude: frozenset[str] = frozenset()) -> list[str]:
        """The `n` sentences most like `query` (BM25), none of `exclude`."""
        if self._index is None:
            self._index = BM25Index()
            self._index.add(self.texts)
        ids, _ = self._index.top_k(query, n + len(exclude))
        return [t for t in (self.texts[int(i)] for i in ids) if t not in exclude][:n]

    def best(self, claim: str, titles: str = "subject") -> str | None:
        """A NOT ENOUGH INFO claim's premise: the closest look-alike, titled by its own claim's subject."""
        found = self.top(claim, 1)
        return _titled(self.subject[found[0]], found[0], titles) if found else None


def build(data: Path, n_pairs: int, evaluation_texts: set[str], *, titles: str = "subject",
          max_sentences: int = 2, seed: int = 0, pool: LookAlikes | None = None,
          rows: list[dict] | None = None, digest: str = "") -> FeverTrainPairs:
    """Up to `n_pairs` pairs from claims drawn in a seeded order (FEVER's label mix)."""
    import numpy as np

    if titles not in TITLE_MODES:
        raise ExportError(f"fever-train titles must be one of {', '.join(TITLE_MODES)}, got {titles!r}")
    if rows is None:
        rows, digest = read(data)
    out = FeverTrainPairs(file_sha256=digest)
    removed = {"claim_in_evaluation": 0, "premise_in_evaluation": 0, "no_sentence_left": 0, "no_look_alike": 0}
    pool = pool or LookAlikes(rows, evaluation_texts)
    order = np.random.default_rng([seed, 22]).permutation(len(rows))
    counts = {ENT: 0, NEU: 0, CON: 0}
    for i in order:
        if len(out.pairs) >= n_pairs:
            break
        r = rows[int(i)]
        claim, label = r["claim"], r["label"]
        if dedupe_key(claim) in evaluation_texts:
            removed["claim_in_evaluation"] += 1
            continue
        subj = claim_subject(claim)
        if label == "NOT ENOUGH INFO":
            found = pool.top(claim, 1)
            if not found:
                removed["no_look_alike"] += 1
                continue
            sents, lab, title = found, NEU, pool.subject[found[0]]
        else:
            sents = list(dict.fromkeys(r.get("evidence") or []))[:max_sentences]
            lab, title = (ENT if label == "SUPPORTS" else CON), subj
            if any(dedupe_key(s) in evaluation_texts for s in r.get("evidence") or []):
                removed["premise_in_evaluation"] += 1
                continue
        if titles == "drop":
            sents = [s for s in sents if title and names(s, title)]
        if not sents:
            removed["no_sentence_left"] += 1
            continue
        premise = _titled(title, " ".join(sents), titles)
        out.pairs.append((premise, claim, lab))
        if lab != NEU:
            out.labeled.append((premise, claim, label))
        counts[lab] += 1
    out.stats = {"file": FILE, "claims": len(rows), "pairs": len(out.pairs), "requested": n_pairs,
                 "titles": titles, "max_sentences": max_sentences, "seed": seed,
                 "labels": {"entailment": counts[ENT], "neutral": counts[NEU], "contradiction": counts[CON]},
                 "look_alike_pool_sentences": len(pool.texts), "removed": removed}
    return out


def rerank_groups(rows: list[dict], pool: LookAlikes, evaluation_texts: set[str], n_groups: int,
                  n_negatives: int, seed: int = 0) -> tuple[list[tuple[str, tuple[str, ...], tuple[str, ...]]], dict]:
    """The reranker's FEVER queries: a SUPPORTS / REFUTES claim, its evidence sentences (subject-titled)
    as the relevant passages and its BM25 look-alikes from other claims as the irrelevant ones.

    A claim is skipped when it or any of its evidence sentences is a text of the evaluation side.
    """
    import numpy as np

    out, skipped = [], 0
    for i in np.random.default_rng([seed, 23]).permutation(len(rows)):
        if len(out) >= n_groups:
            break
        r = rows[int(i)]
        evidence = list(dict.fromkeys(r.get("evidence") or []))
        if r["label"] == "NOT ENOUGH INFO" or not evidence:
            continue
        if dedupe_key(r["claim"]) in evaluation_texts or any(dedupe_key(s) in evaluation_texts for s in evidence):
            skipped += 1
            continue
        subj = claim_subject(r["claim"])
        negatives = pool.top(r["claim"], n_negatives, exclude=frozenset(evidence))
        if not negatives:
            continue
        out.append((r["claim"], tuple(sorted(_titled(subj, s, "subject") for s in evidence[:3])),
                    tuple(_titled(pool.subject[s], s, "subject") for s in negatives)))
    return out, {"groups": len(out), "skipped_evaluation_overlap": skipped}
