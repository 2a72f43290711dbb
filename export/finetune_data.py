"""Labeled pairs from ../shared/data for the offline NLI and reranker models.

FEVER: ``fever/dev.jsonl`` is the evaluation side whole. FEVER writes several
claims from the same evidence sentences, so a split by claim text (the rule
before issue 50) left most held-out premises in training with their labels:
of this dev file's claims with evidence, nearly all share a sentence with
another dev claim. Every FEVER training pair and reranker query therefore comes
from FEVER *train* (export/fever_train.py), minus each claim whose text or any
evidence sentence is a text of the dev file; the general NLI pairs lose such
texts too (SPLIT_RULE, recorded in the manifest with the counts removed).

QA: split by a stable hash of the normalized question; held-out questions never
train anything.

Passages are written the way the runtime's knowledge base stores them,
``title\\ntext``: a FEVER evidence sentence such as "He was born in 1970."
only names its subject through the page title.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from d2r_edge_export import fever_train as ft
from d2r_edge_export.nli_general import CON, ENT, NEU, GeneralPairs, dedupe_key, load_general

from d2r_edge.eval.datasets import fever_title
from d2r_edge.eval.split import is_validation, normalize_text

FILES = ("fever/dev.jsonl", "hotpotqa/dev.jsonl", "musique/dev.jsonl", "2wikimultihopqa/dev.jsonl",
         "hotpotqa_ircot_subsample/dev.jsonl", "hotpotqa_fullwiki/dev.jsonl")
RERANK_FEVER_NEGATIVES = 3        # BM25-mined non-gold sentences per FEVER reranker group


_norm = normalize_text


def fever_premise(evidence: list) -> str:
    """FEVER evidence [(page, line, sentence)] as passages, one 'title\\nsentences' per page."""
    pages: dict[str, list[str]] = {}
    for page, _, sentence in evidence:
        if sentence not in pages.setdefault(page, []):
            pages[page].append(sentence)
    return "\n".join(f"{fever_title(p)}\n{' '.join(s)}" for p, s in pages.items())


_AUX = re.compile(r"\b(is|was|are|were|has|have|had|can|could|will|would|does|do|did|should|may|might|must)\b")
_NEGATED = re.compile(r"\b(is|was|are|were|has|have|had|could|would|does|do|did|should|must) not\b|"
                      r"\b(is|was|are|were|has|have|had|could|would|does|do|did|should|must)n't\b|"
                      r"\b(can't|cannot|won't|never )")
_UNCONTRACT = {"can't": "can", "cannot": "can", "won't": "will", "never ": ""}
_NUMBER = re.compile(r"\b\d{1,4}\b")


def toggle_negation(claim: str) -> str | None:
    """'X is a film.' <-> 'X is not a film.'; None when the claim has no auxiliary to negate.

    FEVER's annotators wrote most refutations by negating or mutating a true
    claim, so a negation alone predicts REFUTES in the raw data (190 of 209
    negated claims here). Flipping the negation of a claim flips its label
    under the same evidence (SUPPORTS -> contradiction, REFUTES -> entailment),
    which shows the model both labels with "not" in the hypothesis.
    """
    m = _NEGATED.search(claim)
    if m:
        word = m.group(0)
        plain = _UNCONTRACT.get(word, word.removesuffix(" not").removesuffix("n't"))
        return (claim[:m.start()] + plain + claim[m.end():]).replace("  ", " ")
    m = _AUX.search(claim)
    return None if m is None else f"{claim[:m.end()]} not{claim[m.end():]}"


def swap_number(claim: str, premise: str, rng) -> str | None:
    """A number the evidence confirms, changed: 'began in 2007' -> 'began in 2009' (contradiction)."""
    found = [m for m in _NUMBER.finditer(claim) if re.search(rf"\b{m.group(0)}\b", premise)]
    if not found:
        return None
    m = found[int(rng.integers(len(found)))]
    n = int(m.group(0))
    step = int(rng.integers(1, 4)) * (1 if n < 3 or rng.random() < 0.5 else -1)
    new = str(n + step)
    if re.search(rf"\b{new}\b", premise):
        return None
    return claim[:m.start()] + new + claim[m.end():]


def _rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@dataclass(frozen=True)
class RerankGroup:
    """One query with its relevant passages and the irrelevant ones from the same pool."""

    query: str
    positives: tuple[str, ...]
    negatives: tuple[str, ...]


@dataclass
class PairSets:
    nli_train: list[tuple[str, str, int]] = field(default_factory=list)
    nli_val: list[tuple[str, str, int]] = field(default_factory=list)       # FEVER only
    rerank_train: list[RerankGroup] = field(default_factory=list)
    rerank_val: list[dict] = field(default_factory=list)   # HotpotQA: question, paragraphs, gold idx
    files_sha256: dict[str, str] = field(default_factory=dict)
    split: dict = field(default_factory=dict)
    general: GeneralPairs | None = None     # the general-NLI stage's pairs, when asked for
    fever_train: dict = field(default_factory=dict)   # stats of the FEVER-train pairs, when asked for


@dataclass(frozen=True)
class QARow:
    source: str
    question: str
    paragraphs: tuple[tuple[str, str, bool], ...]      # (title, text, supporting)

    def passages(self, supporting: bool | None = None) -> list[str]:
        return [f"{t}\n{x}" for t, x, s in self.paragraphs if supporting is None or s == supporting]


QA_FILES = ("hotpotqa/dev.jsonl", "musique/dev.jsonl", "2wikimultihopqa/dev.jsonl",
            "hotpotqa_ircot_subsample/dev.jsonl", "hotpotqa_fullwiki/dev.jsonl")


def excluded_questions(data: Path, files: tuple[str, ...]) -> set[str]:
    """_norm() of every question in `files` (QA_FILES): kept out of training from whichever file holds
    them (the IRCoT subsample repeats HotpotQA questions)."""
    out = set()
    for f in files:
        if f not in QA_FILES:
            raise ValueError(f"{f!r} is not one of the QA files ({', '.join(QA_FILES)})")
        for row in _rows(data / f):
            out.add(_norm(row.get("question") or row.get("question_text") or ""))
    return out


def _qa_rows(data: Path) -> list[QARow]:
    """Questions with supporting and distractor paragraphs from the multi-hop QA samples."""
    out = []
    for src, name in (("hotpotqa", "hotpotqa"), ("2wiki", "2wikimultihopqa"),
                      ("hotpotqa_fullwiki", "hotpotqa_fullwiki")):
        for row in _rows(data / name / "dev.jsonl"):
            support = {t for t, _ in row.get("supporting_facts") or []}
            paras = tuple((t, "".join(s), t in support) for t, s in row["context"])
            out.append(QARow(src, row["question"], paras))
    for row in _rows(data / "musique" / "dev.jsonl"):
        paras = tuple((p["title"], p["paragraph_text"], bool(p.get("is_supporting"))) for p in row["paragraphs"])
        out.append(QARow("musique", row["question"], paras))
    for row in _rows(data / "hotpotqa_ircot_subsample" / "dev.jsonl"):
        paras = tuple((c["title"], c["paragraph_text"], bool(c.get("is_supporting"))) for c in row["contexts"])
        out.append(QARow("hotpotqa_ircot", row["question_text"], paras))
    return out


def missing_files(data: Path) -> list[str]:
    return [f for f in (*FILES, ft.FILE) if not (data / f).is_file()]


def _mutations(rows: list[tuple[str, str, str]], real_claims: set[str], rng) -> list[tuple[str, str, int]]:
    """One synthetic NLI pair per training FEVER claim: a number swap or a negation flip.

    A mutated claim that is a real FEVER claim (train or dev) is dropped:
    annotators wrote exactly such mutations, so the evaluation side holds some
    of them.
    """
    out = []
    for premise, claim, label in rows:
        swapped = swap_number(claim, premise, rng) if label == "SUPPORTS" else None
        if swapped is not None:
            new, lab = swapped, CON
        else:
            new, lab = toggle_negation(claim), (CON if label == "SUPPORTS" else ENT)
        if new is not None and _norm(new) not in real_claims:
            out.append((premise, new, lab))
    return out


def heldout_probe(val: list[tuple[str, str, int]], seed: int = 0) -> dict[str, list[tuple[str, str, int]]]:
    """Held-out FEVER pairs with the claim mutated by the same rules: does the model read 'not' and numbers?

    Gold labels come from the rule (flip ENT <-> CON; a changed number
    contradicts). Checked against FEVER itself: where a negation-flipped claim
    is another real FEVER claim, the rule's label matched the annotators' on
    51 of 63 (9 opposite, 3 NOT ENOUGH INFO).
    """
    import numpy as np

    rng = np.random.default_rng([seed, 2])
    out: dict[str, list[tuple[str, str, int]]] = {"negation_flipped": [], "number_swapped": []}
    for premise, claim, lab in val:
        if lab == NEU:
            continue
        flipped = toggle_negation(claim)
        if flipped is not None:
            out["negation_flipped"].append((premise, flipped, CON if lab == ENT else ENT))
        swapped = swap_number(claim, premise, rng) if lab == ENT else None
        if swapped is not None:
            out["number_swapped"].append((premise, swapped, CON))
    return out


FEVER_DEV = "fever/dev.jsonl"
SPLIT_RULE = ("FEVER: fever/dev.jsonl is the evaluation side whole (no claim of it trains anything); FEVER training "
              "pairs and reranker queries come from fever_train/train.jsonl.gz, minus every claim whose text or "
              "any evidence sentence is a dev claim or dev evidence sentence (dedupe_key); the general NLI pairs "
              "lose any pair with such a text too. QA: sha256(normalized question) % 100 < 20 -> validation")


def evidence_sentences(fever: list[dict]) -> set[str]:
    """Every gold evidence sentence of FEVER rows (as written)."""
    return {s for row in fever for _, _, s in row.get("derived_evidence_sentences") or []}


def evaluation_texts(fever: list[dict], qa: list[QARow]) -> set[str]:
    """dedupe_key() of every FEVER dev claim and evidence sentence, and of the held-out questions.

    FEVER writes several claims from the same evidence sentences, so holding out a
    claim's text alone left its premise in training (issue 50): every sentence of
    the evaluation side is kept out of every pair the fine-tuning reads.
    """
    out = {dedupe_key(row["question"]) for row in fever} | {dedupe_key(s) for s in evidence_sentences(fever)}
    out.update(dedupe_key(q.question) for q in qa if is_validation(q.question))
    return out


@dataclass(frozen=True)
class FeverTrainSpec:
    """How many FEVER-train pairs join the NLI's FEVER/QA stage, and how (export/fever_train.py)."""

    pairs: int = 0
    titles: str = "subject"
    max_sentences: int = 2


def build_pairs(data: Path, max_train_pairs: int | None = None, seed: int = 0,
                rerank_fever_groups: int = 400, augment: bool = True,
                general_sources: str | None = None, fever_train: FeverTrainSpec = FeverTrainSpec(),
                exclude_files: tuple[str, ...] = ()) -> PairSets:
    """The NLI and reranker pairs under SPLIT_RULE.

    FEVER's dev file is read for validation pairs only; FEVER training pairs come from
    FEVER train (`fever_train.pairs` of them for the NLI, `rerank_fever_groups` reranker
    queries). `exclude_files`: QA files whose questions enter no training or validation
    pair, from any file: an evaluation may then test on all of their questions."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sets = PairSets()
    sets.files_sha256 = {f: hashlib.sha256((data / f).read_bytes()).hexdigest() for f in FILES}
    fever = _rows(data / FEVER_DEV)
    left_out = excluded_questions(data, tuple(exclude_files))
    qa_all = _qa_rows(data)
    qa = [q for q in qa_all if _norm(q.question) not in left_out]
    held_out = evaluation_texts(fever, qa_all)
    held_out |= {dedupe_key(q.question) for q in qa_all if _norm(q.question) in left_out}
    ft_rows, ft_digest = ft.read(data)
    sets.files_sha256[ft.FILE] = ft_digest
    look_alikes = ft.LookAlikes(ft_rows, held_out)
    for row in fever:       # validation only: FEVER's evaluation side
        claim, label = row["question"], row["label"]
        evidence = row.get("derived_evidence_sentences") or []
        if label in ("SUPPORTS", "REFUTES") and evidence:
            sets.nli_val.append((fever_premise(evidence), claim, ENT if label == "SUPPORTS" else CON))
        elif label == "NOT ENOUGH INFO":
            premise = look_alikes.best(claim)      # from FEVER train: no evaluation text in it
            if premise is not None:
                sets.nli_val.append((premise, claim, NEU))
    qa_groups = []
    for q in qa:
        pos, neg = q.passages(True), q.passages(False)
        if is_validation(q.question):
            if q.source.startswith("hotpotqa") and q.source != "hotpotqa_fullwiki" and pos:
                sets.rerank_val.append({"question": q.question, "paragraphs": q.passages(),
                                        "gold": [i for i, p in enumerate(q.paragraphs) if p[2]]})
            continue
        if not pos or not neg:
            continue        # fullwiki rows whose retrieved context misses every gold page
        qa_groups.append(RerankGroup(q.question, tuple(pos), tuple(neg)))
        if q.source in ("hotpotqa", "2wiki", "musique"):
            # "the passage addresses the question" for the query-entailment signal
            sets.nli_train.append((pos[int(rng.integers(len(pos)))], q.question, ENT))
            sets.nli_train.append((neg[int(rng.integers(len(neg)))], q.question, NEU))
    # the reranker's FEVER negatives are FEVER sentences, like its positives: mined from
    # the mixed pool they were mostly long QA paragraphs, and held-out HotpotQA recall@3
    # fell from 0.786 to 0.714 (same seed and settings, measured here)
    groups_ft, rerank_stats = ft.rerank_groups(ft_rows, look_alikes, held_out, rerank_fever_groups,
                                               RERANK_FEVER_NEGATIVES, seed)
    fever_groups = [RerankGroup(q, pos, neg) for q, pos, neg in groups_ft]
    groups = qa_groups + fever_groups
    sets.rerank_train = [groups[i] for i in rng.permutation(len(groups))]
    sets.nli_train = [sets.nli_train[i] for i in rng.permutation(len(sets.nli_train))]
    if general_sources is not None:
        sets.general = load_general(data, held_out, general_sources, max_train_pairs, seed)
    if max_train_pairs:
        sets.nli_train = sets.nli_train[:max_train_pairs]
        sets.rerank_train = sets.rerank_train[:max(1, max_train_pairs // 8)]
    if fever_train.pairs > 0:       # after the cut: their number is their own setting
        extra = ft.build(data, fever_train.pairs, held_out, titles=fever_train.titles,
                         max_sentences=fever_train.max_sentences, seed=seed, pool=look_alikes,
                         rows=ft_rows, digest=ft_digest)
        sets.fever_train = extra.stats
        sets.nli_train += extra.pairs
        if augment:     # own generator: the other draws do not depend on it
            real = {_norm(r["question"]) for r in fever} | {_norm(r["claim"]) for r in ft_rows}
            synthetic = _mutations(extra.labeled, real, np.random.default_rng([seed, 1]))
            sets.fever_train["mutations"] = len(synthetic)
            sets.nli_train += synthetic
        mix = np.random.default_rng([seed, 3])
        sets.nli_train = [sets.nli_train[i] for i in mix.permutation(len(sets.nli_train))]
    # Wikipedia repeats itself: QA paragraphs and general NLI premises hold FEVER dev evidence
    # sentences verbatim (32 texts of 230k under the full settings); a pair or reranker query that
    # contains one is dropped whole
    dropped = _drop_containing(sets, SentenceFinder(evidence_sentences(fever)))
    sets.split = {"rule": SPLIT_RULE, "validation_percent": 20,
                  "excluded_files": {FEVER_DEV: sets.files_sha256[FEVER_DEV],
                                     **{f: sets.files_sha256[f] for f in exclude_files}},
                  **({"excluded_qa_rows": len(qa_all) - len(qa)} if exclude_files else {}),
                  "evaluation_texts": len(held_out),
                  "fever_train_removed": {**(sets.fever_train.get("removed") or {}),
                                          "rerank_claims_skipped": rerank_stats["skipped_evaluation_overlap"]},
                  "removed_containing_evaluation_sentence": dropped,
                  "nli_train": len(sets.nli_train), "nli_val": len(sets.nli_val),
                  **({"nli_train_from_fever_train": sets.fever_train["pairs"]} if sets.fever_train else {}),
                  "rerank_train_groups": len(sets.rerank_train),
                  "rerank_fever_groups": len(fever_groups),
                  "rerank_val_questions": len(sets.rerank_val)}
    return sets


class SentenceFinder:
    """Finds which of a set of sentences occur inside longer texts (word-level, dedupe_key form).

    Each sentence is keyed by its first few words; a text's windows are looked up
    and confirmed word by word, so a check over every training pair takes seconds.
    """

    KEY_WORDS = 5

    def __init__(self, sentences) -> None:
        self._by_key: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
        for s in sentences:
            words = tuple(dedupe_key(s).split())
            if words:
                self._by_key.setdefault(words[:self.KEY_WORDS], []).append(words)
        self._lengths = sorted({len(k) for k in self._by_key})

    def found_in(self, text: str) -> list[str]:
        words = dedupe_key(text).split()
        hits = []
        for i in range(len(words)):
            for n in self._lengths:
                for sentence in self._by_key.get(tuple(words[i:i + n]), ()):
                    if tuple(words[i:i + len(sentence)]) == sentence:
                        hits.append(" ".join(sentence))
        return hits


def training_texts(sets: PairSets) -> list[str]:
    """Every text a fine-tuning stage reads: NLI pairs (FEVER/QA and general) and reranker groups."""
    out = [t for p, h, _ in sets.nli_train for t in (p, h)]
    if sets.general is not None:
        out += [t for p, h, _ in sets.general.train for t in (p, h)]
    for g in sets.rerank_train:
        out += [g.query, *g.positives, *g.negatives]
    return out


def fever_evaluation_leaks(data: Path, sets: PairSets) -> dict[str, int]:
    """How many training texts contain a FEVER dev evidence sentence or are a dev claim: 0 under SPLIT_RULE."""
    fever = _rows(data / FEVER_DEV)
    finder = SentenceFinder(evidence_sentences(fever))
    claims = {dedupe_key(row["question"]) for row in fever}
    texts = training_texts(sets)
    return {"texts": len(texts),
            "with_evidence_sentence": sum(1 for t in texts if finder.found_in(t)),
            "dev_claims": sum(1 for t in texts if dedupe_key(t) in claims)}


def _drop_containing(sets: PairSets, finder: SentenceFinder) -> dict[str, int]:
    """Drops every training pair / reranker query with a text that contains one of `finder`'s sentences."""
    def clean(*texts: str) -> bool:
        return not any(finder.found_in(t) for t in texts)

    before = (len(sets.nli_train), len(sets.general.train) if sets.general else 0, len(sets.rerank_train))
    sets.nli_train = [r for r in sets.nli_train if clean(r[0], r[1])]
    if sets.general is not None:
        sets.general.train = [r for r in sets.general.train if clean(r[0], r[1])]
        sets.general.stats = {**sets.general.stats, "train_pairs": len(sets.general.train),
                              "removed_containing_evaluation_sentence": before[1] - len(sets.general.train)}
    sets.rerank_train = [g for g in sets.rerank_train if clean(g.query, *g.positives, *g.negatives)]
    return {"nli_pairs": before[0] - len(sets.nli_train),
            "general_pairs": before[1] - (len(sets.general.train) if sets.general else 0),
            "rerank_queries": before[2] - len(sets.rerank_train)}
