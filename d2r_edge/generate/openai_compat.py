"""Chat completions over HTTP: vLLM, llama.cpp's server, Ollama, OpenAI. Standard library only."""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import random
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace

from d2r_edge.errors import ConfigError, D2RError
from d2r_edge.generate.base import Generation, parse_output
from d2r_edge.repair import PromptStyle
from d2r_edge.tasks import Task, build_prompt

log = logging.getLogger(__name__)
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class GeneratorError(D2RError):
    """The generator could not produce an answer (down, timing out, HTTP errors).
    `timed_out`: the last attempt ran past the timeout (the server answers 504 for it, else 502)."""

    exit_code = 11

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass
class OpenAICompatible:
    base_url: str
    model: str
    api_key_env: str | None = "OPENAI_API_KEY"
    timeout_s: float = 60.0
    max_retries: int = 3
    max_tokens: int = 256
    temperature: float = 0.0
    json_mode: bool = True     # response_format json_object; dropped if the server rejects it
    logprobs: bool = True      # ask for token log-probabilities (the failure detector's confidence
                               # signal); dropped if the server rejects the parameter
    backoff_s: float = 0.5
    name: str = "openai"

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.timeout_s <= 0 or self.max_retries < 0:
            raise ConfigError("timeout_s must be > 0 and max_retries >= 0")

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"   # never logged
        return headers

    def _post(self, payload: dict) -> dict:
        url = self.base_url.rstrip("/") + "/chat/completions"
        data = json.dumps(payload).encode("utf-8")
        last, timed_out = "no attempt", False
        for attempt in range(self.max_retries + 1):
            timed_out = False
            req = urllib.request.Request(url, data=data, headers=self._headers(), method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read().decode("utf-8"))
            except urllib.error.HTTPError as exc:
                body = exc.read().decode("utf-8", "replace")[:300]
                if exc.code == 400 and "response_format" in payload and rejects_json_mode(body):
                    raise _RejectedJSONMode(body) from None
                if exc.code == 400 and payload.get("logprobs") and "logprob" in body.lower():
                    raise _RejectedLogprobs(body) from None
                last = f"HTTP {exc.code}: {body}"
                if exc.code not in RETRY_STATUS:
                    break
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError,
                    http.client.HTTPException) as exc:     # HTTPException: IncompleteRead, BadStatusLine, ...
                reason = getattr(exc, "reason", exc)
                last = f"{type(exc).__name__}: {reason}"
                timed_out = isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError)
            except json.JSONDecodeError as exc:
                last = f"invalid JSON body ({exc.msg})"
            except UnicodeDecodeError:
                last = "a body that is not UTF-8"
            if attempt < self.max_retries:
                time.sleep(self.backoff_s * (2 ** attempt) * (1 + random.random() * 0.1))
        raise GeneratorError(f"generator at {self.base_url} failed after {self.max_retries + 1} "
                             f"attempt(s): {last}", timed_out=timed_out)

    def complete(self, messages: list[dict], max_tokens: int | None = None, stop: list[str] | None = None,
                 json_mode: bool | None = None) -> "ChatResult":
        """One chat completion with the server's token counts. json_mode (default: this client's)
        asks for a JSON object; a server that rejects it is asked without, from then on."""
        payload = {"model": self.model, "temperature": self.temperature,
                   "max_tokens": self.max_tokens if max_tokens is None else max_tokens, "messages": messages}
        if stop:
            payload["stop"] = stop
        if (self.json_mode if json_mode is None else json_mode) and self.json_mode:
            payload["response_format"] = {"type": "json_object"}
        if self.logprobs:
            # top_logprobs too: llama-cpp-python's server returns none for logprobs=true alone
            payload["logprobs"], payload["top_logprobs"] = True, 1
        t0 = time.perf_counter()
        body = None
        while body is None:
            try:
                body = self._post(payload)
            except _RejectedJSONMode:
                log.info("server rejected response_format=json_object; asking without it from now on")
                self.json_mode = False
                payload.pop("response_format")
            except _RejectedLogprobs:
                log.info("server rejected logprobs; asking without them from now on (the detector's "
                         "confidence signal is then missing)")
                self.logprobs = False
                payload.pop("logprobs")
                payload.pop("top_logprobs")
        try:
            text = body["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise GeneratorError(f"generator at {self.base_url} returned no choices: {str(body)[:200]}") from None
        usage = body.get("usage") or {}
        return ChatResult(text, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                          time.perf_counter() - t0, token_logprobs(body["choices"][0]))

    def generate(self, task: Task, style: PromptStyle, query: str, passages: list[str]) -> Generation:
        prompt = build_prompt(task, style, query, passages)
        out = self.complete([{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.user}])
        gen = parse_output(task, out.text)
        answer = gen.label.value if task.fact_verification and gen.label is not None else gen.response
        return replace(gen, logprobs=answer_logprobs(out.tokens, answer))


@dataclass(frozen=True)
class ChatResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    tokens: tuple[tuple[str, float], ...] | None = None    # (token text, log-probability); None: not given


def token_logprobs(choice: dict) -> tuple[tuple[str, float], ...] | None:
    """The OpenAI chat format's `choices[0].logprobs.content` as (token, logprob) pairs; None when the
    server sent none or something unreadable (a missing signal, never a made-up one)."""
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice, dict) else None
    if not isinstance(content, list) or not content:
        return None
    out = []
    for item in content:
        try:
            lp = float(item["logprob"])
            tok = str(item["token"])
        except (KeyError, TypeError, ValueError):
            return None
        if not math.isfinite(lp):
            return None
        out.append((tok, lp))
    return tuple(out)


def answer_logprobs(tokens: tuple[tuple[str, float], ...] | None, answer: str) -> tuple[float, ...] | None:
    """Log-probabilities of the tokens that spell `answer` in the completion (its last occurrence:
    the JSON value comes after the key); all tokens when the answer is not found verbatim."""
    if not tokens:
        return None
    text = "".join(t for t, _ in tokens)
    start = text.rfind(answer) if answer else -1
    if start < 0:
        return tuple(lp for _, lp in tokens)
    end, pos, out = start + len(answer), 0, []
    for tok, lp in tokens:
        if pos < end and pos + len(tok) > start:
            out.append(lp)
        pos += len(tok)
    return tuple(out) or tuple(lp for _, lp in tokens)


class _RejectedJSONMode(Exception):
    pass


class _RejectedLogprobs(Exception):
    pass


_JSON_MODE_WORDS = ("response_format", "json_object", "json mode", "json_schema", "grammar")


def rejects_json_mode(body: str) -> bool:
    """Whether a 400 body is about `response_format` (the server has no JSON mode), not about
    this one request (an over-long prompt, a bad parameter): only then is JSON mode dropped."""
    text = body.lower()
    return any(w in text for w in _JSON_MODE_WORDS)
