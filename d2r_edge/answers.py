"""Answers compared with gold: SQuAD normalization, EM, token F1, containment, FEVER's labels.

Runtime concepts (the runner scores records, the detector and the trajectory mode normalize
answers) that the evaluation also uses: they live here, below both.
"""

from __future__ import annotations

import re
import string
from collections import Counter

FEVER_CLASSES = ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD's normalization: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, answers) -> float:
    """1.0 when the normalized prediction equals any normalized gold answer."""
    p = normalize_answer(prediction or "")
    return float(any(p == normalize_answer(a) for a in answers))


def contains_answer(prediction: str, answers) -> float:
    """1.0 when a normalized gold answer occurs, on token boundaries, in the normalized prediction.

    For generators that answer with a sentence (the extractive one): EM is 0 by construction there.
    """
    p = f" {normalize_answer(prediction or '')} "
    return float(any(g and f" {g} " in p for g in map(normalize_answer, answers)))


def _f1(prediction: str, answer: str) -> float:
    p, g = normalize_answer(prediction).split(), normalize_answer(answer).split()
    # HotpotQA's official script: yes/no/noanswer only match exactly
    if (p and p[0] in ("yes", "no", "noanswer") or g and g[0] in ("yes", "no", "noanswer")) and p != g:
        return 0.0
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, answers) -> float:
    """SQuAD token F1 against the best-matching gold answer."""
    return max((_f1(prediction or "", a) for a in answers), default=0.0)


def fever_label(value: str | None) -> str:
    """Gold or predicted label on FEVER's 3 classes; UNVERIFIED (and nothing) count as NOT ENOUGH INFO."""
    norm = str(value or "").strip().upper().replace("_", " ")
    if norm in ("SUPPORTS", "REFUTES"):
        return norm
    return "NOT ENOUGH INFO"
