"""Doctor-RAG's repair (Algorithm 2) and the baselines it is measured against.

Operators keep the valid prefix before the culprit, change only what the error
type names, and bound their LLM turns:

- format: a span of the evidence that means the prediction (best token F1, no
  LLM); the LLM only when no span matches. Also a list of >= 10 surface
  variants, for the paper's any-variant metric (reported apart from strict EM).
- reasoning: keep the reasoning before the culprit, re-reason over all the
  trajectory's evidence, answer in <answer> tags (one LLM call).
- retriever: keep the prefix, rewrite the failed query (LLM), re-retrieve from
  our knowledge base, answer from the kept and the new evidence (two calls).
- search: keep the prefix before the first poisoned action, then a ReAct loop
  (think, search our knowledge base, finish) with a fixed turn budget.

Baselines: `rerun` (the ReAct loop from scratch), `stepwise` (check each step in
order with the diagnoser's own checks, regenerate with the ReAct loop from the
first rejected one), `no_taxonomy` (one generic repair, the ReAct loop, from the
culprit) and `no_localization` (the type's operator from the start).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Protocol

from d2r_edge.answers import normalize_answer, token_f1
from d2r_edge.doctor.diagnose import (
    DoctorDiagnosis,
    ErrorType,
    TrajectoryDiagnoser,
    fever_spelling,
)
from d2r_edge.doctor.trajectory import StepKind, Trajectory
from d2r_edge.generate.base import json_object


class Method(str, Enum):
    DRRAG = "drrag"
    RERUN = "rerun"
    STEPWISE = "stepwise"
    NO_TAXONOMY = "no_taxonomy"
    NO_LOCALIZATION = "no_localization"


class Chat(Protocol):
    def __call__(self, messages: list[dict], max_tokens: int, stop: list[str] | None = None,
                 json_mode: bool = False):
        """-> an object with text, prompt_tokens, completion_tokens."""


@dataclass(frozen=True)
class RepairSettings:
    react_turns: int = 4             # search repair / rerun: think-search turns before a forced answer
    kb_top_k: int = 3                # passages per re-retrieval
    evidence_chars: int = 700        # per evidence block in a prompt (4k-token contexts)
    max_evidence_blocks: int = 6
    answer_tokens: int = 160


@dataclass
class Cost:
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    searches: int = 0


@dataclass
class RepairResult:
    line: int
    method: str
    type: str
    culprit: str | None
    answer: str | None
    variants: list[str] = field(default_factory=list)
    kept_steps: int = 0              # steps of the original trajectory reused as the prefix
    wall_s: float = 0.0
    cost: Cost = field(default_factory=Cost)
    trace: list[str] = field(default_factory=list)

    def record(self) -> dict:
        return {"line": self.line, "method": self.method, "type": self.type, "culprit": self.culprit,
                "answer": self.answer, "variants": self.variants, "kept_steps": self.kept_steps,
                "wall_s": round(self.wall_s, 3), "cost": vars(self.cost), "trace": self.trace}


_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S | re.I)
_ACTION = re.compile(r"Action\s*\d*\s*:\s*(search|finish)\s*\[(.*?)\]", re.I | re.S)
_SYSTEM = ("You answer a question from documents. Use only facts stated in the documents. "
           "The final answer is a short phrase (a name, date, number or a few words), not a sentence.")


_LABELS = re.compile(r"\b(SUPPORTS|SUPPORTED|REFUTES|REFUTED|NOT ENOUGH INFO(?:RMATION)?)\b", re.I)


def fever_label_in(text: str | None) -> str | None:
    """The FEVER label a reply names (the last one), None when it names none."""
    found = _LABELS.findall(text or "")
    if not found:
        return None
    word = found[-1].upper()
    return "SUPPORTS" if word.startswith("SUPPORT") else "REFUTES" if word.startswith("REFUT") else "NOT ENOUGH INFO"


def json_field(text: str, key: str) -> str | None:
    """`key` of the JSON object in `text` (repaired with json-repair when malformed), or None."""
    value = json_object(text).get(key)
    return str(value).strip() if value not in (None, "") else None


def extract_answer(text: str) -> str:
    m = _ANSWER.search(text or "")
    ans = m.group(1) if m else (text or "").strip().splitlines()[-1] if (text or "").strip() else ""
    return ans.strip().strip(".").strip()


def _stem(text: str) -> str:
    return " ".join(w.removesuffix("s") if len(w) > 3 else w for w in normalize_answer(text).split())


def best_span(prediction: str, texts: list[str], max_words: int = 8) -> tuple[str | None, float]:
    """The evidence n-gram with the best token F1 against the prediction (the answer as written there)."""
    target = _stem(prediction).split()
    if not target:
        return None, 0.0
    best, score = None, 0.0
    for text in texts:
        words = text.split()
        for i, w in enumerate(words):
            if _stem(w) not in target:
                continue
            for n in range(1, min(max_words, len(words) - i) + 1):
                span = " ".join(words[i:i + n]).strip(" ,;:.()\"'")
                f1 = token_f1(_stem(span), [_stem(prediction)])
                if f1 > score or (f1 == score and best is not None and len(span) < len(best)):
                    best, score = span, f1
    return best, score


def answer_variants(answer: str, extra: list[str] = ()) -> list[str]:
    """Surface forms of one answer: articles, case, parentheses, numbers, shortenings (no padding:
    a short answer may have fewer than the paper's 10; the report gives the mean count)."""
    base = [answer, *extra]
    out: list[str] = []
    for a in base:
        a = a.strip()
        no_paren = re.sub(r"\s*\(.*?\)", "", a).strip()
        no_article = re.sub(r"^(the|a|an)\s+", "", a, flags=re.I)
        words = no_article.split()
        out += [a, a.lower(), a.title(), no_paren, no_article, f"the {no_article}",
                no_article.replace("-", " "), no_article.replace("&", "and"), re.sub(r"[.,]", "", a)]
        if len(words) > 1:
            out += [words[-1], " ".join(words[:-1]), " ".join(words[1:])]     # surname-style shortenings
        out += [re.sub(r"\b(\d+)(st|nd|rd|th)\b", r"\1", a), re.sub(r",(\d{3})", r"\1", a)]
    seen, uniq = set(), []
    for v in out:
        if v and v not in seen:
            seen.add(v)
            uniq.append(v)
    return uniq


class Repairer:
    """Runs one method on one diagnosed trajectory. `search(query, k)` returns passages from our KB."""

    def __init__(self, chat: Chat, search: Callable[[str, int], list[str]], diagnoser: TrajectoryDiagnoser,
                 settings: RepairSettings = RepairSettings()) -> None:
        self.chat, self.search, self.diagnoser, self.s = chat, search, diagnoser, settings

    # -- plumbing -----------------------------------------------------------------------------------
    def _call(self, r: RepairResult, messages: list[dict], stop: list[str] | None = None,
              json_mode: bool = False) -> str:
        out = self.chat(messages, self.s.answer_tokens, stop, json_mode)
        r.cost.llm_calls += 1
        r.cost.prompt_tokens += int(out.prompt_tokens)
        r.cost.completion_tokens += int(out.completion_tokens)
        return out.text

    def _retrieve(self, r: RepairResult, query: str) -> list[str]:
        r.cost.searches += 1
        return self.search(query, self.s.kb_top_k)

    def _docs(self, texts: list[str]) -> str:
        blocks = [t[:self.s.evidence_chars] for t in texts if t.strip()][-self.s.max_evidence_blocks:]
        return "\n".join(f"[{i + 1}] {b}" for i, b in enumerate(blocks)) or "(none)"

    def _answer_from(self, r: RepairResult, t: Trajectory, docs: list[str], reasoning: list[str]) -> str:
        kept = "\n".join(reasoning) or "(none)"
        kind = ("one of SUPPORTS, REFUTES, NOT ENOUGH INFO (is the claim true?)" if t.task == "fever"
                else "a short phrase: a name, date, number or a few words, not a sentence")
        user = (f"Question: {t.question}\n\nDocuments:\n{self._docs(docs)}\n\nReasoning so far (valid):\n{kept}\n\n"
                f"Continue the reasoning in at most three sentences, using only the documents. Reply with JSON: "
                f'{{"reasoning": "...", "answer": "..."}} where the answer is {kind}.')
        text = self._call(r, [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}],
                          json_mode=True)
        r.trace.append(text)
        return json_field(text, "answer") or extract_answer(text)

    # -- operators ----------------------------------------------------------------------------------
    def format_op(self, r: RepairResult, t: Trajectory) -> None:
        evidence = [s.text for s in t.of(StepKind.EVIDENCE)]
        if t.task == "fever":          # a Format call means the prediction spells the gold label
            label = fever_spelling(t.prediction) or "NOT ENOUGH INFO"
            r.answer, r.variants = label, [label]
            r.kept_steps = len(t.steps)
            return
        span, f1 = best_span(t.prediction or "", evidence)
        if span is not None and f1 >= 0.5:
            r.answer = span
            r.trace.append(f"evidence span (token F1 {f1:.2f} with the prediction)")
        else:
            r.answer = self._answer_from(r, t, evidence, [s.text for s in t.of(StepKind.REASONING)])
        r.variants = answer_variants(r.answer, [t.prediction or ""])
        r.kept_steps = len(t.steps)

    def reasoning_op(self, r: RepairResult, t: Trajectory, start: int) -> None:
        prefix = [s.text for s in t.steps[:start] if s.kind is StepKind.REASONING]
        r.answer = self._answer_from(r, t, [s.text for s in t.of(StepKind.EVIDENCE)], prefix)
        r.kept_steps = start

    def retriever_op(self, r: RepairResult, t: Trajectory, start: int) -> None:
        """`start`: the culprit evidence block; its action and everything after it are redone."""
        action = next((i for i in range(min(start, len(t.steps) - 1), -1, -1)
                       if t.steps[i].kind is StepKind.SEARCH), None)
        cut = start if action is None else action
        old = t.steps[action].text if action is not None else t.question
        user = (f"Question: {t.question}\nA search for \"{old}\" did not return what is needed. Write one better "
                f"search query (the key names from the question, nothing invented). Reply with the query only.")
        text = self._call(r, [{"role": "user", "content": user + ' Reply with JSON: {"query": "..."}'}],
                          json_mode=True)
        query = json_field(text, "query") or t.question
        r.trace.append(f"query: {query}")
        kept = [s.text for s in t.steps[:cut] if s.kind is StepKind.EVIDENCE]
        reasoning = [s.text for s in t.steps[:cut] if s.kind is StepKind.REASONING]
        r.answer = self._answer_from(r, t, kept + self._retrieve(r, query), reasoning)
        r.kept_steps = cut

    def react_op(self, r: RepairResult, t: Trajectory, start: int) -> None:
        """The ReAct loop from `start` (0 = from scratch), on our knowledge base."""
        lines = []
        for s in t.steps[:start]:
            if s.kind is StepKind.REASONING:
                lines.append(f"Thought: {s.text}")
            elif s.kind is StepKind.SEARCH:
                lines.append(f"Action: search[{s.text}]")
            elif s.kind is StepKind.EVIDENCE:
                lines.append(f"Observation: {s.text[:self.s.evidence_chars]}")
        system = (_SYSTEM + " Work in turns: 'Thought: ...' then either 'Action: search[query]' to search a "
                  "Wikipedia-like collection, or 'Action: finish[answer]' to give the final answer.")
        if t.task == "fever":
            system += " The question is a claim; finish with SUPPORTS, REFUTES or NOT ENOUGH INFO."
        for _ in range(self.s.react_turns):
            user = f"Question: {t.question}\n" + "\n".join(lines) + "\nWhat is your next Thought and Action?"
            text = self._call(r, [{"role": "system", "content": system}, {"role": "user", "content": user}],
                              stop=["Observation:"])
            r.trace.append(text)
            m = _ACTION.search(text)
            thought = text.split("Action")[0].replace("Thought:", "").strip()
            if thought:
                lines.append(f"Thought: {thought}")
            if m is None:
                continue
            if m.group(1).lower() == "finish":
                r.answer = m.group(2).strip()
                break
            found = self._retrieve(r, m.group(2).strip())
            lines += [f"Action: search[{m.group(2).strip()}]",
                      f"Observation: {' '.join(found)[:self.s.evidence_chars]}"]
        if r.answer is None:            # turn budget spent: answer from what the loop saw
            docs = [x.removeprefix("Observation: ") for x in lines if x.startswith("Observation: ")]
            docs += [s.text for s in t.of(StepKind.EVIDENCE)]
            r.answer = self._answer_from(r, t, docs, [x for x in lines if x.startswith("Thought: ")])
        r.kept_steps = start

    # -- methods ------------------------------------------------------------------------------------
    def _start(self, t: Trajectory, d: DoctorDiagnosis) -> int:
        if d.culprit is None:
            return 0 if d.type is ErrorType.SEARCH else len(t.steps)
        return t.position(d.culprit)

    def _first_rejected(self, t: Trajectory) -> int:
        """Step-wise retry's check: the first reasoning step or query the diagnoser's checks reject."""
        flagged = [t.position(c["step"]) for c in self.diagnoser.reasoning_checks(t, first_only=False)
                   if c["flagged"]]
        flagged += [t.position(q["step"]) for q in self.diagnoser.query_provenance(t) if q["poisoned"]]
        return min(flagged) if flagged else t.position(t.of(StepKind.ANSWER)[-1].label) if t.of(
            StepKind.ANSWER) else len(t.steps)

    def repair(self, t: Trajectory, d: DoctorDiagnosis, method: Method) -> RepairResult:
        r = RepairResult(t.line, method.value, d.type.value, d.culprit, None)
        t0 = time.perf_counter()
        if method is Method.RERUN:
            self.react_op(r, t, 0)
        elif method is Method.STEPWISE:
            self.react_op(r, t, self._first_rejected(t))
        elif method is Method.NO_TAXONOMY:
            self.react_op(r, t, self._start(t, d))
        else:
            start = self._start(t, d) if method is Method.DRRAG else 0
            if d.type is ErrorType.FORMAT:
                self.format_op(r, t)
            elif d.type is ErrorType.REASONING:
                self.reasoning_op(r, t, start)
            elif d.type is ErrorType.RETRIEVER:
                self.retriever_op(r, t, start)
            else:
                self.react_op(r, t, start)
        if t.task == "fever" and r.answer is not None:
            # a claim's answer is a label: the one the reply names, else the whole reply's last one
            r.answer = fever_label_in(r.answer) or fever_label_in(r.trace[-1] if r.trace else None)
        r.wall_s = time.perf_counter() - t0
        return r
