"""The generator protocol and output parsing (malformed JSON is repaired, never eval'ed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from d2r_edge.diagnose import Label
from d2r_edge.repair import PromptStyle
from d2r_edge.tasks import Task


@dataclass(frozen=True)
class Generation:
    response: str              # evidence text (fact verification) or the short answer (QA)
    label: Label | None        # fact verification only
    raw: str                   # what the generator returned, for the record
    replayed_s: float = 0.0    # > 0: served from a cache; the time the original call took
    # log-probabilities of the answer's tokens as the server returned them; None: not given
    # (the extractive generator, a server without `logprobs`, a cached answer from before)
    logprobs: tuple[float, ...] | None = None
    # self-consistency: the answers of N more samples of the same prompt at a temperature > 0
    # (FEVER: labels, QA: answers; d2r_edge.consistency); None: not asked for
    samples: tuple[str, ...] | None = None
    samples_s: float = 0.0     # of the generation's time, what drawing the samples took (the signal's cost)
    # self-check (issue 53): the same model's P(True) that this answer is correct, read from the first
    # token's top log-probabilities of one more request; None: not asked, or not readable
    p_true: float | None = None
    p_true_s: float = 0.0      # of the generation's time, what the self-check request took


class Generator(Protocol):
    name: str

    def generate(self, task: Task, style: PromptStyle, query: str, passages: list[str],
                 sample: bool = True) -> Generation:
        """The answer to `query` from `passages`. `sample`: draw the self-consistency samples the
        generator is configured for (the pipeline asks for them on a query's first attempt only,
        the one the detector gates; a deterministic generator ignores it)."""
        ...


def json_object(text: str | None) -> dict:
    """The JSON object in a model's reply, repaired with json-repair when malformed; {} if none."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        from json_repair import repair_json

        try:
            obj = repair_json(text or "", return_objects=True)
        except Exception:  # json-repair raises a few types on pathological input
            obj = None
    return obj if isinstance(obj, dict) else {}


def parse_output(task: Task, text: str) -> Generation:
    """Read the JSON the prompt asks for; repair it with json-repair when malformed."""
    obj = json_object(text)
    if task.fact_verification:
        label = Label.parse(obj.get("label"))
        if label is None:  # a bare word answer, e.g. "SUPPORTS."
            for cand in (Label.SUPPORTS, Label.REFUTES, Label.NOT_ENOUGH_INFO):
                if cand.value in (text or "").upper():
                    label = cand
                    break
        return Generation(str(obj.get("response") or ""), label, text or "")
    answer = obj.get("answer")
    if answer is None:
        answer = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return Generation(str(answer), None, text or "")
