"""`d2r-edge serve` on loopback: the official openai client, the d2r object, bad input, upstream
faults, limits, auth, concurrency, records, and a kill -9 under load."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from stand_ins import HangingServer, Live, ScriptedServer, demo_questions, make_runtime, quoting_the_key

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from d2r_edge.serve.app import ServeConfig, create_app  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
D2R_KEYS = {"request_id", "task", "failure_type", "final_failure_type", "repaired", "arm", "first_answer",
            "passages", "entailment", "p_wrong", "latency_ms", "budget", "trusted", "trust", "abstained"}


def call(url: str, path: str, body=None, headers: dict | None = None, method: str | None = None):
    """(status, headers, parsed JSON or text) of one raw HTTP request."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                 **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, hdrs, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        status, hdrs, raw = err.code, dict(err.headers), err.read()
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw.decode()


def ask(question: str) -> dict:
    return {"model": "d2r-edge", "messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": question}]}


@pytest.fixture(scope="module")
def runtime(demo_kb, tiny_models):
    return make_runtime(demo_kb, tiny_models)


@pytest.fixture(scope="module")
def live(runtime, tmp_path_factory):
    records = tmp_path_factory.mktemp("serve") / "records.jsonl"
    with Live(create_app(runtime, ServeConfig(records_path=records, max_body_bytes=64 * 1024))) as srv:
        srv.records = records
        yield srv


def test_openai_client_gets_the_verified_answer_and_the_d2r_object(live):
    client = live.client()
    q = demo_questions()[0]
    out = client.chat.completions.create(model="d2r-edge", messages=[{"role": "user", "content": q}])
    d2r = out.model_extra["d2r"]
    assert D2R_KEYS <= set(d2r) and out.choices[0].message.content and out.choices[0].finish_reason == "stop"
    assert len(d2r["passages"]) == 5 and {"id", "title", "score"} == set(d2r["passages"][0])
    lat = d2r["latency_ms"]
    assert {"embed", "retrieve", "generate", "diagnose", "gate", "repair", "other", "total", "repair_generate",
            "overhead"} == set(lat)
    parts = ("embed", "retrieve", "generate", "diagnose", "gate", "repair", "other")
    assert abs(sum(lat[k] for k in parts) - lat["total"]) < 0.05          # the parts partition the total (ms)
    assert d2r["budget"]["repair_latency_s"] == 3.0 and d2r["budget"]["deadline_ms"] is None
    # the same answer streamed: role chunk, pieces, finish chunk with d2r, [DONE]
    stream = client.chat.completions.create(model="d2r-edge", messages=[{"role": "user", "content": q}],
                                            stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop" and D2R_KEYS <= set(chunks[-1].model_extra["d2r"])
    raw = urllib.request.urlopen(urllib.request.Request(
        live.url + "/v1/chat/completions", data=json.dumps({**ask(q), "stream": True}).encode(),
        headers={"Content-Type": "application/json"}), timeout=60)
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    events = raw.read().decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    # each answered request is one record with its request id
    ids = [json.loads(line)["request_id"] for line in live.records.read_text().splitlines()]
    assert d2r["request_id"] in ids and chunks[-1].model_extra["d2r"]["request_id"] in ids


def test_verify_models_health_and_metrics(live):
    status, _, body = call(live.url, "/v1/verify", {"question": demo_questions()[0], "answer": "Agnes Morrow",
                                                     "passages": ["Agnes Morrow designed the bridge."]})
    assert status == 200 and body["object"] == "d2r.verification" and len(body["passages"]) == 1
    assert body["failure_type"] in {"no_failure", "insufficient_evidence", "wrong_response", "wrong_predicate"}
    assert [m.id for m in live.client().models.list()] == ["d2r-edge"]
    status, _, health = call(live.url, "/healthz")
    assert status == 200 and health["status"] == "ok" and health["kb_docs"] > 0
    call(live.url, "/v1/chat/completions", ask(demo_questions()[1]))
    status, hdrs, text = call(live.url, "/metrics")
    assert status == 200 and hdrs["content-type"].startswith("text/plain")
    assert 'd2r_requests_total{route="chat_completions",status="200"}' in text
    assert 'd2r_stage_seconds_bucket{le="0.005",stage="embed"}' in text and "d2r_failures_total{" in text
    sums = {line.split('stage="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("d2r_stage_seconds_sum{")}
    parts = ("embed", "retrieve", "generate", "diagnose", "gate", "repair", "other")
    assert set(parts) | {"total", "repair_generate", "overhead"} == set(sums)
    assert sum(sums[k] for k in parts) == pytest.approx(sums["total"], abs=1e-3)   # summed over the requests


BAD = [
    (b"{not json", 400, "invalid_json"),
    (b"\xff\xfe", 400, "invalid_json"),
    (b"[" * 50_000, 400, "invalid_json"),
    (json.dumps([1, 2]).encode(), 400, "invalid_value"),
    (json.dumps({"model": "m"}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": [{"role": "system", "content": "only a system prompt"}]}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": 7}]}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": ["hi"]}).encode(), 400, "invalid_value"),
    (json.dumps({**ask("q?"), "stream": "yes"}).encode(), 400, "invalid_value"),
    (json.dumps({**ask("q?"), "n": 2}).encode(), 400, "invalid_value"),
    (json.dumps({**ask("q?"), "model": 5}).encode(), 400, "invalid_value"),
    (json.dumps(ask("x" * 5000)).encode(), 400, "invalid_value"),
    (json.dumps(ask("q " * 40_000)).encode(), 413, "body_too_large"),
]


@pytest.mark.parametrize("body, status, code", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_gets_its_status_and_an_openai_error_body(live, body, status, code):
    got, _, err = call(live.url, "/v1/chat/completions", body)
    assert got == status and set(err) == {"error"} and err["error"]["code"] == code, err
    assert err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in json.dumps(err)
    ok, _, good = call(live.url, "/v1/chat/completions", ask(demo_questions()[2]))   # the server lives on
    assert ok == 200 and good["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path, method, body, headers, status", [
    ("/v1/nowhere", "GET", None, {}, 404),
    ("/v1/models", "DELETE", None, {}, 405),
    ("/v1/chat/completions", "POST", ask("q?"), {"X-D2R-Deadline-Ms": "soon"}, 400),
    ("/v1/chat/completions", "POST", ask("q?"), {"X-D2R-Deadline-Ms": "-5"}, 400),
    ("/v1/verify", "POST", {"question": "q?"}, {}, 400),
    ("/v1/verify", "POST", {"question": "q?", "answer": "a", "passages": "text"}, {}, 400),
    ("/v1/verify", "POST", {"question": "q?", "answer": "a", "passages": [{"title": "t"}]}, {}, 400),
])
def test_other_bad_requests(live, path, method, body, headers, status):
    got, _, err = call(live.url, path, body, headers, method)
    assert got == status and err["error"]["message"] and "Traceback" not in err["error"]["message"]


def test_a_body_is_read_as_json_whatever_its_content_type(live):
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):     # what `curl -d` sends
        status, _, body = call(live.url, "/v1/chat/completions", ask(demo_questions()[0]), {"Content-Type": ctype})
        assert status == 200 and body["choices"][0]["message"]["content"]


def test_keep_alive_connections_get_tcp_nodelay():
    """asyncio sets TCP_NODELAY only on connections of a socket made with proto IPPROTO_TCP; without it a
    keep-alive client waited ~40 ms (a delayed ACK) for every response body."""
    import asyncio

    from d2r_edge.serve import listening_socket

    sock = listening_socket("127.0.0.1", 0)
    sock.listen(1)
    seen = []

    async def main():
        server = await asyncio.start_server(lambda r, w: seen.append(
            w.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)), sock=sock)
        with socket.create_connection(sock.getsockname()):
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
        server.close()

    asyncio.run(main())
    assert seen and seen[0] != 0


def test_deadline_header_reaches_the_repair_decision(live, runtime):
    repaired = [q for q in demo_questions() if runtime.answer(q).repaired]
    assert repaired
    _, _, body = call(live.url, "/v1/chat/completions", ask(repaired[0]), {"X-D2R-Deadline-Ms": "0.001"})
    budget = body["d2r"]["budget"]
    assert budget["deadline_ms"] == 0.001 and "deadline" in budget["repair_skipped"]["reason"]
    assert not body["d2r"]["repaired"] and body["choices"][0]["message"]["content"] == body["d2r"]["first_answer"]


def test_sixteen_concurrent_clients_get_the_sequential_answers(live):
    questions = (demo_questions() * 3)[:16]
    client = live.client()

    def one(q: str) -> tuple[str, str | None]:
        out = client.chat.completions.create(model="d2r-edge", messages=[{"role": "user", "content": q}])
        return out.choices[0].message.content, out.model_extra["d2r"]["arm"]

    sequential = [one(q) for q in questions]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(one, questions))
    assert concurrent == sequential


def test_over_the_concurrency_limit_is_429_with_retry_after(runtime):
    app = create_app(runtime, ServeConfig(max_concurrency=1))
    server = app.state.server
    gate, entered = threading.Event(), threading.Event()
    real = server.answer

    def held(question, deadline_s):
        entered.set()
        gate.wait(30)
        return real(question, deadline_s)

    server.answer = held
    with Live(app) as srv, ThreadPoolExecutor(1) as pool:
        first = pool.submit(call, srv.url, "/v1/chat/completions", ask(demo_questions()[0]))
        assert entered.wait(30)
        status, hdrs, err = call(srv.url, "/v1/chat/completions", ask(demo_questions()[1]))
        gate.set()
        assert status == 429 and hdrs["retry-after"] == "1" and err["error"]["type"] == "rate_limit_error"
        assert first.result()[0] == 200
        assert call(srv.url, "/v1/chat/completions", ask(demo_questions()[1]))[0] == 200


def test_auth_on_every_route_but_healthz(runtime, monkeypatch):
    monkeypatch.setenv("D2R_TEST_KEY", "s3cret-key")
    with Live(create_app(runtime, ServeConfig(api_key_env="D2R_TEST_KEY"))) as srv:
        assert call(srv.url, "/healthz")[0] == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-key"}):
            status, hdrs, err = call(srv.url, "/v1/chat/completions", ask("q?"), headers)
            assert status == 401 and err["error"]["code"] == "invalid_api_key" and "s3cret" not in json.dumps(err)
        assert call(srv.url, "/metrics")[0] == 401 and call(srv.url, "/v1/models")[0] == 401
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        out = srv.client(api_key="s3cret-key").chat.completions.create(
            model="d2r-edge", messages=[{"role": "user", "content": demo_questions()[0]}])
        assert out.choices[0].message.content
    monkeypatch.delenv("D2R_TEST_KEY")
    from d2r_edge.errors import ConfigError

    with pytest.raises(ConfigError, match="D2R_TEST_KEY"):
        ServeConfig(api_key_env="D2R_TEST_KEY")


@pytest.mark.parametrize("replies, status, code", [
    ([(500, {"error": "boom"})] * 2, 502, "upstream_error"),
    ([(200, "this is not json")] * 2, 502, "upstream_error"),
    ([(200, {"choices": []})], 502, "upstream_error"),
    (None, 504, "upstream_timeout"),
])
def test_upstream_faults_are_502_or_504_naming_the_url_never_the_key(demo_kb, tiny_models, monkeypatch, replies,
                                                                     status, code):
    monkeypatch.setenv("D2R_UPSTREAM_KEY", "upstream-s3cret")
    with ScriptedServer() as upstream:
        if replies is None:              # an upstream that accepts and never answers
            hang = socket.socket()
            hang.bind(("127.0.0.1", 0))
            hang.listen(8)
            url = f"http://127.0.0.1:{hang.getsockname()[1]}/v1"
        else:
            upstream.replies = list(replies)
            url = upstream.url
        rt = make_runtime(demo_kb, tiny_models, generator="openai", base_url=url, timeout_s=0.5,
                          api_key_env="D2R_UPSTREAM_KEY")
        rt.pipeline.generator.max_retries, rt.pipeline.generator.backoff_s = 1, 0.01
        with Live(create_app(rt)) as srv:
            got, _, err = call(srv.url, "/v1/chat/completions", ask(demo_questions()[0]))
            assert got == status and err["error"]["code"] == code, err
            assert url in err["error"]["message"] and "upstream-s3cret" not in json.dumps(err)
            if replies is not None:      # the upstream is back: the next request is answered
                upstream.replies = [(200, {"choices": [{"message": {"content": '{"answer": "Agnes Morrow"}'}}]})] * 4
                ok, _, body = call(srv.url, "/v1/chat/completions", ask(demo_questions()[0]))
                assert ok == 200 and body["choices"][0]["message"]["content"]
        if replies is None:
            hang.close()


KEY = "sk-secret-123"
OK_REPLY = (200, {"choices": [{"message": {"content": '{"answer": "Agnes Morrow"}'}}]})


def test_an_upstream_401_quoting_its_key_reaches_no_client_record_or_log(demo_kb, tiny_models, monkeypatch,
                                                                         tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("D2R_UPSTREAM_KEY", KEY)
    records = tmp_path / "records.jsonl"
    with ScriptedServer() as upstream:
        rt = make_runtime(demo_kb, tiny_models, generator="openai", base_url=upstream.url, timeout_s=5.0,
                          api_key_env="D2R_UPSTREAM_KEY")
        with Live(create_app(rt, ServeConfig(records_path=records))) as srv:
            upstream.replies = [(401, quoting_the_key)]
            req = urllib.request.Request(srv.url + "/v1/chat/completions", data=json.dumps(
                ask(demo_questions()[0])).encode(), headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as got:
                urllib.request.urlopen(req, timeout=60)
            raw = got.value.read()
            assert got.value.code == 502 and len(upstream.seen) == 1 and KEY.encode() not in raw
            err = json.loads(raw)["error"]
            assert "upstream answered HTTP 401 Unauthorized (attempt 1 of 4); not retried" in err["message"]
            assert upstream.url in err["message"] and "Incorrect API key" not in err["message"]
            assert (err["code"], err["upstream_status"], err["upstream_attempts"]) == ("upstream_error", 401, 1)
            # the repair's call is the one refused: the first answer stands, the record says why
            for question in demo_questions():
                upstream.replies = [OK_REPLY, (401, quoting_the_key)]
                status, _, body = call(srv.url, "/v1/chat/completions", ask(question))
                assert status == 200
                if not upstream.replies:
                    break
            else:
                pytest.fail("no demo question was sent to repair")
    assert upstream.seen_headers[-1]["Authorization"] == f"Bearer {KEY}"
    logged = records.read_bytes()
    assert KEY.encode() not in logged
    last = json.loads(logged.splitlines()[-1])
    assert "upstream answered HTTP 401 Unauthorized" in last["repair_error"]
    assert KEY not in caplog.text and "Incorrect API key provided: [redacted]" in caplog.text


def test_a_hung_upstream_is_504_within_the_deadline_whatever_the_timeout(demo_kb, tiny_models):
    with HangingServer() as upstream:
        rt = make_runtime(demo_kb, tiny_models, generator="openai", base_url=upstream.url, timeout_s=60.0,
                          api_key_env=None)
        with Live(create_app(rt)) as srv:
            t0 = time.monotonic()
            status, _, err = call(srv.url, "/v1/chat/completions", ask(demo_questions()[0]),
                                  {"X-D2R-Deadline-Ms": "3000"})
            took = time.monotonic() - t0
            assert status == 504 and err["error"]["code"] == "upstream_timeout" and took <= 3.5, (took, err)
            assert "the request's deadline" in err["error"]["message"]
        from d2r_edge.generate.openai_compat import GeneratorError

        t0 = time.monotonic()       # the same for a Python caller of Runtime.answer
        with pytest.raises(GeneratorError) as exc:
            rt.answer(demo_questions()[1], deadline_s=1.0)
        assert exc.value.timed_out and time.monotonic() - t0 <= 1.5


def test_a_deadline_that_passes_in_the_queue_is_504(runtime):
    gate, entered = threading.Event(), threading.Event()
    real = runtime.pipeline.run_attempts

    def held(*a, **kw):
        entered.set()
        gate.wait(30)
        return real(*a, **kw)

    runtime.pipeline.run_attempts = held
    try:
        with Live(create_app(runtime)) as srv, ThreadPoolExecutor(1) as pool:
            first = pool.submit(call, srv.url, "/v1/chat/completions", ask(demo_questions()[0]))
            assert entered.wait(30)
            t0 = time.monotonic()
            status, _, err = call(srv.url, "/v1/chat/completions", ask(demo_questions()[1]),
                                  {"X-D2R-Deadline-Ms": "500"})
            took = time.monotonic() - t0
            gate.set()
            assert status == 504 and err["error"]["code"] == "deadline_exceeded" and took < 1.0
            assert first.result()[0] == 200
    finally:
        runtime.pipeline.run_attempts = real


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_cmd(demo_kb, tiny_models, port: int, tmp: Path) -> list[str]:
    return [sys.executable, "-m", "d2r_edge.cli", "serve", "--kb", str(demo_kb), "--models", str(tiny_models),
            "--allow-random-weights", "--task", "qa", "--port", str(port), "--records", str(tmp / "records.jsonl"),
            "--learn", "--policy", str(tmp / "policy.npz"), "--checkpoint-every", "2", "--max-concurrency", "32"]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    """The server's log goes to a file: a pipe nobody reads under load would fill and stall it."""
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stderr=fh, stdout=subprocess.DEVNULL)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
        try:
            if call(url, "/healthz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def test_kill_9_under_load_then_restart_loses_and_duplicates_nothing(demo_kb, tiny_models, tmp_path):
    from d2r_edge.policy import ThompsonSampling, updates_of
    from d2r_edge.policy.state import stored_kind

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = _start(_serve_cmd(demo_kb, tiny_models, port, tmp_path), log)
    completed, stop = [], threading.Event()

    def client(i: int) -> None:
        questions = demo_questions()
        n = i
        while not stop.is_set():
            try:
                status, _, body = call(url, "/v1/chat/completions", ask(questions[n % len(questions)]))
            except OSError:
                return
            if status == 200:
                completed.append(body["d2r"]["request_id"])
            n += 1

    try:
        _wait_healthy(url, proc, log)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while len(completed) < 12:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # restart on the same records and policy: it opens them (a torn last line is cut) and serves
    proc = _start(_serve_cmd(demo_kb, tiny_models, port, tmp_path), log)
    try:
        _wait_healthy(url, proc, log)
        status, _, body = call(url, "/v1/chat/completions", ask(demo_questions()[0]))
        assert status == 200
        completed.append(body["d2r"]["request_id"])
        proc.send_signal(signal.SIGTERM)                      # graceful: checkpoints the policy
        assert proc.wait(60) == 0                             # a clean drain is a clean exit
        assert "policy checkpointed" in log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
    ids = [json.loads(line)["request_id"] for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)), "a record was written twice"
    assert set(completed) <= set(ids), "a completed request has no record"
    learned = sum(1 for line in (tmp_path / "records.jsonl").read_text().splitlines()
                  if (json.loads(line).get("repair") or {}).get("x") is not None)
    assert stored_kind(tmp_path / "policy.npz") == "thompson"          # QA's default kind
    policy = ThompsonSampling.load(tmp_path / "policy.npz")
    assert updates_of(policy) == learned                      # every logged update, replayed or saved


def test_serve_cli_errors_are_one_line(demo_kb, tiny_models, tmp_path):
    port = _free_port()
    base = [sys.executable, "-m", "d2r_edge.cli", "serve", "--kb", str(demo_kb), "--models", str(tiny_models),
            "--allow-random-weights", "--task", "qa", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "NO_SUCH_KEY_VAR"}
    for extra, code, words in ((["--learn"], 2, "--policy"), (["--api-key-env", "NO_SUCH_KEY_VAR"], 2,
                                                                "NO_SUCH_KEY_VAR"),
                               (["--max-concurrency", "0"], 2, "max_concurrency")):
        done = subprocess.run(base + extra, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == code and words in done.stderr and "Traceback" not in done.stderr, done.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        done = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert done.returncode == 13 and "Traceback" not in done.stderr, done.stderr
