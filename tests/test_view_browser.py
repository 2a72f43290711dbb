"""A real headless Chromium opens a `d2r-edge report` page and serve's live /ui: no console errors,
no request beyond the page itself, filters and search change the visible cards, hostile text
stays text, and a screenshot is saved (under the test's tmp dir, and D2R_SCREENSHOTS when set).

The CI's `browser` step runs these after `bash .ci/setup-browser` (Chromium from the distribution's
packages, Playwright's Python client driving it); where Chromium cannot be had they skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: bash .ci/setup-browser")
CHROMIUM = os.environ.get("D2R_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if not CHROMIUM:
    pytest.skip("no Chromium on this machine: bash .ci/setup-browser installs it (apt)", allow_module_level=True)

from stand_ins import Live, demo_questions, make_runtime  # noqa: E402
from test_view import EVIL_TITLE, _kb, _record, _write  # noqa: E402

from d2r_edge.serve.app import ServeConfig, create_app  # noqa: E402
from d2r_edge.view import write_report  # noqa: E402

XSS_QUERY = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script> Did the ferry run in 1901?'


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _open(browser, url: str, problems: list, requests: list):
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    return page


def _shot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=False)
    if os.environ.get("D2R_SCREENSHOTS"):
        out = Path(os.environ["D2R_SCREENSHOTS"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out / name)
    assert path.stat().st_size > 10_000
    return path


def test_report_in_chromium(browser, tmp_path):
    recs = [_record(0, query=XSS_QUERY, repaired=True, first_ok=False, final_ok=True, failure="insufficient_evidence")]
    recs += [_record(i, repaired=i % 3 == 0, first_ok=i % 4 != 0, final_ok=i % 5 != 0,
                     failure=["no_failure", "wrong_response", "insufficient_evidence"][i % 3]) for i in range(1, 120)]
    out = tmp_path / "report.html"
    write_report(_write(tmp_path, recs), out, kb=_kb(tmp_path))
    problems, requests = [], []
    page = _open(browser, out.as_uri(), problems, requests)
    assert page.locator(".card").count() == 50                       # paged: the first 50 of 120
    assert page.locator("#count").inner_text().startswith("120 of 120 records")
    fixed = sum(1 for r in recs if not r["first_correct"] and r["final_correct"])
    page.check("#f-fixed")
    assert page.locator(".card").count() == fixed and fixed < 50
    page.uncheck("#f-fixed")
    page.fill("#q", "ferry run in 1901")
    assert page.locator(".card").count() == 1
    assert page.locator(".card h3").inner_text() == XSS_QUERY            # shown as the characters it is
    page.locator(".card details").first.evaluate("d => d.open = true")
    assert EVIL_TITLE in page.locator(".card").inner_text()
    assert page.evaluate("window.__xss") is None and page.locator("img").count() == 0
    page.fill("#q", "")
    page.select_option("#failure", "wrong_response")
    assert page.locator(".card").count() == sum(1 for r in recs if r["failure"] == "wrong_response")
    page.select_option("#failure", "")
    page.click("#more")
    assert page.locator(".card").count() == 100
    _shot(page, tmp_path, "report.png")
    assert not problems, problems
    assert all(u.startswith(("file://", "data:")) for u in requests), requests


def test_serve_ui_in_chromium(browser, demo_kb, tiny_models, monkeypatch, tmp_path):
    from test_serve_ui import KEY, ask

    monkeypatch.setenv("D2R_UI_KEY", KEY)
    runtime = make_runtime(demo_kb, tiny_models)
    with Live(create_app(runtime, ServeConfig(api_key_env="D2R_UI_KEY", ui=True))) as srv:
        assert ask(srv.url, demo_questions()[0]) == 200
        problems = []
        page = browser.new_page(viewport={"width": 1200, "height": 1000})
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" and "401" not in m.text else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(srv.url + "/ui")
        page.fill("input[name=key]", KEY)
        page.click("input[type=submit]")
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        assert page.locator(".card").count() == 1
        assert ask(srv.url, demo_questions()[1]) == 200
        deadline = time.time() + 15                                  # the page polls every 4 s
        while page.locator(".card").count() < 2 and time.time() < deadline:
            page.wait_for_timeout(250)
        assert page.locator(".card").count() == 2
        assert page.locator(".card h3").first.inner_text() == demo_questions()[1]     # newest first
        assert KEY not in page.content()
        _shot(page, tmp_path, "serve-ui.png")
        assert not problems, problems
