"""Labeled pairs from ../shared/data for the offline NLI and reranker models.

Split by a stable hash of the normalized claim / question text rather than
the row id: FEVER repeats the same claim under several ids (one per
annotation), and an id split leaked those duplicates into both sides. So
validation claims never train anything, hard-negative mining included:
negatives are mined with BM25 over a pool built from training rows only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from d2r_edge.retrieval.bm25 import BM25Index

ENT, NEU, CON = 0, 1, 2           # id2label of the offline NLI model
ID2LABEL = {ENT: "entailment", NEU: "neutral", CON: "contradiction"}
FILES = ("fever/dev.jsonl", "hotpotqa/dev.jsonl", "musique/dev.jsonl", "2wikimultihopqa/dev.jsonl")


def is_validation(text: str, percent: int = 20) -> bool:
    key = " ".join(text.lower().split())
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100 < percent


def _rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@dataclass
class PairSets:
    nli_train: list[tuple[str, str, int]] = field(default_factory=list)
    nli_val: list[tuple[str, str, int]] = field(default_factory=list)       # FEVER only
    rerank_train: list[tuple[str, str, float]] = field(default_factory=list)
    rerank_val: list[dict] = field(default_factory=list)   # hotpot: question, paragraphs, gold idx
    files_sha256: dict[str, str] = field(default_factory=dict)
    split: dict = field(default_factory=dict)


def _qa_rows(data: Path) -> list[tuple[str, str, list[tuple[str, str, bool]]]]:
    """(source, qid, question, [(title, text, supporting)]) across HotpotQA, MuSiQue, 2Wiki."""
    out = []
    for src, name in (("hotpotqa", "hotpotqa"), ("2wiki", "2wikimultihopqa")):
        for row in _rows(data / name / "dev.jsonl"):
            support = {t for t, _ in row.get("supporting_facts") or []}
            paras = [(t, "".join(s), t in support) for t, s in row["context"]]
            out.append((src, str(row["_id"]), row["question"], paras))
    for row in _rows(data / "musique" / "dev.jsonl"):
        paras = [(p["title"], p["paragraph_text"], bool(p.get("is_supporting"))) for p in row["paragraphs"]]
        out.append(("musique", str(row["id"]), row["question"], paras))
    return out


def build_pairs(data: Path, max_train_pairs: int | None = None, seed: int = 0) -> PairSets:
    import numpy as np

    rng = np.random.default_rng(seed)
    sets = PairSets()
    sets.files_sha256 = {f: hashlib.sha256((data / f).read_bytes()).hexdigest() for f in FILES}
    fever = _rows(data / "fever" / "dev.jsonl")
    qa = _qa_rows(data)
    # the mining pool: training rows' evidence and paragraphs only
    pool: list[str] = []
    for row in fever:
        if not is_validation(row["question"]):
            pool += [s for _, _, s in row.get("derived_evidence_sentences") or []]
    for src, qid, question, paras in qa:
        if not is_validation(question):
            pool += [f"{t}\n{x}" for t, x, _ in paras]
    pool = list(dict.fromkeys(pool))
    bm25 = BM25Index()
    bm25.add(pool)

    def mined(query: str, exclude: set[str], n: int) -> list[str]:
        ids, _ = bm25.top_k(query, n + len(exclude) + 2)
        return [pool[i] for i in ids if pool[i] not in exclude][:n]

    for row in fever:
        val = is_validation(row["question"])
        claim, label = row["question"], row["label"]
        evidence = [s for _, _, s in row.get("derived_evidence_sentences") or []]
        target = sets.nli_val if val else sets.nli_train
        if label in ("SUPPORTS", "REFUTES") and evidence:
            target.append((" ".join(evidence), claim, ENT if label == "SUPPORTS" else CON))
            if not val:
                for neg in mined(claim, set(evidence), 1):
                    sets.nli_train.append((neg, claim, NEU))
                    sets.rerank_train.append((claim, neg, 0.0))
                for e in evidence:
                    sets.rerank_train.append((claim, e, 1.0))
        elif label == "NOT ENOUGH INFO":
            # premise: the best BM25 passage from the training pool (also for validation
            # rows: the pool holds no validation text, so nothing leaks either way)
            for p in mined(claim, set(), 1):
                target.append((p, claim, NEU))
    for src, qid, question, paras in qa:
        val = is_validation(question)
        if val:
            if src == "hotpotqa":
                sets.rerank_val.append({"question": question, "paragraphs": [f"{t}\n{x}" for t, x, _ in paras],
                                        "gold": [i for i, (_, _, s) in enumerate(paras) if s]})
            continue
        for t, x, support in paras:
            premise = f"{t}\n{x}"
            if support:
                sets.nli_train.append((premise, question, ENT))
                sets.rerank_train.append((question, premise, 1.0))
        distractors = [f"{t}\n{x}" for t, x, s in paras if not s]
        for i in rng.choice(len(distractors), size=min(2, len(distractors)), replace=False):
            sets.nli_train.append((distractors[i], question, NEU))
            sets.rerank_train.append((question, distractors[i], 0.0))
    # keep neutral from swamping the other classes (mined negatives are plentiful)
    by = {lab: [p for p in sets.nli_train if p[2] == lab] for lab in (ENT, NEU, CON)}
    cap = 2 * max(len(by[ENT]), len(by[CON]))
    sets.nli_train = by[ENT] + by[CON] + [by[NEU][i] for i in rng.permutation(len(by[NEU]))[:cap]]
    order = rng.permutation(len(sets.nli_train))
    sets.nli_train = [sets.nli_train[i] for i in order]
    order = rng.permutation(len(sets.rerank_train))
    sets.rerank_train = [sets.rerank_train[i] for i in order]
    if max_train_pairs:
        sets.nli_train = sets.nli_train[:max_train_pairs]
        sets.rerank_train = sets.rerank_train[:max_train_pairs]
    sets.split = {"rule": "sha256(normalized claim or question text) % 100 < 20 -> validation",
                  "validation_percent": 20,
                  "nli_train": len(sets.nli_train), "nli_val": len(sets.nli_val),
                  "rerank_train": len(sets.rerank_train), "rerank_val_questions": len(sets.rerank_val)}
    return sets
