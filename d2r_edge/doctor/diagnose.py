"""Doctor-RAG's diagnosis of a failed trajectory, on the small NLI: `(type, culprit_step_label)`.

The paper's four phases, in its priority order, with checks a 22M-parameter
NLI and a few rules can do instead of a distilled 8B diagnoser:

1. Format: the prediction means the gold answer but fails EM (containment or
   one's words a subset of the other's, with token F1 >= 0.5; number words,
   plurals; FEVER label spellings; where those cannot decide and the two share a
   word, the NLI must entail each answer's statement from the other's).
   Culprit: none.
2. Evidence sufficiency over all the trajectory's evidence: a gold answer appears
   in it, or some evidence window entails the question-gold statement (FEVER:
   entails / contradicts the claim as the gold label says; a NOT ENOUGH INFO gold
   leaves nothing to retrieve, so the evidence counts as sufficient).
3. Sufficient -> Reasoning error at the earliest reasoning step that the evidence
   seen so far contradicts, or that names an entity found neither in the question
   nor in that evidence; if no step is flagged, the last reasoning step before
   the answer (where the wrong conclusion was drawn).
4. Insufficient -> entity provenance of every search query: each key entity
   (capitalized names, numbers, quoted strings) must come from the question or
   from evidence returned before it. All queries poisoned -> Search error at the
   first poisoned action; otherwise Retriever error at the evidence block of the
   first valid query (none of them returned the answer).

Only phases 1 and 2 have labels checkable without a teacher LLM (gold vs
prediction; gold answer in the evidence): `doctor diagnose` reports agreement
with those simple rules. The step localization has no gold label here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from d2r_edge.answers import exact_match, normalize_answer, token_f1
from d2r_edge.doctor.trajectory import Step, StepKind, Trajectory
from d2r_edge.hypothesis import statement


class ErrorType(str, Enum):
    FORMAT = "format"
    REASONING = "reasoning"
    RETRIEVER = "retriever"
    SEARCH = "search"


@dataclass(frozen=True)
class DoctorSettings:
    entail_threshold: float = 0.5          # NLI probability that counts as entailed
    contradict_threshold: float = 0.5
    format_min_f1: float = 0.5             # containment counts as the same answer from this token F1 on
    window_sentences: int = 3              # evidence windows the NLI reads (its max length is 128 tokens)
    max_windows: int = 24                  # per check, the first ones (long trajectories)


@dataclass(frozen=True)
class DoctorDiagnosis:
    line: int
    type: ErrorType
    culprit: str | None
    sufficient: bool
    signals: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"line": self.line, "type": self.type.value, "culprit": self.culprit,
                "sufficient": self.sufficient, "signals": self.signals}


_WORD_NUMBERS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}
_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_PLAN = re.compile(r"^\s*(i need|i should|i will|i'll|i must|i can|i have to|i want|let me|let's|now i|"
                   r"next|so i|maybe|perhaps|to find|to answer|i could)\b", re.I)
_ENTITY = re.compile(r"\"[^\"]{2,60}\"|\b\d[\d,.:/-]*\b|"
                     r"\b[A-Z][\w'’.-]*(?:\s+(?:of|the|de|von|van|and|for|in|on|du|la|le|&)?\s*[A-Z0-9][\w'’.-]*)*")
_STOP_CAPS = {"i", "the", "a", "an", "it", "this", "that", "these", "those", "he", "she", "they", "we",
              "what", "which", "who", "when", "where", "how", "why", "so", "but", "and", "or", "if",
              "thought", "action", "observation", "there", "then", "now", "yes", "no", "however",
              "since", "because", "both", "according", "based", "also", "as", "in", "on", "at", "to",
              "for", "of", "by", "with", "from", "after", "before", "while", "although", "therefore"}


def _tokens(text: str) -> set[str]:
    return {w.removesuffix("'s").removesuffix("’s") for w in re.findall(r"\w+(?:['’]\w+)*", text.lower())}


def key_entities(text: str) -> list[str]:
    """Names, numbers and quoted strings: what must have a source for a query to be valid."""
    out = []
    for m in _ENTITY.finditer(text):
        ent = m.group(0).strip("\"'.,- ")
        words = ent.split()
        while words and words[0].lower() in _STOP_CAPS:
            words = words[1:]
        ent = " ".join(words)
        if ent and (len(ent) > 1 or ent.isdigit()) and ent.lower() not in _STOP_CAPS:
            out.append(ent)
    return list(dict.fromkeys(out))


def unsupported(entities: list[str], source: str) -> list[str]:
    """The entities with a word that appears nowhere in the source text."""
    have = _tokens(source)
    return [e for e in entities if not _tokens(e) <= have]


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENT.split(" ".join(text.split())) if s.strip()]


def answer_in(answers: tuple[str, ...], text: str) -> bool:
    """A gold answer appears in `text` (SQuAD-normalized, on word boundaries)."""
    norm = f" {normalize_answer(text)} "
    return any(a and f" {a} " in norm for a in (normalize_answer(x) for x in answers))


_FEVER_SPELLINGS = {"SUPPORTED": "SUPPORTS", "SUPPORT": "SUPPORTS", "TRUE": "SUPPORTS", "REFUTED": "REFUTES",
                    "FALSE": "REFUTES", "NEI": "NOT ENOUGH INFO", "NOT ENOUGH INFORMATION": "NOT ENOUGH INFO"}


def fever_spelling(text: str | None) -> str | None:
    """The FEVER label a prediction spells, in any of its usual spellings; None if none."""
    p = re.sub(r"[^A-Z ]", "", (text or "").upper().replace("_", " ")).strip()
    label = _FEVER_SPELLINGS.get(p, p)
    return label if label in ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO") else None


def answer_correct(t: Trajectory, answer: str | None) -> bool:
    """Strict EM of `answer` for the trajectory's question (FEVER: the label, case aside)."""
    if answer is None:
        return False
    if t.task == "fever":
        return answer.strip().upper() == t.gold[0].strip().upper()
    return bool(exact_match(answer, t.gold))


def is_success(t: Trajectory) -> bool:
    return answer_correct(t, t.prediction)


class TrajectoryDiagnoser:
    """`diagnose(trajectory)` for failed trajectories; `nli` is the runtime NLI (or a stand-in)."""

    def __init__(self, nli, settings: DoctorSettings = DoctorSettings()) -> None:
        self.nli, self.s = nli, settings
        names = [n.lower() for n in nli.labels]
        self.ent, self.con = names.index("entailment"), names.index("contradiction")

    # -- NLI helpers --------------------------------------------------------------------------
    def _windows(self, texts: list[str]) -> list[str]:
        out = []
        for text in texts:
            sents = sentences(text)
            w = self.s.window_sentences
            out += [" ".join(sents[i:i + w]) for i in range(0, len(sents), w)]
        return out[:self.s.max_windows]

    def _best(self, premises: list[str], hypothesis: str) -> tuple[float, float]:
        """(max entailment, max contradiction) probability of `hypothesis` over the premises."""
        if not premises or not hypothesis.strip():
            return 0.0, 0.0
        probs = np.asarray(self.nli.score([(p, hypothesis) for p in premises]))
        return float(probs[:, self.ent].max()), float(probs[:, self.con].max())

    # -- phases ---------------------------------------------------------------------------------
    def format_check(self, t: Trajectory) -> dict:
        pred = t.prediction or ""
        if t.task == "fever":
            same = bool(pred) and fever_spelling(pred) == t.gold[0].upper()
            return {"rule": "fever_label_spelling" if same else None, "format": same}
        f1 = token_f1(pred, t.gold)
        np_, golds = normalize_answer(pred), [normalize_answer(g) for g in t.gold]

        def stems(text: str) -> set[str]:       # number words as digits, a plural 's' dropped
            return {_WORD_NUMBERS.get(w, w).removesuffix("s") if len(w) > 3 else _WORD_NUMBERS.get(w, w)
                    for w in text.split()}

        words = stems(np_)
        rule = None
        if np_ and any(g and (g in np_ or np_ in g) for g in golds) and f1 >= self.s.format_min_f1:
            rule = "containment"
        elif np_ and any(words == stems(g) for g in golds):
            rule = "number_words_or_plural"
        elif np_ and f1 >= self.s.format_min_f1 and any(words <= stems(g) or stems(g) <= words for g in golds):
            rule = "token_subset"           # "naomi campbell" / "naomi elaine campbell"
        out = {"f1": round(f1, 3), "rule": rule, "format": rule is not None}
        if rule is None and f1 > 0:          # they share words, the rules cannot decide: NLI both ways
            a, b = statement(t.question, pred), statement(t.question, t.gold[0])
            probs = np.asarray(self.nli.score([(a, b), (b, a)]))
            both = float(probs[:, self.ent].min())
            out.update({"nli_equivalence": round(both, 3), "format": both >= self.s.entail_threshold,
                        "rule": "nli_equivalence" if both >= self.s.entail_threshold else None})
        return out

    def sufficiency(self, t: Trajectory) -> dict:
        evidence = [s.text for s in t.of(StepKind.EVIDENCE)]
        if t.task == "fever":
            gold = t.gold[0].upper()
            if gold == "NOT ENOUGH INFO":
                return {"sufficient": True, "rule": "gold_not_enough_info"}
            ent, con = self._best(self._windows(evidence), t.question)
            ok = (ent if gold == "SUPPORTS" else con) >= self.s.entail_threshold
            return {"sufficient": ok, "rule": "nli_verdict" if ok else None,
                    "nli_entail": round(ent, 3), "nli_contradict": round(con, 3)}
        if answer_in(t.gold, " ".join(evidence)):
            return {"sufficient": True, "rule": "gold_in_evidence", "gold_in_evidence": True}
        ent, _ = self._best(self._windows(evidence), statement(t.question, t.gold[0]))
        ok = ent >= self.s.entail_threshold
        return {"sufficient": ok, "rule": "nli_entails_gold_statement" if ok else None,
                "gold_in_evidence": False, "nli_entail": round(ent, 3)}

    def reasoning_checks(self, t: Trajectory, first_only: bool = True) -> list[dict]:
        """Each reasoning step: contradicted by the evidence seen so far, or naming an entity without
        a source? Stops after the first flagged step unless `first_only` is False."""
        checked = []
        for pos, step in enumerate(t.steps):
            if step.kind is not StepKind.REASONING:
                continue
            seen = [e.text for e in t.evidence_before(pos)]
            source = " ".join([t.question] + seen)
            claims = [c for c in sentences(step.text) if not _PLAN.match(c)]
            missing = unsupported([e for c in claims for e in key_entities(c)], source)
            contra = 0.0
            windows = self._windows(seen)
            for c in claims:
                ent, con = self._best(windows, c)
                if con >= self.s.contradict_threshold and ent < self.s.entail_threshold:
                    contra = max(contra, con)
            checked.append({"step": step.label, "claims": len(claims), "unsupported_entities": missing,
                            "contradicted": round(contra, 3), "flagged": bool(missing or contra)})
            if first_only and checked[-1]["flagged"]:
                break
        return checked

    def reasoning_culprit(self, t: Trajectory) -> tuple[str | None, list[dict]]:
        checked = self.reasoning_checks(t)
        if checked and checked[-1]["flagged"]:
            return checked[-1]["step"], checked
        reasoning = t.of(StepKind.REASONING)       # nothing flagged: where the wrong conclusion was drawn
        last = reasoning[-1] if reasoning else (t.of(StepKind.ANSWER) or [None])[-1]
        return (last.label if last else None), checked

    def query_provenance(self, t: Trajectory) -> list[dict]:
        out = []
        for pos, step in enumerate(t.steps):
            if step.kind is not StepKind.SEARCH:
                continue
            source = " ".join([t.question] + [e.text for e in t.evidence_before(pos)])
            ents = key_entities(step.text)
            missing = unsupported(ents, source)
            content = _tokens(step.text) - _STOP_CAPS
            vague = not ents and not (content & _tokens(source))
            out.append({"step": step.label, "query": step.text, "tool": step.tool.value if step.tool else None,
                        "entities": ents, "unsupported": missing, "poisoned": bool(missing) or vague})
        return out

    def diagnose(self, t: Trajectory) -> DoctorDiagnosis:
        fmt = self.format_check(t)
        signals: dict = {"format": fmt, "halted": t.prediction is None}
        if fmt["format"]:
            return DoctorDiagnosis(t.line, ErrorType.FORMAT, None, True, signals)
        suff = self.sufficiency(t)
        signals["sufficiency"] = suff
        if suff["sufficient"]:
            culprit, checked = self.reasoning_culprit(t)
            signals["reasoning"] = checked
            return DoctorDiagnosis(t.line, ErrorType.REASONING, culprit, True, signals)
        queries = self.query_provenance(t)
        signals["queries"] = queries
        if not queries:
            signals["no_search"] = True
            return DoctorDiagnosis(t.line, ErrorType.SEARCH, None, False, signals)
        valid = [q for q in queries if not q["poisoned"]]
        if not valid:
            return DoctorDiagnosis(t.line, ErrorType.SEARCH, queries[0]["step"], False, signals)
        action = next(s for s in t.of(StepKind.SEARCH) if s.label == valid[0]["step"])
        evidence: Step | None = t.evidence_for(action)
        culprit = evidence.label if evidence else action.label
        return DoctorDiagnosis(t.line, ErrorType.RETRIEVER, culprit, False, signals)
