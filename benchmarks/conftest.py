"""Shared plumbing: medians of the benchmarks in this run, so ratios compare side by side."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

RESULTS: dict[str, float] = {}
EXTRA: dict[str, float] = {}
REPORT = Path(os.environ.get("D2R_BENCH_REPORT", ".benchmarks/last-run.json"))


@pytest.fixture
def record(benchmark, request):
    """Call after benchmark(...) to keep its median (seconds) under the test's id."""

    def _record(key: str | None = None, **extra: float) -> float:
        median = benchmark.stats.stats.median
        RESULTS[key or request.node.name] = median
        EXTRA.update(extra)
        return median

    return _record


def ratio_or_skip(num: str, den: str) -> float:
    if num not in RESULTS or den not in RESULTS:
        pytest.skip(f"needs both {num} and {den} in this run")
    return RESULTS[num] / RESULTS[den]


def pytest_sessionfinish(session, exitstatus):
    if RESULTS:
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(json.dumps({"median_s": RESULTS, "extra": EXTRA}, indent=2))
