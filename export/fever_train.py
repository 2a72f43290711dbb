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

Pairs whose claim or any premise sentence is a text of the validation split
(dedupe_key, as for the general NLI pairs) are removed and counted.
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


def build(data: Path, n_pairs: int, validation_texts: set[str], *, titles: str = "subject",
          max_sentences: int = 2, seed: int = 0) -> FeverTrainPairs:
    """Up to `n_pairs` pairs from claims drawn in a seeded order (FEVER's label mix)."""
    import numpy as np

    if titles not in TITLE_MODES:
        raise ExportError(f"fever-train titles must be one of {', '.join(TITLE_MODES)}, got {titles!r}")
    path = data / FILE
    if not path.is_file():
        raise ExportError(f"{path} is missing; pass --data-dir pointing at the shared data folder "
                          f"or set the FEVER train pairs to 0")
    rows, digest = _read(path)
    out = FeverTrainPairs(file_sha256=digest)
    removed = {"claim_in_validation": 0, "premise_in_validation": 0, "no_sentence_left": 0, "no_look_alike": 0}
    # the look-alike pool: every evidence sentence with the subject of its claim, none from validation
    pool: dict[str, str | None] = {}
    for r in rows:
        subj = claim_subject(r["claim"])
        for s in r.get("evidence") or []:
            if dedupe_key(s) not in validation_texts:
                pool.setdefault(s, subj)
    order = np.random.default_rng([seed, 22]).permutation(len(rows))
    texts = list(pool)
    index: BM25Index | None = None
    counts = {ENT: 0, NEU: 0, CON: 0}
    for i in order:
        if len(out.pairs) >= n_pairs:
            break
        r = rows[int(i)]
        claim, label = r["claim"], r["label"]
        if dedupe_key(claim) in validation_texts:
            removed["claim_in_validation"] += 1
            continue
        subj = claim_subject(claim)
        if label == "NOT ENOUGH INFO":
            if index is None:
                index = BM25Index()
                index.add(texts)
            ids, _ = index.top_k(claim, 1)
            if len(ids) == 0:
                removed["no_look_alike"] += 1
                continue
            sents, lab, title = [texts[int(ids[0])]], NEU, pool[texts[int(ids[0])]]
        else:
            sents = list(dict.fromkeys(r.get("evidence") or []))[:max_sentences]
            lab, title = (ENT if label == "SUPPORTS" else CON), subj
            if any(dedupe_key(s) in validation_texts for s in sents):
                removed["premise_in_validation"] += 1
                continue
        if titles == "drop":
            sents = [s for s in sents if title and names(s, title)]
        if not sents:
            removed["no_sentence_left"] += 1
            continue
        text = " ".join(sents)
        premise = f"{title}\n{text}" if titles == "subject" and title else text
        out.pairs.append((premise, claim, lab))
        counts[lab] += 1
    out.stats = {"file": FILE, "claims": len(rows), "pairs": len(out.pairs), "requested": n_pairs,
                 "titles": titles, "max_sentences": max_sentences, "seed": seed,
                 "labels": {"entailment": counts[ENT], "neutral": counts[NEU], "contradiction": counts[CON]},
                 "look_alike_pool_sentences": len(texts), "removed": removed}
    return out
