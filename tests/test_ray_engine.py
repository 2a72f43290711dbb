"""`--engine ray` on a local Ray instance (2 CPUs): same records as a local run, nothing lost or
duplicated when a worker or the driver dies, one clear error when a worker cannot see the files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from stand_ins import hash_nli_scores

ray = pytest.importorskip("ray")

from d2r_edge.app import RunSettings, build_pipeline, train  # noqa: E402
from d2r_edge.cli import main  # noqa: E402
from d2r_edge.engine import RayConfig  # noqa: E402
from d2r_edge.engine.ray_run import run_queries  # noqa: E402
from d2r_edge.errors import InputError  # noqa: E402
from d2r_edge.runner import load_queries, process, summary  # noqa: E402
from d2r_edge.tasks import Task  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "d2r_edge" / "data" / "demo"
D2R = [sys.executable, "-m", "d2r_edge.cli"]
# what a run decides; timings (total_s, latency_s, stage times) differ between any two runs
DECISIONS = ("first_answer", "final_answer", "failure", "first_correct", "final_correct", "error")


def decisions(records: list[dict]) -> dict[str, tuple]:
    out = {}
    for r in records:
        rep = r.get("repair") or {}
        out[r["id"]] = (tuple(r.get(k) for k in DECISIONS), rep.get("arm"), rep.get("allowed"),
                        r["first"]["passages"], r["first"]["gated_label"], r["final"]["passages"],
                        r["final"]["failure"], r["final"]["gated_label"])
    return out


@pytest.fixture(scope="module")
def local_ray():
    if not ray.is_initialized():     # workers import the test stand-ins from tests/
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT / "tests")}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_models):
    """The demo KB on the tiny models, policies trained locally (LinUCB and Thompson), many queries."""
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KnowledgeBase

    tmp = tmp_path_factory.mktemp("ray")
    kb = tmp / "kb"
    KnowledgeBase.build(DEMO / "docs.jsonl", kb, Embedder(load_manifest(tiny_models)))
    claims = tmp / "claims.jsonl"
    rows = [json.loads(line) for line in (DEMO / "claims.jsonl").read_text().splitlines() if line.strip()]
    with open(claims, "w") as fh:          # 3 copies under new ids: enough queries for batches to interleave
        for copy in range(3):
            for row in rows:
                fh.write(json.dumps({**row, "id": f"{row['id']}-{copy}"}) + "\n")
    base = RunSettings(kb=kb, models=tiny_models, task=Task.FEVER, allow_random_weights=True)
    policies = {}
    for kind in ("linucb", "thompson"):
        s = replace(base, policy_path=tmp / f"{kind}.npz", policy_kind=kind, create_policy=True)
        train(_hash_pipeline(s), load_queries(claims)[:16], tmp / f"train-{kind}.jsonl", s.policy_path, epochs=1)
        policies[kind] = s
    return tmp, claims, policies


def _hash_pipeline(s):
    """The random tiny NLI rarely disagrees with itself: the hash stand-in makes failures, so repairs."""
    p = build_pipeline(s)
    p.diagnoser.nli.score = lambda pairs: hash_nli_scores(pairs)
    return p


HASH = "stand_ins:install_hash_nli"        # the same stand-in inside every Ray worker


@pytest.mark.parametrize("kind", ["linucb", "thompson"])
def test_ray_run_gives_the_records_of_a_local_run(local_ray, demo, tmp_path, kind):
    _, claims, policies = demo
    s = policies[kind]
    queries = load_queries(claims)
    local = process(_hash_pipeline(s), queries, tmp_path / "local.jsonl", learn=False).records
    remote = run_queries(s, queries, tmp_path / "ray.jsonl",
                         RayConfig(workers=2, batch_queries=5, worker_setup=HASH)).records
    assert len(remote) == len(local) == 48
    assert decisions(remote) == decisions(local)
    assert any(r["repair"] for r in local), "no repair happened: the policy was not exercised"
    # the file holds the records in completion order; the summary reads them in id order, so
    # everything but the measured latencies reads the same
    def untimed(text):
        return [line for line in text.splitlines() if "latency" not in line]

    assert untimed(summary(remote)) == untimed(summary(local))


def test_a_killed_worker_loses_and_duplicates_nothing(local_ray, demo, tmp_path):
    _, claims, policies = demo
    queries = load_queries(claims)
    killed = []

    def kill_the_other_worker(pool, batch):
        if not killed:
            victim = pool.actors[1]
            ray.kill(victim)                # its batch in flight (or its next one) is lost with it
            killed.append(victim)

    out = tmp_path / "ray.jsonl"
    rlog = run_queries(policies["linucb"], queries, out, RayConfig(workers=2, batch_queries=3),
                       on_batch=kill_the_other_worker)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(q.id for q in queries) and len(ids) == len(set(ids)) == 48
    assert killed and len(rlog.records) == 48


def test_kill_9_of_the_driver_then_rerun(demo, tmp_path):
    tmp, claims, policies = demo
    s = policies["linucb"]
    out = tmp_path / "ray.jsonl"
    args = D2R + ["run", "--engine", "ray", "--workers", "2", "--batch-queries", "1", "--kb", str(s.kb),
                  "--models", str(s.models), "--allow-random-weights", "--task", "fever", "--queries", str(claims),
                  "--policy", str(s.policy_path), "--out", str(out)]
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and (not out.is_file() or out.read_text().count("\n") < 4):
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read().decode()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)     # the driver and everything in its session, mid-run
    proc.wait()
    before = out.read_text().count("\n")
    assert 4 <= before < 48
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(json.loads(line)["id"] for line in claims.read_text().splitlines())
    assert len(ids) == len(set(ids)) == 48


def test_a_worker_that_cannot_see_the_kb_fails_with_one_clear_message(local_ray, demo, tmp_path):
    _, claims, policies = demo
    s = replace(policies["linucb"], kb=tmp_path / "not-mounted" / "kb")
    with pytest.raises(InputError, match=r"node \S+ cannot read the KB manifest at .*not-mounted.*missing.*"
                                         r"shared filesystem"):
        run_queries(s, load_queries(claims)[:4], tmp_path / "out.jsonl", RayConfig(workers=2))
    assert not (tmp_path / "out.jsonl").read_text()


def test_what_parallel_workers_cannot_share_is_refused(demo, tmp_path, capsys):
    tmp, claims, policies = demo
    s = policies["linucb"]
    common = ["--kb", str(s.kb), "--models", str(s.models), "--allow-random-weights", "--task", "fever",
              "--queries", str(claims), "--out", str(tmp_path / "o.jsonl"), "--engine", "ray"]
    assert main(["train", *common, "--policy", str(tmp_path / "p.npz")]) == InputError.exit_code
    assert "learns online (Alg. 2)" in capsys.readouterr().err
    assert main(["run", *common, "--refresh-pool", str(DEMO / "docs.jsonl")]) == InputError.exit_code
    assert "--refresh-pool" in capsys.readouterr().err
    refresh = ["index", "refresh", "--kb", str(s.kb), "--models", str(s.models), "--engine", "ray"]
    assert main(refresh) == InputError.exit_code
    assert "index build only" in capsys.readouterr().err
    with pytest.raises(InputError, match="queued documents.*index refresh"):
        kb = tmp_path / "kb"
        import shutil

        shutil.copytree(s.kb, kb)
        (kb / "queue.jsonl").write_text('{"id": "new", "title": "T", "text": "x"}\n')
        run_queries(replace(s, kb=kb), load_queries(claims)[:2], tmp_path / "q.jsonl", RayConfig())


def test_index_build_on_ray_writes_the_local_kb(local_ray, tiny_models, tmp_path):
    """Several shards (shard_chunks=4) embedded by 2 Ray Data actors: every file as in a local build."""
    from d2r_edge.engine.ray_index import ray_shard_embedding
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KBConfig, KnowledgeBase

    emb = Embedder(load_manifest(tiny_models))
    cfg = KBConfig(shard_chunks=4)
    local = KnowledgeBase.build(DEMO / "docs.jsonl", tmp_path / "local", emb, cfg)
    embed = ray_shard_embedding(emb, tiny_models, "int8", False, RayConfig(workers=2))
    remote = KnowledgeBase.build(DEMO / "docs.jsonl", tmp_path / "ray", emb, cfg, embed_shards=embed)
    assert len(local.chunks) > 8       # more than two shards
    files = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "ray").iterdir())
    for name in files:
        a, b = (tmp_path / "local" / name).read_bytes(), (tmp_path / "ray" / name).read_bytes()
        if name == "manifest.json":
            a, b = (json.loads(x) for x in (a, b))
            for m in (a, b):
                m.pop("created_unix_s"), m.pop("updated_unix_s")
        assert a == b, name
    assert remote.stats() == local.stats()


def test_index_build_on_ray_names_the_node_that_lacks_the_models(local_ray, tiny_models, tmp_path):
    from d2r_edge.engine.ray_index import ray_shard_embedding
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KnowledgeBase

    emb = Embedder(load_manifest(tiny_models))
    embed = ray_shard_embedding(emb, tmp_path / "elsewhere", "int8", False, RayConfig(workers=1))
    with pytest.raises(InputError, match=r"node \S+ cannot read the models manifest"):
        KnowledgeBase.build(DEMO / "docs.jsonl", tmp_path / "kb", emb, embed_shards=embed)
