"""The OpenAI-compatible generator client against loopback stand-ins: an upstream's body (and a key it
quotes back) never leaves in an error, each call is cut to the query's deadline, retries count and
wait as the server and the deadline say, and calls share one keep-alive connection."""

from __future__ import annotations

import json
import logging
import time

import pytest
from stand_ins import HangingServer, ScriptedServer, quoting_the_key

from d2r_edge import deadline
from d2r_edge.generate.openai_compat import GeneratorError, OpenAICompatible, retry_after_s
from d2r_edge.redact import excerpt, redact, register_secret, safe_url

KEY = "sk-secret-123"
OK = {"choices": [{"message": {"content": '{"answer": "Paris"}'}}]}
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.setenv("D2R_UPSTREAM_KEY", KEY)
    return "D2R_UPSTREAM_KEY"


def test_a_401_quoting_the_key_is_one_request_and_the_key_stays_out_of_the_error_and_the_log(keyed, caplog):
    caplog.set_level(logging.DEBUG)
    with ScriptedServer() as srv:
        srv.replies = [(401, quoting_the_key)]
        client = OpenAICompatible(srv.url, "m", api_key_env=keyed, max_retries=3, backoff_s=0.01)
        with pytest.raises(GeneratorError) as err:
            client.complete(HELLO)
        assert srv.seen_headers[0]["Authorization"] == f"Bearer {KEY}"    # the stand-in did quote it back
    assert len(srv.seen) == 1 and err.value.attempts == 1 and err.value.status == 401
    msg = str(err.value)
    assert "upstream answered HTTP 401 Unauthorized (attempt 1 of 4); not retried: a client error" in msg
    assert srv.url in msg and "Incorrect API key" not in msg and KEY not in msg
    logged = caplog.text
    assert "Incorrect API key provided: [redacted]" in logged and KEY not in logged


@pytest.mark.parametrize("body", [
    "secret sk-abcdef123456 in text", '{"api_key": "hunter22hunter"}', "Authorization: Bearer abc.def-123456",
])
def test_key_shaped_tokens_in_an_upstream_body_are_masked_in_the_log(body, caplog):
    caplog.set_level(logging.WARNING)
    with ScriptedServer() as srv:
        srv.replies = [(500, body)]
        with pytest.raises(GeneratorError, match="HTTP 500 Internal Server Error") as err:
            OpenAICompatible(srv.url, "m", api_key_env=None, max_retries=0).complete(HELLO)
    assert body not in str(err.value) and "[redacted]" in caplog.text
    for secret in ("sk-abcdef123456", "hunter22hunter", "abc.def-123456"):
        assert secret not in caplog.text


def test_a_hanging_upstream_is_cut_to_the_deadline_not_the_timeout():
    with HangingServer() as up:
        client = OpenAICompatible(up.url, "m", api_key_env=None, timeout_s=60.0, max_retries=3)
        t0 = time.monotonic()
        with deadline.scope(1.0), pytest.raises(GeneratorError) as err:
            client.complete(HELLO)
        took = time.monotonic() - t0
    assert took < 1.0 + 0.5 and err.value.timed_out and err.value.attempts == 1
    assert "the request's deadline" in str(err.value)


def test_without_a_deadline_the_timeout_bounds_each_attempt():
    with HangingServer() as up:
        client = OpenAICompatible(up.url, "m", api_key_env=None, timeout_s=0.3, max_retries=1, backoff_s=0.01)
        t0 = time.monotonic()
        with pytest.raises(GeneratorError, match="attempt 2 of 2") as err:
            client.complete(HELLO)
    assert 0.6 <= time.monotonic() - t0 < 2.0 and err.value.timed_out


def test_a_passed_deadline_calls_nothing():
    with ScriptedServer() as srv:
        srv.replies = [(200, OK)]
        with deadline.scope(0.01):
            time.sleep(0.02)
            with pytest.raises(GeneratorError, match="deadline passed before") as err:
                OpenAICompatible(srv.url, "m", api_key_env=None).complete(HELLO)
    assert srv.seen == [] and err.value.timed_out


def test_retry_after_is_honoured_when_the_deadline_allows_it():
    with ScriptedServer() as srv:
        srv.replies = [(503, {"error": "busy"}, {"Retry-After": "1"}), (200, OK)]
        with deadline.scope(3.0):
            out = OpenAICompatible(srv.url, "m", api_key_env=None, backoff_s=0.01).complete(HELLO)
    assert json.loads(out.text) == {"answer": "Paris"}
    assert len(srv.seen) == 2 and srv.seen_at[1] - srv.seen_at[0] >= 1.0


def test_retry_after_past_the_deadline_is_not_waited_for():
    with ScriptedServer() as srv:
        srv.replies = [(503, {"error": "busy"}, {"Retry-After": "1"}), (200, OK)]
        t0 = time.monotonic()
        with deadline.scope(0.8), pytest.raises(GeneratorError) as err:
            OpenAICompatible(srv.url, "m", api_key_env=None, backoff_s=0.01).complete(HELLO)
        took = time.monotonic() - t0
    assert len(srv.seen) == 1 and took < 0.5 and not err.value.timed_out and err.value.status == 503
    assert "HTTP 503 Service Unavailable (attempt 1 of 4); not retried: the request's deadline leaves" in str(err.value)


def test_a_long_retry_after_is_not_waited_for_without_a_deadline_either():
    with ScriptedServer() as srv:
        srv.replies = [(429, "slow down", {"Retry-After": "3600"})]
        with pytest.raises(GeneratorError, match="the server asked to wait 3600 s"):
            OpenAICompatible(srv.url, "m", api_key_env=None).complete(HELLO)
    assert len(srv.seen) == 1


def test_retries_are_counted_as_made():
    with ScriptedServer() as srv:
        srv.replies = [(502, "bad gateway")] * 3
        with pytest.raises(GeneratorError, match=r"HTTP 502 Bad Gateway \(attempt 3 of 3\)$") as err:
            OpenAICompatible(srv.url, "m", api_key_env=None, max_retries=2, backoff_s=0.01).complete(HELLO)
    assert len(srv.seen) == 3 == err.value.attempts


def test_an_answer_without_choices_is_not_quoted(caplog):
    with ScriptedServer() as srv:
        srv.replies = [(200, {"detail": f"internal: {KEY}"})]
        with pytest.raises(GeneratorError, match="no choices") as err:
            OpenAICompatible(srv.url, "m", api_key_env=None).complete(HELLO)
    assert "internal" not in str(err.value) and KEY not in caplog.text


def test_calls_share_one_keep_alive_connection():
    with ScriptedServer() as srv:
        srv.replies = [(200, OK)] * 5
        client = OpenAICompatible(srv.url, "m", api_key_env=None)
        for _ in range(5):
            client.complete(HELLO)
        client.close()
    assert len(srv.seen) == 5 and srv.connections == 1


def test_retry_after_forms():
    assert retry_after_s("2") == 2.0 and retry_after_s(None) is None and retry_after_s("soon") is None
    assert retry_after_s("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == pytest.approx(10.0)
    assert retry_after_s("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412500.0) == 0.0


def test_redaction_helpers():
    register_secret("my-own-server-key-42")
    assert redact("key my-own-server-key-42 and sk-proj-ABCDEF_123") == "key [redacted] and [redacted]"
    assert redact("Bearer xyzxyzxyz") == "Bearer [redacted]"
    assert redact("a token=abcd1234&x=1") == "a token=[redacted]&x=1"
    assert redact("the usual answer: Paris") == "the usual answer: Paris"
    assert excerpt("a\nb\r\x1b[2J" + "x" * 400, 10) == "a\\nb\\r\\x1b[2Jxx..."
    assert safe_url("https://user:pw@api.example.invalid:8443/v1?api_key=zzz#f") == "https://api.example.invalid:8443/v1"
    assert "pw" not in str(OpenAICompatible("http://user:pw@127.0.0.1:9/v1", "m").where)


LLAMA_CTX = {"error": {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}}
OPENAI_CTX = {"error": {"message": "This model's maximum context length is 4096 tokens.", "type":
                        "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}


@pytest.mark.parametrize("status, body", [(500, LLAMA_CTX), (400, OPENAI_CTX)])
def test_a_prompt_over_the_context_is_not_retried_and_is_asked_again_with_half_the_passages(status, body):
    from d2r_edge.generate.openai_compat import exceeds_context
    from d2r_edge.repair import PromptStyle
    from d2r_edge.tasks import Task

    assert exceeds_context(json.dumps(body)) and not exceeds_context('{"error": "overloaded"}')
    fever = {"choices": [{"message": {"content": '{"response": "x", "label": "SUPPORTS"}'}}]}
    passages = [f"passage number {i}" for i in range(8)]
    with ScriptedServer() as srv:
        # 8 passages do not fit, nor 4; 2 do. One request each: a too-long prompt is never retried as it was
        srv.replies = [(status, body), (status, body), (200, fever)]
        client = OpenAICompatible(srv.url, "m", api_key_env=None, max_retries=3, backoff_s=0.01, logprobs=False)
        gen = client.generate(Task.FEVER, PromptStyle.SIMPLE, "a claim", passages, sample=False)
        assert gen.label.value == "SUPPORTS" and len(srv.seen) == 3
        shown = [sum(p in r["messages"][1]["content"] for p in passages) for r in srv.seen]
        assert shown == [8, 4, 2]
        # one passage that does not fit: the error says why, is not a client error (one prompt's problem,
        # an evaluation goes on) and does not quote the body
        srv.replies = [(status, body)]
        with pytest.raises(GeneratorError) as err:
            client.generate(Task.FEVER, PromptStyle.SIMPLE, "a claim", passages[:1], sample=False)
    e = err.value
    assert e.context_exceeded and not e.client_error and e.attempts == 1 and len(srv.seen) == 4
    assert "does not fit the model's context" in str(e) and "not retried" in str(e)
    assert "Context size" not in str(e) and "maximum context length" not in str(e)
