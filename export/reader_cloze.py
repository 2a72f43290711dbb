"""Cloze span examples from FEVER 1.0 train to pretrain the reader (issue 53).

The QA samples give the reader ~1,500 span examples, too few to learn to read
(held-out EM 0.049, below a BM25 title baseline). FEVER train has ~80k SUPPORTS
claims with the text of their evidence sentences; a claim restates what its
evidence says, so a name or number shared by claim and evidence is a span
question for free (Lewis et al. 2019, "Unsupervised Question Answering by Cloze
Translation"):

    claim     "Nikolaj Coster-Waldau worked with the Fox Broadcasting Company."
    evidence  "... in the short-lived Fox television series New Amsterdam ..."
    question  "Nikolaj Coster-Waldau worked with the what Broadcasting Company?"
    answer    "Fox", at its offset in the evidence

The masked span is a capitalized name (connectors such as "of" allowed inside)
or a number, present in the evidence on word boundaries; its wh-word is "what
year" for a year, "how many" for another number, else "what". The passage is the
claim's first `max_sentences` distinct evidence sentences, detokenized from
FEVER's wiki form (-LRB-, " , "). Each positive brings `negatives` no-answer
passages: other claims' evidence that does not hold the answer.

Held out: every claim whose text or any evidence sentence is a text of the
evaluation side (FEVER dev, `evaluation_texts`), and every claim with an
evidence sentence that shares a run of `SHINGLE_WORDS` words with a held-out QA
paragraph (the paragraphs of the excluded QA files and of the held-out
questions: FEVER and HotpotQA both read the introductions of Wikipedia pages,
so the same sentence can be a test question's evidence).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
from d2r_edge_export.nli_general import dedupe_key

from d2r_edge_export.reader_data import SpanExample, find_answer

_ESCAPES = {"-LRB-": "(", "-RRB-": ")", "-LSB-": "[", "-RSB-": "]", "-LCB-": "{", "-RCB-": "}",
            "``": '"', "''": '"'}
_CONNECTORS = {"of", "the", "and", "de", "von", "van", "la", "le", "del", "da", "du", "des", "y", "&", "on",
               "in", "for", "a", "an", "to"}
# capitalized words that open a sentence without naming anything ("The" and "A" may open a title)
_NOT_NAMES = {"There", "It", "He", "She", "They", "This", "That", "In", "On", "At", "As", "By", "Some", "No",
              "One", "His", "Her", "Its", "Their", "I", "We", "You"}
_ARTICLES = {"The", "A", "An"}
_WORD = re.compile(r"\S+")
_YEAR = re.compile(r"^(1[0-9]|20)\d\d$")
_NUMBER = re.compile(r"^\d[\d,.]*$")
# a FEVER sentence shares a run of this many words with a held-out paragraph: the same sentence (the two sources
# render dashes, quotes and abbreviations differently, so whole-sentence keys missed 5 of 2,000)
SHINGLE_WORDS = 8


def detokenize(text: str) -> str:
    """FEVER's wiki form to plain text: "Fox -LRB- US -RRB- , inc ." -> "Fox (US), inc."."""
    for k, v in _ESCAPES.items():
        text = text.replace(k, v)
    text = re.sub(r"\(\s+", "(", text)
    text = re.sub(r"\[\s+", "[", text)
    text = re.sub(r"\s+([)\],.;:!?%])", r"\1", text)
    text = re.sub(r"\s+('s|'re|'ve|'ll|'d|n't|')(?=\s|$)", r"\1", text)
    text = re.sub(r'"\s+(.*?)\s+"', r'"\1"', text)
    return re.sub(r"\s+", " ", text).strip()


def words(text: str) -> list[str]:
    """Lowercased letter/digit runs: what two renderings of one sentence share ("Fox -LRB- US -RRB-" / "Fox (US)")."""
    return re.findall(r"[^\W_]+", detokenize(text).lower())


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[str]:
    """Every run of `n` words of `text` (the whole text when shorter)."""
    w = words(text)
    return {" ".join(w[i:i + n]) for i in range(max(1, len(w) - n + 1))} if w else set()


def claim_spans(claim: str, max_words: int = 6) -> list[str]:
    """Names and numbers of a claim, longest first within each run of words (see the module docstring)."""
    words = [w.strip(".,;:!?\"()") for w in _WORD.findall(claim)]
    out: list[str] = []
    run: list[str] = []

    def close() -> None:
        while run and run[-1] in _CONNECTORS:
            run.pop()
        if run and run[0] in _NOT_NAMES and len(run) > 1:
            run.pop(0)
        if run and len(run) <= max_words and not (len(run) == 1 and run[0] in _NOT_NAMES | _ARTICLES):
            out.append(" ".join(run).removesuffix("'s"))
        run.clear()

    for i, w in enumerate(words):
        if _NUMBER.match(w):            # "in 1997 American" -> "1997"; "Apollo 11" stays whole
            if not run:
                out.append(w)
            else:
                run.append(w)
                close()
        elif w and w[0].isupper():
            run.append(w)
        elif run and w in _CONNECTORS and i + 1 < len(words) and words[i + 1][:1].isupper():
            run.append(w)
        else:
            close()
    close()
    return [s for s in dict.fromkeys(out) if s]


def wh_word(span: str) -> str:
    if _YEAR.match(span):
        return "what year"
    if _NUMBER.match(span):
        return "how many"
    return "what"


def cloze_question(claim: str, span: str) -> str | None:
    """The claim with `span` (its first occurrence on word boundaries) as a wh-word, ending in "?"."""
    m = re.search(rf"(?<!\w){re.escape(span)}(?!\w)", claim)
    if m is None:
        return None
    q = claim[:m.start()] + wh_word(span) + claim[m.end():]
    q = q.strip().rstrip(".").strip()
    return q[:1].upper() + q[1:] + "?"


@dataclass
class ClozeSet:
    examples: list[SpanExample] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def build_cloze(rows: list[dict], n_positives: int, evaluation_texts: set[str], blocked_shingles: set[str],
                seed: int = 0, negatives: int = 1, max_sentences: int = 3) -> ClozeSet:
    """Up to `n_positives` cloze questions (each with `negatives` no-answer passages), claims in a seeded order."""
    rng = np.random.default_rng([seed, 53])
    supports = [r for r in rows if r.get("label") == "SUPPORTS" and r.get("evidence")]
    removed = {"claim_in_evaluation": 0, "evidence_in_evaluation": 0, "evidence_in_blocked_passage": 0,
               "no_shared_span": 0}
    positives: list[SpanExample] = []
    for i in rng.permutation(len(supports)):
        if len(positives) >= n_positives:
            break
        r = supports[int(i)]
        if dedupe_key(r["claim"]) in evaluation_texts:
            removed["claim_in_evaluation"] += 1
            continue
        if any(dedupe_key(s) in evaluation_texts for s in r["evidence"]):
            removed["evidence_in_evaluation"] += 1
            continue
        if any(shingles(s) & blocked_shingles for s in r["evidence"]):
            removed["evidence_in_blocked_passage"] += 1
            continue
        passage = " ".join(detokenize(s) for s in list(dict.fromkeys(r["evidence"]))[:max_sentences])
        shared = [(s, start) for s in claim_spans(r["claim"]) if (start := find_answer(passage, s)) is not None]
        span, start = shared[int(rng.integers(len(shared)))] if shared else ("", None)
        question = cloze_question(r["claim"], span) if shared else None
        if question is None:
            removed["no_shared_span"] += 1
            continue
        positives.append(SpanExample(question, passage, passage[start:start + len(span)], start))
    negatives_out: list[SpanExample] = []
    for i, pos in enumerate(positives):
        if len(positives) < 2:
            break
        for _ in range(negatives):
            for _try in range(5):
                j = int(rng.integers(len(positives)))
                if j != i and find_answer(positives[j].passage, pos.answer) is None:
                    negatives_out.append(SpanExample(pos.question, positives[j].passage, "", None))
                    break
    examples = positives + negatives_out
    out = ClozeSet([examples[int(k)] for k in rng.permutation(len(examples))])
    out.stats = {"source": "fever_train SUPPORTS claims", "positives": len(positives),
                 "negatives": len(negatives_out), "requested": n_positives, "max_sentences": max_sentences,
                 "seed": seed, "wh": {w: sum(wh_word(p.answer) == w for p in positives)
                                      for w in ("what", "what year", "how many")},
                 "removed": removed}
    return out


def cloze_for_reader(sets, data, n_positives: int, seed: int = 0, negatives: int = 1) -> None:
    """Fill `sets.pretrain` (a `ReaderSets`) with cloze examples held out as the module docstring says."""
    from d2r_edge_export import fever_train
    from d2r_edge_export.finetune_data import FEVER_DEV, _qa_rows, _rows, evaluation_texts

    rows, digest = fever_train.read(data)
    held_out = evaluation_texts(_rows(data / FEVER_DEV), _qa_rows(data))
    blocked = set().union(*(shingles(p) for p in sets.heldout_passages)) if sets.heldout_passages else set()
    cloze = build_cloze(rows, n_positives, held_out, blocked, seed, negatives)
    sets.pretrain = cloze.examples
    sets.files_sha256[fever_train.FILE] = digest
    sets.stats["cloze"] = {**cloze.stats, "blocked_passage_shingles": len(blocked), "shingle_words": SHINGLE_WORDS}
