"""Soak: `d2r-edge run` over 20,000 queries, killed half-way and resumed; RSS and latency must not trend.

The demo claims cycled (unique ids), the extractive generator, the tiny models
(`D2R_SOAK_MODELS` points at another profile, e.g. models/offline-quick). RSS is
sampled from /proc every 0.5 s beside the count of records written; per-query
latency is each record's `total_s`. Asserted, all from this one run:
- nothing lost, nothing repeated: every id exactly once after the kill and resume;
- per process, RSS after the last thousand queries within 10% of RSS after its first
  thousand (warm-up excluded: models, arenas, caches fill in the first queries);
- p50 latency of the last thousand queries within 10% of the p50 of queries 1,000-2,000.
The curves go to `.benchmarks/soak.json` and, with the [report] extra, `.benchmarks/soak.png`.
`D2R_SOAK_QUERIES` (default 20000) scales it.
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
    p50_early = float(np.median(latency[WINDOW:2 * WINDOW]))
    p50_late = float(np.median(latency[-WINDOW:]))
    # each process: RSS once its first WINDOW queries are done vs at its end
    first_n = [s["records"] for s in samples if s["segment"] == 1][0]
    rss = {0: (_rss_after(samples, 0, WINDOW), max(s["rss_mib"] for s in samples if s["segment"] == 0
                                                   and s["records"] >= done_before - WINDOW)),
           1: (_rss_after(samples, 1, first_n + WINDOW), [s["rss_mib"] for s in samples if s["segment"] == 1][-1])}
    seg1 = [s for s in samples if s["segment"] == 1 and s["records"] >= first_n + WINDOW]
    slope = (float(np.polyfit([s["records"] for s in seg1], [s["rss_mib"] for s in seg1], 1)[0]) * 1000
             if len(seg1) > 2 else float("nan"))
    result = {"queries": N, "window": WINDOW, "killed_after_records": done_before, "p50_early_s": p50_early,
              "p50_late_s": p50_late, "p50_drift": p50_late / p50_early - 1,
              "rss_mib": {str(k): {"after_warmup": a, "at_end": b, "growth": b / a - 1} for k, (a, b) in rss.items()},
              "rss_slope_mib_per_1000_queries_resumed": slope, "models": str(models),
              "wall_s": samples[-1]["t_s"] if samples else None, "samples": samples,
              "latency_s_per_1000": [float(np.median(latency[i:i + 1000])) for i in range(0, N, 1000)]}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "soak.json").write_text(json.dumps(result, indent=1))
    _figure(result, latency, OUT / "soak.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "latency_s_per_1000")}, indent=1))
    assert abs(p50_late / p50_early - 1) <= 0.10, (p50_early, p50_late)
    for k, (a, b) in rss.items():
        assert b <= a * 1.10, f"process {k}: RSS {a:.0f} MiB after warm-up, {b:.0f} MiB at its end"


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
    x = np.arange(0, len(latency), 500)
    b.plot(x, [1000 * np.median(latency[i:i + 500]) for i in x])
    b.set_xlabel("query")
    b.set_ylabel("p50 latency per 500 queries (ms)")
    fig.suptitle(f"d2r-edge run, {result['queries']} queries, killed after {result['killed_after_records']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
