"""`d2r-edge serve --ui`: the last answered requests as report cards at GET /ui (off by default).

Auth: with `--api-key-env`, the page is behind the same key as the API. A browser cannot send an
`Authorization` header to a page it navigates to, so GET /ui without one shows a login form; POST
/ui/login checks the key (constant time) and answers with a random session token in an HttpOnly,
SameSite=Strict cookie scoped to /ui (Secure over https) - the key itself is never stored in the
browser, put in a URL or echoed. Tokens live in memory for 12 hours (at most 256 at once). A client
that sends the API's bearer header reaches /ui as well.

The page is `d2r_edge.view`'s, with the same escaping and CSP (plus `connect-src 'self'`): its script
polls /ui/cards.json every few seconds and shows new requests without losing the filters. Cards
carry what a record carries (never request headers or keys).
"""

from __future__ import annotations

import hmac
import html
import logging
import secrets
import threading
import time
from collections import deque
from pathlib import Path
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from d2r_edge.errors import InputError
from d2r_edge.view.cards import card, read_records, summarize
from d2r_edge.view.page import render_page

log = logging.getLogger(__name__)

COOKIE = "d2r_ui"
SESSION_S = 12 * 3600
MAX_SESSIONS = 256
MAX_LOGIN_BYTES = 4096

_LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; form-action 'self'">
<title>d2r-edge: sign in</title><style>body{font:14px system-ui,sans-serif;margin:60px auto;max-width:360px}
input{width:100%;padding:6px;margin:6px 0}p.e{color:#b00}</style></head><body>
<h1>d2r-edge</h1><p>The server was started with an API key (--api-key-env). Enter it to see the answered requests.</p>
{error}<form method="post" action="/ui/login"><input type="password" name="key" autocomplete="current-password"
aria-label="API key" autofocus><input type="submit" value="sign in"></form></body></html>"""


class Ui:
    """The last `keep` records as cards, and the browser sessions."""

    def __init__(self, key: str | None, keep: int = 200, records_path: Path | None = None) -> None:
        self._key = None if key is None else key.encode("utf-8")
        self.cards: deque[dict] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._sessions: dict[str, float] = {}
        if records_path is not None and records_path.is_file():
            try:
                rows, _ = read_records(records_path)
            except InputError as exc:       # the page starts empty; the server itself must not fail on it
                log.warning("serve --ui: no earlier requests shown: %s", exc)
                rows = []
            for rec in rows[-keep:]:
                self.cards.append(card(rec, {}))

    def add(self, record: dict) -> None:
        c = card(record, {})
        with self._lock:
            self.cards.append(c)

    def snapshot(self) -> list[dict]:
        """Newest first."""
        with self._lock:
            return list(reversed(self.cards))

    # --- auth -------------------------------------------------------------------------------
    def authorized(self, request: Request) -> bool:
        if self._key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8"), self._key):
            return True
        session = request.cookies.get(COOKIE, "")
        with self._lock:
            expiry = self._sessions.get(session)
            if expiry is not None and expiry < time.time():
                self._sessions.pop(session, None)
                expiry = None
        return expiry is not None

    def login(self, given: str) -> str | None:
        if self._key is None or not hmac.compare_digest(given.encode("utf-8"), self._key):
            return None
        token = secrets.token_urlsafe(32)
        with self._lock:
            now = time.time()
            for old in [t for t, exp in self._sessions.items() if exp < now]:
                del self._sessions[old]
            while len(self._sessions) >= MAX_SESSIONS:
                del self._sessions[min(self._sessions, key=self._sessions.get)]
            self._sessions[token] = now + SESSION_S
        return token


def _login_page(error: str = "", status: int = 200) -> HTMLResponse:
    body = _LOGIN.replace("{error}", f'<p class="e">{html.escape(error)}</p>' if error else "")
    return HTMLResponse(body, status_code=status, headers={"Cache-Control": "no-store"})


async def ui_page(ui: Ui, request: Request) -> Response:
    if not ui.authorized(request):
        return _login_page(status=401)
    cards = ui.snapshot()
    page = render_page(cards, summarize(cards), title="d2r-edge serve: answered requests",
                       note=f"the last {ui.cards.maxlen} requests, newest first; new ones appear as they are answered "
                            "(the summary is as of this page load)", live="/ui/cards.json")
    return HTMLResponse(page, headers={"Cache-Control": "no-store"})


async def ui_cards(ui: Ui, request: Request) -> Response:
    if not ui.authorized(request):
        return JSONResponse({"error": "sign in at /ui"}, status_code=401)
    return JSONResponse({"cards": ui.snapshot()}, headers={"Cache-Control": "no-store"})


async def ui_login(ui: Ui, request: Request) -> Response:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BYTES:
            return _login_page("that request was too large", status=413)
    given = parse_qs(body.decode("utf-8", "replace")).get("key", [""])[0]
    token = ui.login(given)
    if token is None:
        return _login_page("wrong key", status=401)
    resp = RedirectResponse("/ui", status_code=303)
    resp.set_cookie(COOKIE, token, max_age=SESSION_S, path="/ui", httponly=True, samesite="strict",
                    secure=request.url.scheme == "https")
    return resp
