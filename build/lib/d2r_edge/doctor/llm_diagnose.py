"""The optional LLM diagnoser (`--diagnoser llm`): the paper's protocol as a prompt, JSON out.

The prompt follows the four-phase order of the DR-RAG diagnosis (format,
evidence sufficiency, earliest reasoning error, query provenance), written in
our own words. The model's JSON is repaired with json-repair; an unknown type
or a culprit label that is not a step of the trajectory falls back to the NLI
diagnoser's answer and is counted, so the agreement figure stays honest.
"""

from __future__ import annotations

from d2r_edge.doctor.diagnose import DoctorDiagnosis, ErrorType
from d2r_edge.doctor.trajectory import Trajectory
from d2r_edge.generate.base import json_object

PROMPT = """You are checking why a search agent answered a question wrongly.
The gold answer is correct; do not question it.

Decide in this order:
1. format: the agent's answer means the same as the gold answer and only the wording differs.
2. Otherwise, is the evidence the agent retrieved enough to reach the gold answer?
3. If it is enough: reasoning. Name the earliest [Step k] (Reasoning) that draws a wrong conclusion
   or uses a fact not in the question or the evidence.
4. If it is not enough, look at each search query. A query is poisoned when it names something that
   appears neither in the question nor in earlier evidence, or follows a wrong earlier assumption.
   If every query is poisoned: search, culprit = the first poisoned [Action j] (Search).
   Otherwise: retriever, culprit = the [Evidence j] (Information) of the first sound query.

Question: {question}
Gold answer: {gold}
Agent's answer: {prediction}

Trajectory:
{trajectory}

Reply with JSON only: {{"type": "format|reasoning|retriever|search", "culprit": "<step label or null>",
"evidence_sufficient": true|false}}"""


class LLMDiagnoser:
    """`diagnose(trajectory, fallback)`: the LLM's call, or `fallback`'s where the reply is unusable."""

    def __init__(self, chat, max_tokens: int = 120, evidence_chars: int = 400) -> None:
        self.chat, self.max_tokens, self.evidence_chars = chat, max_tokens, evidence_chars

    def prompt(self, t: Trajectory) -> str:
        steps = "\n".join(f"{s.label}: {s.text[:self.evidence_chars]}" for s in t.steps)
        return PROMPT.format(question=t.question, gold=" / ".join(t.gold), prediction=t.prediction, trajectory=steps)

    def diagnose(self, t: Trajectory, fallback: DoctorDiagnosis) -> DoctorDiagnosis:
        out = self.chat([{"role": "user", "content": self.prompt(t)}], self.max_tokens)
        obj = json_object(out.text)
        labels = {s.label for s in t.steps}
        try:
            kind = ErrorType(str(obj.get("type", "")).strip().lower())
        except ValueError:
            kind = None
        culprit = obj.get("culprit")
        culprit = culprit.strip() if isinstance(culprit, str) and culprit.strip().lower() != "null" else None
        usable = kind is not None and (kind is ErrorType.FORMAT or culprit in labels)
        signals = {"llm_raw": out.text[:500], "llm_usable": usable,
                   "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens}
        if not usable:
            return DoctorDiagnosis(t.line, fallback.type, fallback.culprit, fallback.sufficient,
                                   {**fallback.signals, "llm": signals})
        sufficient = obj.get("evidence_sufficient")
        sufficient = bool(sufficient) if isinstance(sufficient, bool) else kind in (ErrorType.FORMAT,
                                                                                   ErrorType.REASONING)
        return DoctorDiagnosis(t.line, kind, None if kind is ErrorType.FORMAT else culprit, sufficient,
                               {"llm": signals})
