"""The loop's own overhead: everything but model calls, retrieval and the generator.

Per query, overhead = total time - the stage times of each attempt (query
embedding, refresh, retrieve, generate, diagnose). It covers the context vector, cost masking,
policy select/update, metering set-up and record assembly. The NLI is a
deterministic hash stand-in so failures, and so repairs, occur.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
STAGES = ("embed_query_s", "refresh_s", "retrieve_s", "generate_s", "diagnose_s")


class HashNLI:
    def __init__(self, labels):
        self.labels = labels

    def score(self, pairs):
        rows = [np.frombuffer(hashlib.sha256(f"{p}|{h}".encode()).digest()[:12], dtype=np.uint32) % 1000
                for p, h in pairs]
        logits = np.asarray(rows, dtype=np.float64).reshape(-1, 3) / 250.0
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    if not DATA.is_dir():
        pytest.skip("needs ../shared/data")
    from benchmarks.bench_onnx import _export
    from d2r_edge.app import RunSettings, build_pipeline
    from d2r_edge.eval.datasets import fever_evidence, write_docs
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KnowledgeBase
    from d2r_edge.tasks import Task

    models = _export("tiny")
    tmp = tmp_path_factory.mktemp("loop")
    docs, queries = fever_evidence(DATA / "fever" / "dev.jsonl", limit=300)
    KnowledgeBase.build(write_docs(docs, tmp / "d.jsonl"), tmp / "kb", Embedder(load_manifest(models)))
    p = build_pipeline(RunSettings(kb=tmp / "kb", models=models, task=Task.FEVER, allow_random_weights=True))
    p.diagnoser.nli = HashNLI(p.diagnoser.nli.labels)
    return p, [q.text for q in queries[:40]]


@pytest.mark.benchmark(group="loop")
def test_loop_overhead(benchmark, record, pipeline):
    p, queries = pipeline
    records = []

    def run_all():
        records.clear()
        records.extend(p.run(q, learn=True) for q in queries)

    benchmark.pedantic(run_all, rounds=3, iterations=1)
    total = sum(r["total_s"] for r in records)
    stages = 0.0
    for r in records:
        stages += sum(r["first"]["timings_s"].get(k, 0.0) for k in STAGES)
        if r["repair"]:
            stages += sum(r["final"]["timings_s"].get(k, 0.0) for k in STAGES)
    share = (total - stages) / total
    repaired = sum(1 for r in records if r["repair"])
    record("loop-40-queries", **{"loop-overhead-share": share, "loop-repaired-queries": repaired})
    assert repaired > 0
    assert share <= 0.05, f"loop overhead is {share:.1%} of per-query time"
