"""`d2r-edge report` at 10,000 records: the page's size, the time to write it, and (where Chromium and
Playwright are installed: bash .ci/setup-browser) the time a headless Chromium takes to open it and
show the first cards. Records are shaped like a run's (5 passages with NLI probabilities, a repair on
a third of them)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from benchmarks.conftest import EXTRA, RESULTS
from d2r_edge.view import write_report

N = 10_000


def _attempt(i: int, shift: int) -> dict:
    ids = [f"doc-{(i * 7 + k + shift) % 5000}" for k in range(5)]
    probs = [{"entailment": 0.1 + k * 0.1, "neutral": 0.6 - k * 0.1, "contradiction": 0.3} for k in range(5)]
    return {"passages": ids, "label": "SUPPORTS", "gated_label": "SUPPORTS",
            "response": f"The harbour lighthouse at point {i} was first lit in {1800 + i % 200} and converted later.",
            "failure": "no_failure", "e_q": "entailment", "e_r": "neutral", "kg": "no_triplets",
            "nli_q": probs, "nli_r": [probs[0], None, None, None, None],
            "timings_s": {"embed_query_s": 0.004, "retrieve_s": 0.0008, "generate_s": 1.9, "diagnose_s": 0.012,
                          "refresh_s": 1e-6, "mem_growth_mib": 0.4}}


def _records(path: Path) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(N):
            repaired = i % 3 == 0
            query = f"Claim {i}: the lighthouse at point {i} was first lit in {1800 + i % 200}."
            rec = {"id": f"claim-{i}", "query": query,
                   "task": "fever", "gold_label": ["SUPPORTS", "REFUTES", "NOT ENOUGH INFO"][i % 3],
                   "first": _attempt(i, 0), "failure": "insufficient_evidence" if repaired else "no_failure",
                   "gate": "paper", "first_answer": "SUPPORTS", "final_answer": "REFUTES" if i % 6 == 0 else "SUPPORTS",
                   "first_correct": i % 3 == 0, "final_correct": i % 2 == 0, "total_s": 2.0 + (i % 50) / 100,
                   "error": None,
                   "repair": None if not repaired else {
                       "allowed": ["dense_k10", "dense_k20", "bm25_k10", "bm25_k20", "second_hop"], "cost_masked": [],
                       "arm": "dense_k20", "latency_s": 2.4, "mem_growth_mib": 0.3, "memory_kind": "host",
                       "over_budget": i % 9 == 0, "reward": 0.5, "x": [0.0] * 147, "policy_s": 3e-5,
                       "unavailable": {"rerank": "no reranker model"}, "explored": False,
                       "budget": {"latency_s": 3.0, "device_mem_mib": 6.0}},
                   "final": _attempt(i, 1)}
            fh.write(json.dumps(rec) + "\n")
    return path


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    return _records(tmp_path_factory.mktemp("report") / "records.jsonl")


@pytest.mark.benchmark(group="report-10k")
def test_write_report_10k(benchmark, record, records, tmp_path):
    out = tmp_path / "report.html"
    benchmark.pedantic(write_report, args=(records, out), rounds=3, iterations=1)
    record("report-write-10k", **{"report-10k-mib": out.stat().st_size / 2**20,
                                  "records-10k-mib": records.stat().st_size / 2**20})


@pytest.mark.benchmark(group="report-10k")
def test_open_report_10k_in_chromium(benchmark, record, records, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: bash .ci/setup-browser")
    chromium = os.environ.get("D2R_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("no Chromium here: bash .ci/setup-browser")
    out = tmp_path / "report.html"
    write_report(records, out)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])

        def open_page():
            page = browser.new_page()
            page.goto(out.as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=60_000)
            shown = page.locator(".card").count()
            page.close()
            return shown

        shown = benchmark.pedantic(open_page, rounds=3, iterations=1, warmup_rounds=1)
        browser.close()
    assert shown == 50
    record("report-open-10k")


def test_targets():
    """A 10k-record page: written in <= 10 s, opened with its first cards in <= 5 s where measured."""
    assert RESULTS["report-write-10k"] <= 10.0, RESULTS["report-write-10k"]
    assert EXTRA["report-10k-mib"] <= 60, EXTRA["report-10k-mib"]
    if "report-open-10k" in RESULTS:
        assert RESULTS["report-open-10k"] <= 5.0, RESULTS["report-open-10k"]
