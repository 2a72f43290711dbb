"""Span examples from ../shared/data for the offline reader (issue 53).

A reader answers a question from one passage: the answer's characters in the
passage, or "no answer here" (the [CLS] position). Its training examples are the
multi-hop QA samples' questions under the split the other roles use
(`d2r_edge.eval.split`): held-out questions are its validation side, and the QA
files given to `--finetune-exclude` enter neither side (an evaluation may then
test on all of their questions).

For each training question whose answer occurs in a supporting paragraph, that
paragraph is a positive example (the answer's first occurrence, case-insensitive,
on word boundaries); one other paragraph of the question that does not contain
the answer is a no-answer example per positive (`negatives`), so the reader
learns to say when a passage holds nothing. Yes/no answers are no spans: their
questions train nothing (the reader cannot answer them, and says so at run time
by its low confidence). Passages are ``title\\ntext``, as the runtime's
knowledge base stores them.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from d2r_edge_export.finetune_data import QA_FILES, _rows, excluded_questions

from d2r_edge.eval.split import is_validation, normalize_text

NOT_SPANS = frozenset({"yes", "no"})


@dataclass(frozen=True)
class SpanExample:
    question: str
    passage: str                       # "title\ntext"
    answer: str                        # "" for a no-answer example
    answer_start: int | None           # character offset in `passage`; None: no answer here


@dataclass(frozen=True)
class ReaderQuestion:
    """A held-out question with all of its paragraphs and its gold answers (validation)."""

    source: str
    question: str
    passages: tuple[str, ...]
    answers: tuple[str, ...]


@dataclass
class ReaderSets:
    train: list[SpanExample] = field(default_factory=list)
    val: list[ReaderQuestion] = field(default_factory=list)
    # the first stage's examples: FEVER-train cloze questions (export/reader_cloze.py), none by default
    pretrain: list[SpanExample] = field(default_factory=list)
    # the paragraphs of the excluded files' and the held-out questions: no pretraining text may be one of theirs
    heldout_passages: set[str] = field(default_factory=set)
    files_sha256: dict[str, str] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    def split(self) -> dict:
        """The manifest's record of the split, in the form every role writes (`excluded_files`: file ->
        sha256), which `eval answers` reads to refuse test files a role trained on."""
        excluded = self.stats.get("excluded_files") or []
        return {"rule": self.stats.get("validation_rule"),
                "excluded_files": {f: self.files_sha256[f] for f in excluded}}

    def train_sha256(self) -> str:
        rows = [[e.question, e.passage, e.answer, e.answer_start] for e in self.train]
        if self.pretrain:           # absent, not empty: readers trained before the cloze stage keep their key
            rows = {"pretrain": [[e.question, e.passage, e.answer, e.answer_start] for e in self.pretrain],
                    "train": rows}
        return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class _QARow:
    source: str
    question: str
    passages: tuple[str, ...]
    support: tuple[bool, ...]
    answers: tuple[str, ...]
    hops: tuple[tuple[str, str, int], ...] = ()      # single-hop (question, answer, passage index)


def _hop_question(subject: str, relation: str) -> str:
    return f"What is the {relation} of {subject}?"


def _musique_hops(row: dict) -> tuple[tuple[str, str, int], ...]:
    """MuSiQue's decomposition ("X >> relation", "#1 >> relation") as questions, #k filled in."""
    by_idx = {p["idx"]: i for i, p in enumerate(row["paragraphs"])}
    out, answers = [], []
    for d in row.get("question_decomposition") or []:
        subject, sep, relation = str(d.get("question") or "").partition(" >> ")
        for k, a in enumerate(answers, 1):
            subject = subject.replace(f"#{k}", a)
        answers.append(str(d.get("answer") or ""))
        if sep and answers[-1] and d.get("paragraph_support_idx") in by_idx:
            out.append((_hop_question(subject, relation), answers[-1], by_idx[d["paragraph_support_idx"]]))
    return tuple(out)


def _wiki_hops(row: dict) -> tuple[tuple[str, str, int], ...]:
    """2WikiMultihopQA's evidence triples (subject, relation, object) asked of the subject's paragraph."""
    by_title = {t: i for i, (t, _) in enumerate(row["context"])}
    return tuple((_hop_question(s, r), o, by_title[s]) for s, r, o in row.get("evidences") or []
                 if s in by_title and str(o).strip())


def qa_questions(data: Path) -> list[_QARow]:
    """Every QA file's questions: paragraphs as passages with their supporting flags, gold answers."""
    out: list[_QARow] = []

    def add(source: str, question: str, paras: list[tuple[str, str, bool]], answers: list[str],
            hops: tuple = ()) -> None:
        out.append(_QARow(source, question, tuple(f"{t}\n{x}" for t, x, _ in paras), tuple(s for _, _, s in paras),
                          tuple(a for a in answers if a.strip()), hops))

    for source, name in (("hotpotqa", "hotpotqa"), ("2wiki", "2wikimultihopqa"),
                         ("hotpotqa_fullwiki", "hotpotqa_fullwiki")):
        for row in _rows(data / name / "dev.jsonl"):
            support = {t for t, _ in row.get("supporting_facts") or []}
            paras = [(t, "".join(s) if isinstance(s, list) else str(s), t in support) for t, s in row["context"]]
            add(source, row["question"], paras, [str(row.get("answer") or "")],
                _wiki_hops(row) if source == "2wiki" else ())
    for row in _rows(data / "musique" / "dev.jsonl"):
        paras = [(p["title"], p["paragraph_text"], bool(p.get("is_supporting"))) for p in row["paragraphs"]]
        add("musique", row["question"], paras,
            [str(row.get("answer") or ""), *map(str, row.get("answer_aliases") or [])], _musique_hops(row))
    for row in _rows(data / "hotpotqa_ircot_subsample" / "dev.jsonl"):
        paras = [(c["title"], c["paragraph_text"], bool(c.get("is_supporting"))) for c in row["contexts"]]
        spans = [s for obj in row.get("answers_objects") or [] for s in obj.get("spans") or []]
        add("hotpotqa_ircot", row["question_text"], paras, [str(s) for s in spans])
    return out


def find_answer(passage: str, answer: str) -> int | None:
    """The first case-insensitive occurrence of `answer` in `passage` on word boundaries, or None."""
    if not answer.strip():
        return None
    m = re.search(rf"(?<!\w){re.escape(answer.strip())}(?!\w)", passage, flags=re.IGNORECASE)
    return None if m is None else m.start()


def build_reader_sets(data: Path, exclude_files: tuple[str, ...] = (), seed: int = 0,
                      negatives: int = 1) -> ReaderSets:
    """Training span examples and held-out validation questions (module docstring)."""
    rng = np.random.default_rng(seed)
    sets = ReaderSets()
    sets.files_sha256 = {f: hashlib.sha256((data / f).read_bytes()).hexdigest() for f in QA_FILES}
    left_out = excluded_questions(data, tuple(exclude_files))
    counts = {"questions": 0, "excluded": 0, "validation": 0, "no_span_answer": 0, "positives": 0,
              "single_hop_positives": 0, "negatives": 0}
    seen: set[str] = set()
    for q in qa_questions(data):
        key = normalize_text(q.question)
        counts["questions"] += 1
        if key in left_out:
            counts["excluded"] += 1
            sets.heldout_passages.update(q.passages)
            continue
        if key in seen:          # the IRCoT subsample repeats HotpotQA questions
            continue
        seen.add(key)
        answers = [a for a in q.answers if normalize_text(a) not in NOT_SPANS]
        if is_validation(q.question):
            sets.heldout_passages.update(q.passages)
            if answers:
                sets.val.append(ReaderQuestion(q.source, q.question, q.passages, tuple(answers)))
                counts["validation"] += 1
            continue
        examples = []
        if answers:
            examples += [(q.question, tuple(answers), i) for i, sup in enumerate(q.support) if sup]
        else:
            counts["no_span_answer"] += 1
        examples += [(hq, (ha,), i) for hq, ha, i in q.hops if normalize_text(ha) not in NOT_SPANS]
        for question, golds, idx in examples:
            passage = q.passages[idx]
            start = find_answer(passage, golds[0])
            if start is None:
                continue
            sets.train.append(SpanExample(question, passage, passage[start:start + len(golds[0].strip())], start))
            counts["positives" if question == q.question else "single_hop_positives"] += 1
            empty = [p for p in q.passages if not any(find_answer(p, g) is not None for g in golds)]
            for i in rng.permutation(len(empty))[:negatives]:
                sets.train.append(SpanExample(question, empty[int(i)], "", None))
                counts["negatives"] += 1
    sets.train = [sets.train[i] for i in rng.permutation(len(sets.train))]
    sets.stats = {**counts, "train_examples": len(sets.train), "excluded_files": list(exclude_files),
                  "validation_rule": "split.is_validation (20 of 100 hash buckets)"}
    return sets
