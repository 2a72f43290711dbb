"""`d2r-edge serve` under load on loopback: requests/s, p50/p95 latency and the per-stage split at
concurrency 1, 4 and 16, for five server settings, FEVER claims, the extractive generator, k = 5.

Queries are distinct claims (FEVER dev, the KB their evidence documents, where ../shared/data is
here; else the demo claims, each asked once per load): the NLI pair cache must not answer a
repeated claim from memory and flatter the figures.

Settings: `serial` (the defaults: one request answered at a time, the NLI pair cache on, e_r's
pairs scored until the first entailment), `allpairs` (every (passage, response) pair scored),
`nocache` (every pair and no pair cache: the scoring before issue 24), `parallel` (4 requests at
once, no merging) and `batched` (4 at once, their NLI pairs merged into shared calls). Models:
models/offline when built, else models/offline-quick, else the tiny random-weight profile. Each
server is a separate process (`d2r-edge serve`), the clients are threads here. Bounded: REQUESTS
per load, one load per (setting, concurrency). Asserts ratios of this run only; writes
.benchmarks/serve.json and .md.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from benchmarks.conftest import EXTRA

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "d2r_edge" / "data" / "demo"
DATA = ROOT.parent / "shared" / "data"
REQUESTS = int(os.environ.get("D2R_SERVE_REQUESTS", "48"))
CONCURRENCY = (1, 4, 16)
SETTINGS = {
    "serial": [],
    "allpairs": ["--response-nli", "all"],
    "nocache": ["--nli-cache-pairs", "0", "--response-nli", "all"],
    "parallel": ["--parallel", "4"],
    "batched": ["--parallel", "4", "--micro-batch-pairs", "64", "--micro-batch-wait-ms", "2"],
}
OUT = Path(os.environ.get("D2R_BENCH_DIR", ".benchmarks"))
TABLE: dict[tuple[str, int], dict] = {}


def _models() -> tuple[Path, list[str], str]:
    for name in ("offline", "offline-quick"):
        if (ROOT / "models" / name / "manifest.json").is_file():
            return ROOT / "models" / name, [], name
    from benchmarks.bench_onnx import _export

    return _export("tiny"), ["--allow-random-weights"], "tiny (random weights)"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    models, extra, name = _models()
    tmp = tmp_path_factory.mktemp("serve")
    kb = tmp / "kb"
    if (DATA / "fever" / "dev.jsonl").is_file():
        from d2r_edge.eval.datasets import fever_evidence, write_docs

        n = len(CONCURRENCY) * (REQUESTS + 2)
        docs, queries = fever_evidence(DATA / "fever" / "dev.jsonl", limit=max(300, n))
        docs_path = write_docs(docs, tmp / "docs.jsonl")
        claims = [q.text for q in queries][:n]
        name += f"; KB: the evidence of {len(queries)} FEVER dev claims ({len(docs)} documents)"
    else:
        docs_path = DEMO / "docs.jsonl"
        claims = [json.loads(line)["claim"] for line in (DEMO / "claims.jsonl").read_text().splitlines()
                  if line.strip()]
        name += "; KB: the demo documents"
    subprocess.run([sys.executable, "-m", "d2r_edge.cli", "index", "build", "--kb", str(kb), "--docs",
                    str(docs_path), "--models", str(models), *extra], check=True, cwd=ROOT,
                   capture_output=True, timeout=600)
    return models, extra, name, kb, claims


class ServerProcess:
    def __init__(self, world, setting: str) -> None:
        models, extra, _, kb, _ = world
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "d2r_edge.cli", "serve", "--kb", str(kb), "--models", str(models),
                    "--task", "fever", "--port", str(self.port), "--max-concurrency", "64", *extra,
                    *SETTINGS[setting]]

    def __enter__(self) -> "ServerProcess":
        import tempfile

        self.log = tempfile.TemporaryFile()           # a pipe nobody reads would fill and stall the server
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(self.log.read().decode()[-2000:])
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _post(url: str, claim: str) -> tuple[float, dict]:
    body = json.dumps({"model": "d2r-edge", "messages": [{"role": "user", "content": claim}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    return time.perf_counter() - t0, out["d2r"]


def _load(url: str, claims: list[str], concurrency: int, offset: int) -> dict:
    """REQUESTS claims from `offset` on (each load its own claims: none repeats within a server)."""
    own = claims[offset:offset + REQUESTS + 2] if len(claims) >= offset + REQUESTS + 2 else claims
    for claim in own[:2]:
        _post(url, claim)                                       # warm (first-call allocations)
    asked = [own[2 + i % (len(own) - 2)] for i in range(REQUESTS)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda c: _post(url, c), asked))
    wall = time.perf_counter() - t0
    client = np.array([d[0] for d in done]) * 1000
    stages = {k: float(np.median([d[1]["latency_ms"][k] for d in done]))
              for k in ("embed", "retrieve", "generate", "diagnose", "repair", "overhead", "total")}
    # per request, d2r-edge's own time in units of the same request's generator time: the extractive
    # generator does the same work in every setting, so this ratio holds when the shared machine's speed
    # drifts between loads (one CI-sized run here saw the same work take 2x longer early than late)
    own_per_gen = float(np.median([d[1]["latency_ms"]["overhead"] / max(d[1]["latency_ms"]["generate"], 1e-3)
                                   for d in done]))
    busy = REQUESTS / wall * stages["total"] / 1000.0         # share of the wall time a request was in progress
    return {"requests": REQUESTS, "concurrency": concurrency, "req_per_s": REQUESTS / wall,
            "p50_ms": float(np.percentile(client, 50)), "p95_ms": float(np.percentile(client, 95)),
            "server_p50_ms": stages, "own_per_generate": own_per_gen, "busy": busy,
            "repaired": sum(d[1]["repaired"] for d in done)}


@pytest.mark.benchmark(group="serve")
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_serve_load(benchmark, world, setting):
    _, _, _, _, claims = world
    with ServerProcess(world, setting) as srv:
        def all_loads():
            for i, c in enumerate(CONCURRENCY):
                TABLE[(setting, c)] = _load(srv.url, claims, c, i * (REQUESTS + 2))
        benchmark.pedantic(all_loads, rounds=1, iterations=1)
    for c in CONCURRENCY:
        row = TABLE[(setting, c)]
        EXTRA[f"serve-{setting}-c{c}-req_per_s"] = row["req_per_s"]
        EXTRA[f"serve-{setting}-c{c}-p50_ms"] = row["p50_ms"]


def test_serve_targets(world):
    """Ratios of this run: the pair cache and the lazy e_r each cut d2r-edge's own time, queueing keeps
    throughput, the HTTP layer adds little; the table goes to .benchmarks/serve.{json,md}."""
    if len(TABLE) < len(SETTINGS) * len(CONCURRENCY):
        pytest.skip("needs every load of this run")
    _write_report(world[2])
    own = {s: TABLE[(s, 1)]["own_per_generate"] for s in ("serial", "allpairs", "nocache")}
    if "random weights" not in world[2]:
        # the cache saves the (passage, query) forwards the generator and e_q share. With the tiny
        # random-weight profile it gained 5-15% here and crossed this bound in 2 of 3 quiet runs
        # (1.05x, 1.12x, 0.88x): its NLI forwards are too cheap for a cut of them to stand out of
        # 24 requests' noise. CI measures it on offline-quick, copied in by the demo step before this one
        assert own["allpairs"] <= 0.9 * own["nocache"], f"the pair cache: {own}"
    assert own["serial"] <= 0.9 * own["allpairs"], f"scoring until the first entailment: {own}"
    serial = TABLE[("serial", 1)]
    for setting in SETTINGS:      # queueing keeps the server busy (req/s x time per request: drift cancels)
        keep = TABLE[(setting, 16)]["busy"] / TABLE[(setting, 1)]["busy"]
        assert keep >= 0.8, f"{setting}: at 16 clients the server is busy {keep:.2f}x as much as at one"
    http = serial["p50_ms"] / serial["server_p50_ms"]["total"]
    assert http <= 1.5, f"client p50 is {http:.2f}x the server's own p50"


def _write_report(models: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = [{"setting": s, **TABLE[(s, c)]} for s in SETTINGS for c in CONCURRENCY]
    (OUT / "serve.json").write_text(json.dumps({"models": models, "rows": rows}, indent=1))
    lines = [f"models: {models}; {REQUESTS} FEVER claims per load, extractive generator, k = 5, loopback",
             "", "| setting | clients | req/s | p50 ms | p95 ms | server p50: embed / retrieve / generate / "
             "diagnose / repair / overhead / total ms | own / generate |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        st = r["server_p50_ms"]
        split = " / ".join(f"{st[k]:.1f}" for k in ("embed", "retrieve", "generate", "diagnose", "repair",
                                                     "overhead", "total"))
        lines.append(f"| {r['setting']} | {r['concurrency']} | {r['req_per_s']:.1f} | {r['p50_ms']:.0f} | "
                     f"{r['p95_ms']:.0f} | {split} | {r['own_per_generate']:.2f} |")
    (OUT / "serve.md").write_text("\n".join(lines) + "\n")
