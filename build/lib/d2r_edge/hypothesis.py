"""How a short QA answer becomes an NLI hypothesis for `e_r` (Alg. 1's response entailment).

An NLI model judges statements; a bare noun phrase ("NHL") is not one, so a
correct short answer is rarely "entailed" by its passage. The forms:
- `bare`: the answer as generated (the reference code's choice);
- `question_answer`: the question followed by the answer;
- `statement`: a declarative sentence built from both by a few wh-question rules
  ("Which band released Abbey Road?" + "The Beatles" -> "The Beatles released
  Abbey Road."), falling back to "The answer to "<question>" is <answer>.".
Which form separates right from wrong answers best is measured, not assumed
(`d2r-edge eval answers --task qa` reports it on the training queries). On the
first answers of Qwen2.5-0.5B to 68 held-out HotpotQA (IRCoT) questions, with the
offline NLI, the share entailed was right 14% / wrong 9% (bare), 100% / 100%
(question_answer) and 71% / 57% (statement): `statement` is the default.
"""

from __future__ import annotations

import re
from enum import Enum

_AUX = {"is", "was", "are", "were", "did", "does", "do", "has", "have", "had", "can", "could", "will",
        "would", "should", "may", "might"}
_WH = re.compile(r"^(what|which|who|whom|whose|where|when|how many|how much|how long|how old|how)\b", re.I)


class HypothesisForm(str, Enum):
    BARE = "bare"
    QUESTION_ANSWER = "question_answer"
    STATEMENT = "statement"


def _verbish(word: str) -> bool:
    w = word.lower()
    return w in _AUX or (len(w) > 4 and w.endswith("ed"))


def statement(question: str, answer: str) -> str:
    q = " ".join(question.split()).rstrip("?").strip()
    a = answer.strip().rstrip(".")
    m = _WH.match(q)
    words = q[m.end():].split() if m else []
    if m and words:
        wh = m.group(1).lower()
        if wh in ("what", "which", "who", "whom", "whose"):
            if words[0].lower() in _AUX and len(words) > 1:
                # "What is the capital of France" -> "the capital of France is Paris"
                return f"{' '.join(words[1:])} {words[0]} {a}."
            for i, w in enumerate(words):
                if _verbish(w):
                    # "Which band released X" -> "<answer> released X"
                    return f"{a} {' '.join(words[i:])}."
        elif wh in ("when", "where") and words[0].lower() in _AUX and len(words) > 1:
            # "When was X born" -> "X born in 1961"
            return f"{' '.join(words[1:])} {'in' if wh == 'where' or a[:1].isdigit() else 'on'} {a}."
    return f'The answer to "{q}?" is {a}.'


def hypothesis(form: HypothesisForm, question: str, answer: str) -> str:
    """The NLI hypothesis that stands for a QA answer (empty answer: empty hypothesis)."""
    if not answer or not answer.strip() or form is HypothesisForm.BARE:
        return answer or ""
    if form is HypothesisForm.QUESTION_ANSWER:
        return f"{question.strip()} {answer.strip()}"
    return statement(question, answer)
