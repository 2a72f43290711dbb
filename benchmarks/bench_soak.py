"""Soak: `d2r-edge run` over 20,000 queries, killed half-way and resumed; RSS and latency must not trend.

The demo claims cycled (unique ids), the extractive generator, the tiny models
(`D2R_SOAK_MODELS` points at another profile, e.g. models/offline-quick). RSS is
sampled from /proc every 0.5 s beside the count of records written; per-query
latency is each record's `total_s`. Asserted, all from this one run:
- nothing lost, nothing repeated: every id exactly once after the kill and resume;
- per process, the RSS trend after warm-up (its first thousand queries: models, arenas and
  caches fill there), fitted (Theil-Sen) over the queries it answered, within 10% of its RSS;
- the p50 latency of each thousand queries (the first excluded), its fitted trend across the
  whole run within 10% of the median. A fitted trend, not first-vs-last: windows of the same
  code differ by +-15% on this shared machine, a leak or a slow-down adds up steadily. Asserted
  from 10,000 queries up (a shorter run records it).
The curves go to `.benchmarks/soak.json` and, with the [report] extra, `.benchmarks/soak.png`.
`D2R_SOAK_QUERIES` (default 20000) scales it: 20k queries take ~50 min on 2 cores with the tiny
models (~150 ms per query: the random tiny BART decodes to its token limit for the KG check), so
CI runs 1,000 and docs/results.md has the 20k run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "d2r_edge" / "data" / "demo"
N = int(os.environ.get("D2R_SOAK_QUERIES", "20000"))
WINDOW = max(100, min(1000, N // 20))
OUT = Path(os.environ.get("D2R_BENCH_DIR", ROOT / ".benchmarks"))


def _rss_mib(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class _Lines:
    """Counts the newlines of a growing file incrementally (the file reaches ~100 MB)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.n = path, 0, 0

    def count(self) -> int:
        if self.path.is_file():
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
            self.offset += len(chunk)
            self.n += chunk.count(b"\n")
        return self.n


def _drive(cmd: list[str], out: Path, kill_at: int | None, samples: list, segment: int) -> None:
    lines = _Lines(out)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 4 * 3600
    while proc.poll() is None and time.time() < deadline:
        n, rss = lines.count(), _rss_mib(proc.pid)
        if rss is not None:
            samples.append({"segment": segment, "t_s": time.perf_counter() - t0, "records": n, "rss_mib": rss})
        if kill_at is not None and n >= kill_at:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
        pytest.fail("the soak run did not finish in 4 hours")
    err = proc.stderr.read()
    assert proc.returncode == 0, err[-3000:]


def _rss_after(samples: list[dict], segment: int, records: int) -> float:
    seg = [s for s in samples if s["segment"] == segment and s["records"] >= records]
    return seg[0]["rss_mib"]


@pytest.mark.slow
def test_soak_run_kill_resume(tmp_path):
    from benchmarks.bench_onnx import _export
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KnowledgeBase

    models = Path(os.environ["D2R_SOAK_MODELS"]) if os.environ.get("D2R_SOAK_MODELS") else _export("tiny")
    KnowledgeBase.build(DEMO / "docs.jsonl", tmp_path / "kb", Embedder(load_manifest(models),
                                                                        allow_random_weights=True))
    claims = [json.loads(line) for line in (DEMO / "claims.jsonl").read_text().splitlines() if line.strip()]
    queries = tmp_path / "queries.jsonl"
    with open(queries, "w", encoding="utf-8") as fh:
        for i in range(N):
            c = claims[i % len(claims)]
            fh.write(json.dumps({"id": f"q{i:06d}", "claim": c["claim"], "label": c.get("label")}) + "\n")
    out = tmp_path / "records.jsonl"
    cmd = [sys.executable, "-m", "d2r_edge.cli", "run", "--kb", str(tmp_path / "kb"), "--task", "fever",
           "--queries", str(queries), "--out", str(out), "--models", str(models), "--allow-random-weights"]
    samples: list[dict] = []
    _drive(cmd, out, N // 2, samples, 0)
    done_before = sum(1 for line in out.read_bytes().split(b"\n") if line.strip())
    _drive(cmd, out, None, samples, 1)

    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == N, (len(ids), len(set(ids)))      # nothing repeated, nothing lost
    assert not any(r.get("error") for r in records)
    latency = np.array([r["total_s"] for r in records])
    windows = [float(np.median(latency[i:i + WINDOW])) for i in range(WINDOW, N - WINDOW + 1, WINDOW)]
    # the fitted trend across the whole run, as a share of the median: robust to the minutes-long swings of
    # a shared machine (windows of the same code differ by +-15% here), not to a steady slow-down
    lat_trend = _theil_sen([i * WINDOW for i in range(len(windows))], windows) * N / float(np.median(latency))
    first_n = [s["records"] for s in samples if s["segment"] == 1][0]
    rss = {}
    for seg, start, end in ((0, WINDOW, done_before), (1, first_n + WINDOW, N)):
        pts = [s for s in samples if s["segment"] == seg and start <= s["records"] <= end]
        xs, ys = [s["records"] for s in pts], [s["rss_mib"] for s in pts]
        rss[seg] = {"after_warmup_mib": ys[0], "at_end_mib": ys[-1], "queries": end - start,
                    "trend": _theil_sen(xs, ys) * (end - start) / float(np.median(ys))}
    result = {"queries": N, "window": WINDOW, "killed_after_records": done_before,
              "p50_first_window_s": windows[0], "p50_last_window_s": windows[-1], "latency_trend": lat_trend,
              "rss": rss, "models": str(models), "wall_s": sum(_segment_wall(samples, k) for k in (0, 1)),
              "samples": samples, "latency_p50_per_window_s": windows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "soak.json").write_text(json.dumps(result, indent=1))
    _figure(result, latency, OUT / "soak.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "latency_p50_per_window_s")},
                     indent=1))
    if N >= 10_000:
        # on a short run (CI's 1,000 queries, ~3 min) minute-scale swings of a shared machine (+-15% per window
        # here) are as large as the bound: recorded in soak.json, asserted only on a long run
        assert abs(lat_trend) <= 0.10, f"latency trend {lat_trend:+.1%} over the run (windows {windows})"
    for seg, r in rss.items():
        assert r["trend"] <= 0.10, f"process {seg}: RSS trend {r['trend']:+.1%} over {r['queries']} queries"


def _theil_sen(xs, ys) -> float:
    """Median of the pairwise slopes: a line through noisy points that one outlier cannot tilt."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    i, j = np.triu_indices(len(xs), 1)
    ok = xs[j] != xs[i]
    return float(np.median((ys[j] - ys[i])[ok] / (xs[j] - xs[i])[ok])) if ok.any() else 0.0


def _segment_wall(samples: list[dict], seg: int) -> float:
    return max((s["t_s"] for s in samples if s["segment"] == seg), default=0.0)


def _figure(result: dict, latency: np.ndarray, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    for seg, style in ((0, "-"), (1, "--")):
        pts = [s for s in result["samples"] if s["segment"] == seg]
        a.plot([s["records"] for s in pts], [s["rss_mib"] for s in pts], style,
               label="first process (killed)" if seg == 0 else "resumed process")
    a.set_xlabel("records written")
    a.set_ylabel("RSS (MiB)")
    a.legend()
    w = result["window"]
    x = np.arange(0, len(latency), w)
    b.plot(x, [1000 * np.median(latency[i:i + w]) for i in x])
    b.set_xlabel("query")
    b.set_ylabel(f"p50 latency per {w} queries (ms)")
    fig.suptitle(f"d2r-edge run, {result['queries']} queries, killed after {result['killed_after_records']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
