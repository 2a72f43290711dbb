"""`d2r-edge run` local vs `--engine ray` with 1 and 2 workers, side by side in one run.

Same demo KB, same queries (the demo claims, repeated under new ids), same
models: models/offline-quick when the demo has built it, else the tiny profile.
Each configuration is timed end to end and split into a fixed start-up
(local: building the pipeline; Ray: `ray.init` once, then the actors loading the
models) and a steady per-query part. The cross-over is the query count above
which a Ray run's total time beats a local run's:
  N* = (startup_ray - startup_local) / (1/qps_local - 1/qps_ray), when qps_ray > qps_local.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks.conftest import EXTRA

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "d2r_edge" / "data" / "demo"
N_COPIES = 6          # 16 demo claims x 6 = 96 queries
TIMES: dict[str, dict[str, float]] = {}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from d2r_edge.app import RunSettings
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KnowledgeBase
    from d2r_edge.runner import load_queries
    from d2r_edge.tasks import Task

    quick = ROOT / "models" / "offline-quick"
    if (quick / "manifest.json").is_file():
        models, allow = quick, False
    else:
        from benchmarks.bench_onnx import _export

        models, allow = _export("tiny"), True
    tmp = tmp_path_factory.mktemp("ray-bench")
    KnowledgeBase.build(DEMO / "docs.jsonl", tmp / "kb", Embedder(load_manifest(models)))
    rows = [json.loads(line) for line in (DEMO / "claims.jsonl").read_text().splitlines() if line.strip()]
    with open(tmp / "q.jsonl", "w") as fh:
        for copy in range(N_COPIES):
            for row in rows:
                fh.write(json.dumps({**row, "id": f"{row['id']}-{copy}"}) + "\n")
    EXTRA["ray-bench-models"] = str(models.name)
    # a 16-pair NLI cache: each query's generator and diagnosis still share its pairs, but a repeated copy of
    # a claim (16 queries later) is scored again, as distinct claims would be
    settings = RunSettings(kb=tmp / "kb", models=models, task=Task.FEVER, allow_random_weights=allow,
                           nli_cache_pairs=16)
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    TIMES["ray_init"] = {"startup_s": time.perf_counter() - t0}
    yield tmp, settings, load_queries(tmp / "q.jsonl")
    ray.shutdown()


def _local(settings, queries, out):
    from d2r_edge.app import build_pipeline
    from d2r_edge.runner import process

    t0 = time.perf_counter()
    pipeline = build_pipeline(settings)
    startup = time.perf_counter() - t0
    process(pipeline, queries, out, learn=False)
    return startup, time.perf_counter() - t0


def _ray(settings, queries, out, workers):
    from d2r_edge.engine import RayConfig
    from d2r_edge.engine.ray_run import run_queries

    seen = {}
    t0 = time.perf_counter()
    run_queries(settings, queries, out, RayConfig(workers=workers, batch_queries=4),
                on_batch=lambda pool, b: seen.setdefault("startup_s", pool.startup_s))
    return seen["startup_s"], time.perf_counter() - t0


@pytest.mark.benchmark(group="engine")
@pytest.mark.parametrize("engine", ["local", "ray-1", "ray-2"])
def test_engine_throughput(benchmark, record, world, engine):
    tmp, settings, queries = world
    runs = iter(range(100))

    def once():
        out = tmp / f"{engine}-{next(runs)}.jsonl"
        if engine == "local":
            return _local(settings, queries, out)
        return _ray(settings, queries, out, int(engine.split("-")[1]))

    startup, total = benchmark.pedantic(once, rounds=1, iterations=1)
    qps = len(queries) / (total - startup)
    TIMES[engine] = {"startup_s": startup, "total_s": total, "qps": qps}
    record(f"engine-{engine}-{len(queries)}-queries", **{f"engine-{engine}-qps": qps,
                                                         f"engine-{engine}-startup-s": startup})


def test_engine_report():
    if not all(k in TIMES for k in ("local", "ray-1", "ray-2")):
        pytest.skip("needs the three engine runs in this session")
    local, one, two = TIMES["local"], TIMES["ray-1"], TIMES["ray-2"]
    init = TIMES["ray_init"]["startup_s"]
    EXTRA["engine-ray-init-s"] = init
    EXTRA["engine-speedup-ray2-vs-local"] = two["qps"] / local["qps"]
    EXTRA["engine-speedup-ray2-vs-ray1"] = two["qps"] / one["qps"]
    fixed_ray = init + two["startup_s"]
    if two["qps"] > local["qps"]:
        EXTRA["engine-crossover-queries"] = (fixed_ray - local["startup_s"]) / (1 / local["qps"] - 1 / two["qps"])
    # 2 actors of 1 CPU each must run in parallel: a pool that serialized its batches would not scale
    assert two["qps"] >= 1.3 * one["qps"], TIMES
