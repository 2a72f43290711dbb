"""The OpenAI chat-completions schema, translated to and from `Runtime` calls (no HTTP here).

Requests: the last user message is the question (or the claim, task fever); earlier messages
and the system prompt are not read (d2r-edge answers from its KB, one question at a time).
Parameters d2r-edge does not use (temperature, max_tokens, tools, ...) are ignored, always;
the ones it reads are type-checked, and `n` > 1 is refused (one verified answer per request).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from d2r_edge.errors import InputError
from d2r_edge.pipeline import stage_seconds
from d2r_edge.runtime import PassageRef, Result, Verification

MODEL_NAME = "d2r-edge"


@dataclass(frozen=True)
class ChatRequest:
    question: str
    model: str
    stream: bool
    include_usage: bool


def _field_error(name: str, want: str, got) -> InputError:
    return InputError(f"'{name}' must be {want}, got {type(got).__name__}")


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of parts of which the text ones are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise InputError(f"'{where}.content[{i}]' must be an object with a 'type'")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise _field_error(f"{where}.content[{i}].text", "a string", part.get("text"))
                parts.append(part["text"])
        return "\n".join(parts)
    raise _field_error(f"{where}.content", "a string or a list of content parts", content)


def parse_chat(body) -> ChatRequest:
    """A chat.completions request body (parsed JSON) -> what d2r-edge needs, or InputError naming the field."""
    if not isinstance(body, dict):
        raise InputError(f"the request body must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InputError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    question = None
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _field_error(f"messages[{i}]", "an object", msg)
        if not isinstance(msg.get("role"), str):
            raise _field_error(f"messages[{i}].role", "a string", msg.get("role"))
        if msg["role"] == "user":
            question = _text(msg.get("content"), f"messages[{i}]")
    if question is None or not question.strip():
        raise InputError("no user message with text: the last 'user' message is the question d2r-edge answers")
    model = body.get("model", MODEL_NAME)
    if not isinstance(model, str):
        raise _field_error("model", "a string", model)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _field_error("stream", "a boolean", stream)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _field_error("stream_options", "an object", opts)
    n = body.get("n", 1)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n != 1):
        raise InputError(f"'n' must be 1 (d2r-edge returns one verified answer per request), got {n!r}")
    return ChatRequest(question.strip(), model, stream, bool(opts.get("include_usage", False)))


@dataclass(frozen=True)
class VerifyRequest:
    question: str
    answer: str
    passages: list | None
    label: str | None


def parse_verify(body) -> VerifyRequest:
    if not isinstance(body, dict):
        raise InputError(f"the request body must be a JSON object, got {type(body).__name__}")
    question = body.get("question", body.get("claim"))
    if not isinstance(question, str):
        raise _field_error("question", "a string (or 'claim')", question)
    answer = body.get("answer")
    if not isinstance(answer, str):
        raise _field_error("answer", "a string", answer)
    passages = body.get("passages")
    if passages is not None and not isinstance(passages, list):
        raise _field_error("passages", "a list", passages)
    label = body.get("label")
    if label is not None and not isinstance(label, str):
        raise _field_error("label", "a string", label)
    return VerifyRequest(question, answer, passages, label)


def _passages(refs: tuple[PassageRef, ...]) -> list[dict]:
    return [{"id": p.doc_id, "title": p.title, "score": p.score} for p in refs]


def _repair_bounds(res: Result, budget) -> dict:
    """The repair action's bounds for this request: with a relative budget (latency_x) the
    seconds are latency_x times this request's first attempt, capped by the absolute budget."""
    out = {"repair_latency_s": budget.latency_s, "repair_device_mem_mib": budget.device_mem_mib}
    if budget.relative:
        first_s = stage_seconds((res.record.get("first") or {}).get("timings_s") or {})
        out.update(repair_latency_s=budget.for_attempt(first_s).latency_s, repair_latency_x=budget.latency_x,
                   repair_latency_s_cap=budget.latency_s)
    return out


def d2r_object(res: Result, budget, deadline_s: float | None) -> dict:
    """The `d2r` object beside the OpenAI fields: what was diagnosed, repaired, read, and what it cost."""
    d = res.diagnosis
    return {
        "request_id": res.id, "task": res.task.value,
        "failure_type": res.failure.value, "final_failure_type": res.final_failure.value,
        "repaired": res.repaired, "arm": res.arm, "first_answer": res.first_answer,
        # accept/revert (--accept): which answer stands after the repair, and the comparator's scores
        "repair_kept": (res.record.get("repair") or {}).get("kept"),
        "accept": (res.record.get("repair") or {}).get("accept"),
        "passages": _passages(res.passages),
        "entailment": {"question": d.e_q.value, "answer": d.e_r.value, "kg": d.kg.value,
                       "label": d.label.value if d.label else None,
                       "gated_label": d.gated_label.value if d.gated_label else None},
        "p_wrong": res.p_wrong, "latency_ms": res.latency_ms,
        # a trust certificate (--trust): whether the answer is trusted, at what certified error; --abstain
        # withholds an untrusted one (the answer is then the stated abstention)
        "trusted": res.trusted, "trust": res.record.get("trust"), "abstained": res.abstained,
        "budget": {**_repair_bounds(res, budget), "over_budget": res.over_budget,
                   "deadline_ms": None if deadline_s is None else round(deadline_s * 1000.0, 3),
                   "repair_skipped": res.skipped, "repair_error": res.repair_error},
    }


def verification_object(v: Verification) -> dict:
    d = v.diagnosis
    return {"object": "d2r.verification", "failure_type": d.failure.value,
            "question": v.query, "answer": v.answer, "label": v.label.value if v.label else None,
            "entailment": {"question": d.e_q.value, "answer": d.e_r.value, "kg": d.kg.value,
                           "gated_label": d.gated_label.value if d.gated_label else None},
            "passages": _passages(v.passages), "passage_probs": {"question": d.passage_probs_q,
                                                                 "answer": d.passage_probs_r},
            "latency_ms": v.latency_ms}


def _usage() -> dict:
    # no tokens d2r-edge could count honestly: the generator's usage is not kept per request
    return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def completion(res: Result, model: str, d2r: dict) -> dict:
    return {"id": f"chatcmpl-{res.id}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": res.answer},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": _usage(), "d2r": d2r}


def stream_chunks(res: Result, model: str, d2r: dict, include_usage: bool, piece_chars: int = 24):
    """Server-Sent Events in OpenAI's chunk format: the role, the verified answer in pieces, the
    finish chunk carrying `d2r`, (usage,) then [DONE]. Bytes, one event each."""
    base = {"id": f"chatcmpl-{res.id}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def event(choices: list, **extra) -> bytes:
        return b"data: " + json.dumps({**base, "choices": choices, **extra}).encode("utf-8") + b"\n\n"

    yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    text = res.answer
    for i in range(0, len(text), piece_chars):
        yield event([{"index": 0, "delta": {"content": text[i:i + piece_chars]}, "finish_reason": None}])
    yield event([{"index": 0, "delta": {}, "finish_reason": "stop"}], d2r=d2r)
    if include_usage:
        yield event([], usage=_usage())
    yield b"data: [DONE]\n\n"


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
