"""`d2r-edge serve --ui`: off by default, behind the API key through a sign-in form and a session
cookie, the last requests as cards (polled as JSON), records from a previous run, no key on the page."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlencode, urlparse

import pytest
from stand_ins import Live, demo_questions, make_runtime

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from d2r_edge.serve.app import ServeConfig, create_app  # noqa: E402
from d2r_edge.serve.ui import COOKIE  # noqa: E402

KEY = "ui-s3cret-key-123"


def request(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body text) without following redirects."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode("utf-8")
    finally:
        conn.close()


def ask(url: str, question: str, key: str | None = KEY) -> int:
    body = json.dumps({"model": "d2r-edge", "messages": [{"role": "user", "content": question}]}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return request(url, "POST", "/v1/chat/completions", body, headers)[0]


@pytest.fixture(scope="module")
def runtime(demo_kb, tiny_models):
    return make_runtime(demo_kb, tiny_models)


def test_ui_is_off_by_default(runtime):
    with Live(create_app(runtime, ServeConfig())) as srv:
        assert request(srv.url, "GET", "/ui")[0] == 404


def test_ui_behind_the_key_with_a_session_cookie(runtime, monkeypatch, tmp_path):
    monkeypatch.setenv("D2R_UI_KEY", KEY)
    records = tmp_path / "records.jsonl"
    config = ServeConfig(api_key_env="D2R_UI_KEY", ui=True, ui_keep=3, records_path=records)
    with Live(create_app(runtime, config)) as srv:
        status, headers, page = request(srv.url, "GET", "/ui")
        assert status == 401 and '<form method="post" action="/ui/login">' in page and KEY not in page
        assert request(srv.url, "GET", "/ui/cards.json")[0] == 401
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        status, headers, page = request(srv.url, "POST", "/ui/login", urlencode({"key": "wrong"}).encode(), form)
        assert status == 401 and "wrong key" in page and "set-cookie" not in headers
        status, headers, _ = request(srv.url, "POST", "/ui/login", b"key=" + b"x" * 5000, form)
        assert status == 413
        status, headers, _ = request(srv.url, "POST", "/ui/login", urlencode({"key": KEY}).encode(), form)
        assert status == 303 and headers["location"] == "/ui"
        cookie = headers["set-cookie"]
        token = cookie.split(";")[0].split("=", 1)[1]
        assert cookie.startswith(f"{COOKIE}=") and token != KEY and len(token) >= 40
        low = cookie.lower()
        assert "httponly" in low and "samesite=strict" in low and "path=/ui" in low
        session = {"Cookie": f"{COOKIE}={token}"}
        # the cookie opens the UI, never the API
        assert ask(srv.url, demo_questions()[0], key=None) == 401
        status, _, _ = request(srv.url, "GET", "/v1/models", headers=session)
        assert status == 401
        for q in demo_questions()[:4]:
            assert ask(srv.url, q) == 200
        status, headers, page = request(srv.url, "GET", "/ui", headers=session)
        assert status == 200 and "connect-src 'self'" in page and headers["cache-control"] == "no-store"
        status, _, raw = request(srv.url, "GET", "/ui/cards.json", headers=session)
        cards = json.loads(raw)["cards"]
        assert [c["query"] for c in cards] == list(reversed(demo_questions()[1:4]))     # the last 3, newest first
        assert KEY not in raw and "authorization" not in raw.lower() and '"x"' not in raw
        # the API's bearer header reaches the UI too; a made-up cookie does not
        assert request(srv.url, "GET", "/ui/cards.json", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
        assert request(srv.url, "GET", "/ui", headers={"Cookie": f"{COOKIE}=forged"})[0] == 401
    # a restarted server shows the requests its --records file holds
    with Live(create_app(runtime, config)) as srv:
        status, _, raw = request(srv.url, "GET", "/ui/cards.json", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200 and len(json.loads(raw)["cards"]) == 3


def test_a_records_file_without_records_starts_the_ui_empty(runtime, tmp_path, caplog):
    from d2r_edge.serve.ui import Ui

    bad = tmp_path / "records.jsonl"
    bad.write_text("not json\n")
    assert Ui(None, 5, bad).snapshot() == [] and "no earlier requests shown" in caplog.text
