"""Chat completions over HTTP: vLLM, llama.cpp's server, Ollama, OpenAI.

On httpx2 (the HTTP client the `openai` SDK uses): one pooled keep-alive connection per server,
a timeout per call. Every call waits at most min(`timeout_s`, what the query's deadline leaves);
a retry (429, 5xx, 408, timeouts, broken connections, unreadable bodies) starts only when its
wait - `Retry-After` where the server sends one, else exponential backoff - ends before the
deadline. Other 4xx answers are final at once.

An upstream's body is untrusted text: it never enters an error message (which reaches clients,
records and the console); a redacted one-line excerpt goes to the log at WARNING.
"""

from __future__ import annotations

import email.utils
import http
import json
import logging
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field, replace

import httpx2 as httpx

import d2r_edge.deadline as deadline
from d2r_edge.errors import ConfigError, D2RError
from d2r_edge.generate.base import Generation, parse_output
from d2r_edge.redact import excerpt, register_secret, safe_url
from d2r_edge.repair import PromptStyle
from d2r_edge.tasks import Task, build_prompt, build_self_check

log = logging.getLogger(__name__)
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
MAX_BODY_BYTES = 16 << 20        # a completion larger than this is a broken server, not an answer
MIN_ATTEMPT_S = 0.05             # a retry that would get less than this before the deadline does not start
CONNECT_TIMEOUT_S = 10.0
# llama.cpp's /v1/models `meta`: what names a model file wherever it is served from
MODEL_META_KEYS = ("n_params", "size", "n_vocab", "n_ctx_train", "n_embd", "vocab_type", "ftype")


class GeneratorError(D2RError):
    """The generator could not produce an answer (down, timing out, HTTP errors). The message is
    ours alone: the URL (no credentials), the upstream's HTTP status, the attempts made - never the
    upstream's body. `timed_out`: the last attempt ran past its timeout or the deadline (the server
    answers 504 for it, else 502); `status`: the upstream's last HTTP status, None if it gave none."""

    exit_code = 11

    def __init__(self, message: str, timed_out: bool = False, status: int | None = None,
                 attempts: int = 0, context_exceeded: bool = False) -> None:
        super().__init__(message)
        self.timed_out, self.status, self.attempts = timed_out, status, attempts
        self.context_exceeded = context_exceeded    # this prompt is longer than the model's context

    @property
    def client_error(self) -> bool:
        """The upstream refused the request as such (a 4xx other than 429: a wrong key, model or request):
        every request would meet it, where a timeout, a 5xx, a dropped connection or a prompt too long for
        the model's context may be this one's alone."""
        return (not self.timed_out and not self.context_exceeded and self.status is not None
                and 400 <= self.status < 500 and self.status != 429)


def status_text(code: int) -> str:
    try:
        return f"HTTP {code} {http.HTTPStatus(code).phrase}"
    except ValueError:
        return f"HTTP {code}"


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """A `Retry-After` header in seconds (delta-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


@dataclass
class _Failure:
    """One failed attempt: what the message says, whether it may be retried and after how long."""

    reason: str
    retry: bool
    timed_out: bool = False
    status: int | None = None
    wait_s: float | None = None      # the server's Retry-After
    context_exceeded: bool = False   # the same prompt would fail again: not retried


class _AttemptFailed(Exception):
    def __init__(self, failure: _Failure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


@dataclass
class OpenAICompatible:
    base_url: str
    model: str
    api_key_env: str | None = "OPENAI_API_KEY"
    timeout_s: float = 60.0          # one call's limit; a query's deadline may cut it shorter
    max_retries: int = 3
    max_tokens: int = 256
    temperature: float = 0.0
    json_mode: bool = True     # response_format json_object; dropped if the server rejects it
    logprobs: bool = True      # ask for token log-probabilities (the failure detector's confidence
                               # signal); dropped if the server rejects the parameter
    backoff_s: float = 0.5
    max_retry_after_s: float = 30.0   # a server asking to wait longer than this is not retried
    samples: int = 0                  # self-consistency: this many more answers at sample_temperature
    sample_temperature: float = 0.7
    self_check: bool = False          # P(True): one more request asking the model whether its answer is right
    self_check_samples: bool = False  # ... with the self-consistency samples shown in that request
    name: str = "openai"
    _client: httpx.Client | None = field(default=None, init=False, repr=False, compare=False)
    _client_pid: int = field(default=0, init=False, repr=False, compare=False)
    _client_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must start with http:// or https://, got {safe_url(self.base_url)!r}")
        if not self.timeout_s > 0 or self.max_retries < 0 or self.backoff_s < 0 or self.max_retry_after_s < 0:
            raise ConfigError("timeout_s must be > 0; max_retries, backoff_s and max_retry_after_s >= 0")
        if not isinstance(self.samples, int) or self.samples < 0 or not 0 < self.sample_temperature <= 2:
            raise ConfigError(f"samples must be an int >= 0 and sample_temperature in (0, 2], got "
                              f"{self.samples!r} / {self.sample_temperature!r}")

    @property
    def where(self) -> str:
        """The server as messages name it: no credentials, no query string."""
        return safe_url(self.base_url)

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            register_secret(key)                         # masked in any log line that quotes it back
            headers["Authorization"] = f"Bearer {key}"   # never logged
        return headers

    def _http(self) -> httpx.Client:
        """One pooled client per process (a forked worker makes its own), shared by threads."""
        with self._client_lock:
            if self._client is None or self._client_pid != os.getpid():
                self._client = httpx.Client(follow_redirects=False, limits=httpx.Limits(
                    max_connections=32, max_keepalive_connections=8, keepalive_expiry=30.0))
                self._client_pid = os.getpid()
            return self._client

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None and self._client_pid == os.getpid():
                self._client.close()
            self._client = None

    def _attempt(self, url: str, data: bytes, payload: dict, timeout_s: float) -> dict:
        """One POST within `timeout_s` (connect, send, headers and the whole body); the parsed
        JSON, or _AttemptFailed / _Rejected* (control flow for the JSON-mode and logprobs fallbacks)."""
        ends_at = time.monotonic() + timeout_s
        limit = httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s))
        try:
            with self._http().stream("POST", url, content=data, headers=self._headers(), timeout=limit) as resp:
                status, retry_after = resp.status_code, resp.headers.get("retry-after")
                raw = bytearray()
                for chunk in resp.iter_bytes():
                    raw += chunk
                    if len(raw) > MAX_BODY_BYTES:
                        raise _AttemptFailed(_Failure(f"a body over {MAX_BODY_BYTES >> 20} MiB", retry=False))
                    if time.monotonic() > ends_at:     # a server that trickles bytes past the limit
                        raise httpx.ReadTimeout("body not complete in time")
        except httpx.TimeoutException:
            raise _AttemptFailed(_Failure(f"no complete answer within {timeout_s:.2f} s", retry=True,
                                          timed_out=True)) from None
        except httpx.TransportError as exc:    # refused, reset, broken HTTP (the text may quote the server)
            log.info("generator at %s: %s: %s", self.where, type(exc).__name__, excerpt(str(exc), 200))
            what = "could not connect" if isinstance(exc, httpx.ConnectError) else "the connection broke"
            raise _AttemptFailed(_Failure(f"{what} ({type(exc).__name__})", retry=True)) from None
        text = raw.decode("utf-8", "replace")
        if status >= 300:
            if status == 400 and "response_format" in payload and rejects_json_mode(text):
                raise _RejectedJSONMode()
            if status == 400 and payload.get("logprobs") and "logprob" in text.lower():
                raise _RejectedLogprobs()
            if status in (400, 413, 500) and exceeds_context(text):
                log.warning("generator at %s answered %s: the prompt does not fit the model's context",
                            self.where, status_text(status))
                raise _AttemptFailed(_Failure(f"upstream answered {status_text(status)}: the prompt does not fit "
                                              "the model's context", retry=False, status=status,
                                              context_exceeded=True))
            log.warning("generator at %s answered %s: %s", self.where, status_text(status), excerpt(text))
            raise _AttemptFailed(_Failure(f"upstream answered {status_text(status)}", retry=status in RETRY_STATUS,
                                          status=status, wait_s=retry_after_s(retry_after)))
        try:
            return json.loads(bytes(raw).decode("utf-8"))
        except UnicodeDecodeError:
            reason = "a body that is not UTF-8"
        except json.JSONDecodeError as exc:
            reason = f"a body that is not JSON ({exc.msg})"
        log.warning("generator at %s answered %s with %s: %s", self.where, status_text(status), reason,
                    excerpt(text))
        raise _AttemptFailed(_Failure(f"upstream answered {reason}", retry=True, status=status))

    def _post(self, payload: dict) -> dict:
        url = self.base_url.rstrip("/") + "/chat/completions"
        data = json.dumps(payload).encode("utf-8")
        attempts, failure, stop = 0, None, ""
        while True:
            timeout_s = deadline.bounded(self.timeout_s)
            if timeout_s < MIN_ATTEMPT_S:     # only a deadline gets here
                if failure is None:
                    raise GeneratorError(f"generator at {self.where}: the request's deadline passed before it "
                                         f"could be called", timed_out=True)
                stop = "the request's deadline leaves no time for another attempt"
                break
            attempts += 1
            try:
                return self._attempt(url, data, payload, timeout_s)
            except _AttemptFailed as exc:
                failure = exc.failure
            if failure.timed_out and timeout_s < self.timeout_s:
                failure = replace(failure, reason=failure.reason + " (the request's deadline)")
            if not failure.retry:
                if failure.context_exceeded:
                    stop = "not retried: the same prompt would not fit again"
                elif failure.status is not None and 400 <= failure.status < 500:
                    stop = "not retried: a client error (check the model name, the key and the URL)"
                else:
                    stop = "not retried"
                break
            if attempts > self.max_retries:
                break
            wait_s = self.backoff_s * (2 ** (attempts - 1)) * (1 + random.random() * 0.1)
            if failure.wait_s is not None:
                if failure.wait_s > self.max_retry_after_s:
                    stop = f"not retried: the server asked to wait {failure.wait_s:.0f} s"
                    break
                wait_s = failure.wait_s
            left_s = deadline.remaining_s()
            if left_s is not None and left_s - wait_s < MIN_ATTEMPT_S:
                stop = (f"not retried: the request's deadline leaves {max(left_s, 0.0):.2f} s, the retry waits "
                        f"{wait_s:.2f} s first")
                break
            time.sleep(wait_s)
        detail = f"; {stop}" if stop else ""
        raise GeneratorError(f"generator at {self.where}: {failure.reason} (attempt {attempts} of "
                             f"{self.max_retries + 1}){detail}", timed_out=failure.timed_out,
                             status=failure.status, attempts=attempts, context_exceeded=failure.context_exceeded)

    def served_model(self) -> dict:
        """What the server says it serves (GET {base_url}/models), in the form the generation cache
        keys answers by: the model's id (a file path's name only: the same file served from another
        folder is the same model) and, where the server reports it (llama.cpp's `meta`: parameter
        count, file size, vocabulary, context, width), the file's shape - never the URL. Several models
        and none with the requested name (a hosted API): the requested name. Raises GeneratorError
        when the server does not say."""
        url = self.base_url.rstrip("/") + "/models"
        try:
            r = self._http().get(url, headers=self._headers(), timeout=httpx.Timeout(
                min(self.timeout_s, 30.0), connect=min(self.timeout_s, CONNECT_TIMEOUT_S)))
            body = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            raise GeneratorError(f"generator at {self.where}: GET /models failed ({type(exc).__name__}); is the "
                                 f"server up?") from None
        if body is None:
            raise GeneratorError(f"generator at {self.where}: GET /models answered {status_text(r.status_code)}",
                                 status=r.status_code)
        entries = [e for e in (body.get("data") if isinstance(body, dict) else None) or [] if isinstance(e, dict)]
        named = [e for e in entries if e.get("id") == self.model]
        entry = named[0] if named else entries[0] if len(entries) == 1 else None
        if entry is None:
            return {"id": self.model}
        model_id = str(entry.get("id") or self.model)[:300]     # the server's words: bounded
        if model_id.startswith(("/", "./")) or model_id.endswith((".gguf", ".bin")):
            model_id = model_id.replace("\\", "/").rsplit("/", 1)[-1]
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        shape = {k: meta[k] if not isinstance(meta[k], str) else meta[k][:100] for k in MODEL_META_KEYS
                 if isinstance(meta.get(k), (int, float, str))}
        return {"id": model_id, **({"meta": shape} if shape else {})}

    def complete(self, messages: list[dict], max_tokens: int | None = None, stop: list[str] | None = None,
                 json_mode: bool | None = None, temperature: float | None = None, seed: int | None = None,
                 logprobs: bool = True, top_logprobs: int = 1) -> "ChatResult":
        """One chat completion with the server's token counts. json_mode (default: this client's)
        asks for a JSON object; a server that rejects it is asked without, from then on. `seed`: for
        a sample at a temperature (servers that honour it, llama.cpp among them, then repeat it)."""
        payload = {"model": self.model, "temperature": self.temperature if temperature is None else temperature,
                   "max_tokens": self.max_tokens if max_tokens is None else max_tokens, "messages": messages}
        if seed is not None:
            payload["seed"] = seed
        if stop:
            payload["stop"] = stop
        if (self.json_mode if json_mode is None else json_mode) and self.json_mode:
            payload["response_format"] = {"type": "json_object"}
        if self.logprobs and logprobs:
            # top_logprobs too: llama-cpp-python's server returns none for logprobs=true alone
            payload["logprobs"], payload["top_logprobs"] = True, top_logprobs
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
            log.warning("generator at %s answered without choices: %s", self.where, excerpt(str(body)))
            raise GeneratorError(f"generator at {self.where}: upstream answered with no choices[0].message.content",
                                 attempts=1) from None
        usage = body.get("usage") or {}
        return ChatResult(text, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                          time.perf_counter() - t0, token_logprobs(body["choices"][0]),
                          first_top_logprobs(body["choices"][0]))

    def generate(self, task: Task, style: PromptStyle, query: str, passages: list[str],
                 sample: bool = True) -> Generation:
        """One greedy answer; with `sample` and `samples` > 0, that many more at `sample_temperature`.
        A prompt the server says does not fit the model's context is asked again with the first half of
        the passages (they come best first), down to one: the answer then reads fewer passages than the
        arm retrieved (logged; the diagnosis still reads them all)."""
        kept = list(passages)
        while True:
            prompt = build_prompt(task, style, query, kept)
            try:
                out = self.complete([{"role": "system", "content": prompt.system},
                                     {"role": "user", "content": prompt.user}])
                break
            except GeneratorError as exc:
                if not exc.context_exceeded or len(kept) <= 1:
                    raise
                log.warning("generator at %s: %d passages do not fit the model's context; asking with the first %d",
                            self.where, len(kept), len(kept) // 2)
                kept = kept[: len(kept) // 2]
        gen = parse_output(task, out.text)
        answer = gen.label.value if task.fact_verification and gen.label is not None else gen.response
        gen = replace(gen, logprobs=answer_logprobs(out.tokens, answer))
        if self.samples and sample:
            t0 = time.perf_counter()
            drawn = tuple(self._sample(task, prompt, i) for i in range(self.samples))
            gen = replace(gen, samples=drawn, samples_s=time.perf_counter() - t0)
        return gen

    def p_true(self, task: Task, query: str, passages: list[str], answer: str,
               samples: tuple[str, ...] = ()) -> tuple[float | None, float]:
        """(the model's P(True) that `answer` is right, the seconds the request took): Kadavath et al.
        2022's self-check, one greedy token after the question, P(True) / (P(True) + P(False)) over the
        first token's top log-probabilities. P(True) is None when the server gives no log-probabilities
        or neither word is among the top tokens (missing, not 0.5). The pipeline asks it for a query's
        first answer when `self_check` is set; a failed request raises GeneratorError. `samples`: shown in the
        question as brainstormed answers (`self_check_samples`)."""
        if not self.logprobs:
            return None, 0.0
        t0 = time.perf_counter()
        prompt = build_self_check(task, query, passages, answer, samples)
        out = self.complete([{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.user}],
                            max_tokens=1, json_mode=False, temperature=0.0, top_logprobs=10)
        return p_true_from_top(out.first_top), time.perf_counter() - t0

    def _sample(self, task: Task, prompt, i: int) -> str:
        """One more answer to the same prompt at `sample_temperature` (seed i: reproducible where the
        server honours seeds; a server caching the prompt only decodes the answer again)."""
        out = self.complete([{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.user}],
                            temperature=self.sample_temperature, seed=i, logprobs=False)
        g = parse_output(task, out.text)
        return (g.label.value if g.label is not None else "NOT ENOUGH INFO") if task.fact_verification else g.response


@dataclass(frozen=True)
class ChatResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    tokens: tuple[tuple[bytes, float], ...] | None = None  # (token bytes, log-probability); None: not given
    first_top: tuple[tuple[str, float], ...] | None = None  # the first token's top alternatives (text, logprob)


def first_top_logprobs(choice: dict) -> tuple[tuple[str, float], ...] | None:
    """`choices[0].logprobs.content[0].top_logprobs` as (token text, logprob) pairs; None when absent."""
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice, dict) else None
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        return None
    top = content[0].get("top_logprobs")
    if not isinstance(top, list):
        return None
    out = []
    for item in top:
        try:
            lp = float(item["logprob"])
            tok = item["token"] if isinstance(item["token"], str) else bytes(item.get("bytes") or []).decode(
                "utf-8", "replace")
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if math.isfinite(lp):
            out.append((tok, lp))
    return tuple(out) or None


def p_true_from_top(top: tuple[tuple[str, float], ...] | None) -> float | None:
    """P(True) / (P(True) + P(False)) from a first token's alternatives ("True", " true", "TRUE" count as
    True); None when neither word is among them. One word missing: its probability is taken as 0 (it
    lies below every listed alternative)."""
    if not top:
        return None
    mass = {"true": 0.0, "false": 0.0}
    for tok, lp in top:
        word = tok.strip().strip('."').lower()
        if word in mass:
            mass[word] += math.exp(lp)
    total = mass["true"] + mass["false"]
    return None if total <= 0 else mass["true"] / total


def token_logprobs(choice: dict) -> tuple[tuple[bytes, float], ...] | None:
    """The OpenAI chat format's `choices[0].logprobs.content` as (token bytes, logprob) pairs; None
    when the server sent none or something unreadable (a missing signal, never a made-up one). The
    bytes are the item's `bytes` where given (a character split over two tokens is whole only
    there; its `token` strings hold replacement characters), else its `token` in UTF-8."""
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice, dict) else None
    if not isinstance(content, list) or not content:
        return None
    out = []
    for item in content:
        try:
            lp = float(item["logprob"])
            raw = item.get("bytes")
            tok = bytes(raw) if isinstance(raw, list) else str(item["token"]).encode("utf-8")
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if not math.isfinite(lp):
            return None
        out.append((tok, lp))
    return tuple(out)


def _spellings(answer: str) -> list[bytes]:
    """How `answer` may appear in a completion: as is, and as a JSON string value escapes it."""
    forms = [answer, json.dumps(answer, ensure_ascii=False)[1:-1], json.dumps(answer)[1:-1]]
    return [f.encode("utf-8") for f in dict.fromkeys(forms)]


def answer_logprobs(tokens: tuple[tuple[bytes, float], ...] | None, answer: str) -> tuple[float, ...] | None:
    """Log-probabilities of the tokens that spell `answer` in the completion (its last occurrence:
    the JSON value comes after the key), matched on the decoded bytes (ASCII case aside), so a
    character split over tokens or escaped in JSON still matches. None (missing, never every token: the scaffolding's
    near-certain tokens would pass for confidence) when there are no tokens or no match."""
    if not tokens or not answer:
        return None
    text = b"".join(t for t, _ in tokens).lower()       # ASCII case: a label parsed from "supports"
    start, length = max(((text.rfind(f.lower()), len(f)) for f in _spellings(answer)), key=lambda m: m[0])
    if start < 0:
        return None
    end, pos, out = start + length, 0, []
    for tok, lp in tokens:
        if pos < end and pos + len(tok) > start:
            out.append(lp)
        pos += len(tok)
    return tuple(out) or None


class _RejectedJSONMode(Exception):
    pass


class _RejectedLogprobs(Exception):
    pass


_JSON_MODE_WORDS = ("response_format", "json_object", "json mode", "json_schema", "grammar")


# what llama.cpp's server, vLLM and OpenAI say of a prompt longer than the model's context
_CONTEXT_WORDS = ("context size has been exceeded", "exceeds the available context size", "context_length_exceeded",
                  "maximum context length", "exceed_context_size_error")


def exceeds_context(body: str) -> bool:
    """Whether an error body says the prompt does not fit the model's context (the body is read for
    this, never forwarded)."""
    text = body.lower()
    return any(w in text for w in _CONTEXT_WORDS)


def rejects_json_mode(body: str) -> bool:
    """Whether a 400 body is about `response_format` (the server has no JSON mode), not about
    this one request (an over-long prompt, a bad parameter): only then is JSON mode dropped."""
    text = body.lower()
    return any(w in text for w in _JSON_MODE_WORDS)
