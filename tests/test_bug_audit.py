"""Issue 27: eight ways a run could give wrong or lost results silently; one regression test each
(item 5, the append-only refresh, is in test_retrieval.py)."""

from __future__ import annotations

import http.server
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from stand_ins import HashNLI, fever_world

from d2r_edge.errors import InputError, PolicyFileError
from d2r_edge.repair import ARM_NAMES
from d2r_edge.tasks import Task


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_models, shared_data):
    kb, queries = fever_world(tmp_path_factory.mktemp("audit"), tiny_models, shared_data, n_docs=120, n_queries=16)
    return {"kb": kb, "queries": queries, "models": tiny_models}


def _settings(world, **kw):
    from d2r_edge.app import RunSettings

    kw.setdefault("policy_kind", "linucb")        # these audit LinUCB's files (FEVER's default is the fixed arm)
    return RunSettings(kb=world["kb"], models=world["models"], task=Task.FEVER, allow_random_weights=True, **kw)


def _pipeline(world, hash_nli: bool = True, **kw):
    from d2r_edge.app import build_pipeline

    p = build_pipeline(_settings(world, **kw))
    if hash_nli:
        p.diagnoser.nli = HashNLI(p.diagnoser.nli)
    return p


# --- 1. a policy file says how its context was built -----------------------------------------

def test_policy_refuses_contexts_built_another_way_and_run_needs_an_existing_file(world, tmp_path):
    from d2r_edge.app import train
    from d2r_edge.cli import main
    from d2r_edge.policy import LinUCB
    from d2r_edge.runner import load_queries

    policy = tmp_path / "p.npz"
    p = _pipeline(world, policy_path=policy, create_policy=True)
    train(p, load_queries(world["queries"])[:6], tmp_path / "t.jsonl", policy, epochs=1)
    spec = LinUCB.load(policy).context
    assert spec["projection_seed"] == 0 and spec["query_dim"] == 128 and spec["embedder"].startswith("weights:")
    _pipeline(world, policy_path=policy)                           # the same settings load
    with pytest.raises(PolicyFileError, match=r"projection_seed: trained with 0, this run 1.*--seed"):
        _pipeline(world, policy_path=policy, seed=1)
    other = LinUCB.load(policy)
    other.context = {**spec, "embedder": "weights:another-model"}
    other.save(tmp_path / "other.npz")
    with pytest.raises(PolicyFileError, match="embedder"):
        _pipeline(world, policy_path=tmp_path / "other.npz")
    # `run --policy` naming no file is an error, not a silently untrained policy
    with pytest.raises(PolicyFileError, match="no policy file"):
        _pipeline(world, policy_path=tmp_path / "typo.npz")
    rc = main(["run", "--kb", str(world["kb"]), "--models", str(world["models"]), "--allow-random-weights",
               "--task", "fever", "--queries", str(world["queries"]), "--out", str(tmp_path / "r.jsonl"),
               "--policy", str(tmp_path / "typo.npz")])
    assert rc == PolicyFileError.exit_code and not (tmp_path / "r.jsonl").exists()


# --- 2. a failing repair keeps the first answer; transient errors are retried ---------------

class _FlakyGenerator:
    """Answers first attempts; fails every call whose passages differ from the first (a repair)."""

    prompt_sensitive = True

    def __init__(self, inner, fail_all: bool = False):
        self.inner, self.fail_all, self.first = inner, fail_all, {}

    def generate(self, task, style, query, passages, sample=True):
        from d2r_edge.generate.openai_compat import GeneratorError

        seen = self.first.setdefault(query, (style, tuple(passages)))
        if self.fail_all or seen != (style, tuple(passages)):
            raise GeneratorError("generator at http://127.0.0.1:9/v1 failed after 4 attempt(s): HTTP 503")
        return self.inner.generate(task, style, query, passages)


def test_a_failing_repair_keeps_the_first_answer(world, tmp_path):
    from d2r_edge.runner import load_queries, process

    p = _pipeline(world)
    p.generator = _FlakyGenerator(p.generator)
    recs = process(p, load_queries(world["queries"]), tmp_path / "r.jsonl", learn=False).records
    failed = [r for r in recs if r.get("repair_error")]
    assert failed, "the stand-in NLI makes failures, so repairs were tried"
    for r in failed:
        assert r["error"] is None and r["repair"] is None
        assert r["final_answer"] == r["first_answer"] and r["final"] == r["first"]
        assert "GeneratorError" in r["repair_error"] and r["final_correct"] is not None


def test_error_records_are_retried_on_rerun(world, tmp_path):
    from d2r_edge.runner import load_queries, process

    queries, out = load_queries(world["queries"])[:5], tmp_path / "r.jsonl"
    p = _pipeline(world)
    real = p.generator
    p.generator = _FlakyGenerator(real, fail_all=True)
    assert all(r["error"] for r in process(p, queries, out, learn=False).records)
    p.generator = real
    recs = process(p, queries, out, learn=False).records
    on_disk = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in on_disk] == [q.id for q in queries] == [r["id"] for r in recs]
    assert all(r["error"] is None for r in on_disk)


def test_onnx_runtime_and_http_protocol_errors_become_d2r_errors(tiny_models):
    from d2r_edge.errors import D2RError, InferenceError
    from d2r_edge.generate.openai_compat import GeneratorError, OpenAICompatible
    from d2r_edge.onnx.encoders import NLI
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.onnx.session import run

    nli = NLI(load_manifest(tiny_models), allow_random_weights=True)
    bad = {name: np.zeros((1, 4), dtype=np.float32) for name in nli.input_names}     # float ids: ORT refuses
    with pytest.raises(InferenceError, match="ONNX Runtime failed running") as exc:
        run(nli.session, nli.output_names[:1], bad)
    assert isinstance(exc.value, D2RError)

    class Short(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "1000")          # then close early: IncompleteRead
            self.end_headers()
            self.wfile.write(b'{"choices": [')

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Short)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = OpenAICompatible(f"http://127.0.0.1:{srv.server_port}/v1", "m", max_retries=1, backoff_s=0.01)
        with pytest.raises(GeneratorError, match="connection broke .RemoteProtocolError"):
            client.complete([{"role": "user", "content": "hi"}])
    finally:
        srv.shutdown()


# --- 3. eval answers never decodes stored attempts against another KB -----------------------

def test_eval_refuses_stored_attempts_when_the_kb_inputs_change(tmp_path):
    from d2r_edge.app import RunSettings
    from d2r_edge.eval.answers import EvalSettings, _check_out, kb_documents, load_splits
    from d2r_edge.eval.split import Split
    from d2r_edge.retrieval.kb import KnowledgeBase

    f = tmp_path / "claims.jsonl"

    def write(sentence: str) -> None:
        with open(f, "w") as fh:
            for i in range(6):
                fh.write(json.dumps({"id": str(i), "claim": f"Claim {i}.", "label": "SUPPORTS",
                                     "derived_evidence_sentences": [[f"Page_{i}", 0, f"{sentence} {i}."]]}) + "\n")

    s = EvalSettings(task=Task.FEVER, train=(f,), test=(f,), models=tmp_path, out=tmp_path / "o", train_limit=2,
                     split=Split.ALL, run=RunSettings(kb=tmp_path, models=tmp_path, task=Task.FEVER))

    def digest() -> str:
        return KnowledgeBase.input_digest(kb_documents(s, [x for sets in load_splits(s) for x in sets]))

    write("Evidence for claim")
    first = digest()
    _check_out(s, first)
    _check_out(s, first)                                   # same files, same contents: resumes
    write("Other evidence for claim")                      # the same path, edited in place
    assert digest() != first
    with pytest.raises(InputError, match="computed on other documents"):
        _check_out(s, digest())


# --- 4. JSON mode: dropped only when the server rejects response_format ---------------------

def test_json_mode_survives_an_unrelated_400_and_is_part_of_the_cache_key(tmp_path):
    from stand_ins import ScriptedServer

    from d2r_edge.eval.outcomes import CachedGenerator
    from d2r_edge.generate.openai_compat import GeneratorError, OpenAICompatible
    from d2r_edge.repair import PromptStyle

    ok = json.dumps({"choices": [{"message": {"content": '{"answer": "Paris"}'}}]})
    with ScriptedServer() as srv:
        replies, seen = srv.replies, srv.seen
        client = OpenAICompatible(srv.url, "m", max_retries=0)
        replies.append((400, '{"error": "the request exceeds the available context size"}'))
        with pytest.raises(GeneratorError, match="HTTP 400 Bad Request"):    # the body goes to the log only
            client.complete([{"role": "user", "content": "x" * 100}])
        assert client.json_mode is True                      # one long prompt changes nothing after it
        replies.append((200, ok))
        client.complete([{"role": "user", "content": "hi"}])
        assert "response_format" in seen[-1]
        cache = CachedGenerator(client, tmp_path / "g.jsonl")
        with_json = cache.key(Task.QA, PromptStyle.SIMPLE, "q", ["p"])
        replies += [(400, '{"error": "response_format is not supported"}'), (200, ok)]
        client.complete([{"role": "user", "content": "hi"}])
        assert client.json_mode is False and "response_format" not in seen[-1]
        assert cache.key(Task.QA, PromptStyle.SIMPLE, "q", ["p"]) != with_json


# --- 5. (test_retrieval.py) and the record names the KB version that answered --------------

def test_records_name_the_kb_version(world, tmp_path):
    from d2r_edge.runner import load_queries, process

    rec = process(_pipeline(world), load_queries(world["queries"])[:2], tmp_path / "r.jsonl", learn=False).records[0]
    assert rec["kb_version"] == 1 and rec["kb_docs_added_in_memory"] == 0


# --- 6. training saves the policy every N updates, not after each -------------------------

def test_training_saves_every_n_updates_and_replays_the_rest(world, tmp_path, monkeypatch):
    import d2r_edge.app as app
    from d2r_edge.policy import LinUCB
    from d2r_edge.runner import load_queries

    saves = []
    real = app.save_policy
    monkeypatch.setattr(app, "save_policy", lambda p, path: saves.append(1) or real(p, path))
    policy = tmp_path / "p.npz"
    p = _pipeline(world, policy_path=policy, create_policy=True)
    records = app.train(p, load_queries(world["queries"]), tmp_path / "t.jsonl", policy, epochs=2,
                        save_every_updates=3)
    updates = sum(1 for r in records if r.get("repair"))
    assert updates >= 6 and len(saves) <= updates // 3 + 2 < updates   # was: one save per update
    assert int(LinUCB.load(policy).counts.sum()) == updates
    # a crash after the last save: the log's updates beyond it are replayed on the next start
    stale = LinUCB(len(ARM_NAMES), p.context.dim, 2.0, arm_names=ARM_NAMES)
    stale.context = p.context.spec
    stale.save(policy)
    p2 = _pipeline(world, policy_path=policy, create_policy=True)
    app.train(p2, load_queries(world["queries"]), tmp_path / "t.jsonl", policy, epochs=2)
    assert int(LinUCB.load(policy).counts.sum()) == updates


# --- 7. doctor diagnose never truncates finished work ----------------------------------------

def test_doctor_diagnose_keeps_finished_records_when_killed(tmp_path, monkeypatch):
    from test_doctor import WordNLI, _traj, _write

    from d2r_edge.doctor.commands import DiagnoseRequest, run_diagnose

    rows = [_traj("Which band released Abbey Road?", "The Beatles", x,
                  [("search", "Abbey Road"), ("evidence", "Abbey Road is an album by the Beatles."), ("answer", x)])
            for x in ("Queen", "the Beatles band", "Blur", "Oasis")]
    src, out = _write(tmp_path, rows), tmp_path / "d.jsonl"
    run_diagnose(DiagnoseRequest(src, out), WordNLI())
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[1:]) + "\n")              # the first trajectory's record is missing

    from d2r_edge.doctor.diagnose import TrajectoryDiagnoser

    with monkeypatch.context() as m:                         # the process dies on the first new diagnosis
        m.setattr(TrajectoryDiagnoser, "diagnose", lambda self, t: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            run_diagnose(DiagnoseRequest(src, out), WordNLI())
    assert out.read_text().splitlines() == lines[1:]         # was: truncated to nothing by open("w")
    run_diagnose(DiagnoseRequest(src, out), WordNLI())
    assert [json.loads(x)["line"] for x in out.read_text().splitlines()] == [1, 2, 3, 4]   # input order


# --- 8. the same queries from 8 threads give the sequential results -------------------------

def test_eight_threads_give_the_sequential_records(world, tmp_path):
    from d2r_edge.policy import LinUCB
    from d2r_edge.runner import Query, load_queries

    p = _pipeline(world, hash_nli=False)            # the real tiny encoders: tokenizers, ONNX, numba, HNSW
    rng = np.random.default_rng(1)
    pol = LinUCB(len(ARM_NAMES), p.context.dim, 0.5, arm_names=ARM_NAMES)
    for _ in range(60):
        pol.update(int(rng.integers(len(ARM_NAMES))), rng.normal(size=p.context.dim), float(rng.random()))
    p.policy = pol
    long_tail = " and also " + " ".join(["word"] * 300)         # pairs past max length: truncation matters
    queries = [Query(q.id, q.text + (long_tail if i % 2 else "")) for i, q in enumerate(load_queries(world["queries"]))]
    keep = ("first_answer", "final_answer", "failure")

    def one(q):
        rec = p.run(q.text, learn=False)
        return {**{k: rec[k] for k in keep}, "passages": rec["first"]["passages"], "nli": rec["first"]["nli_q"],
                "arm": rec["repair"] and rec["repair"]["arm"]}

    sequential = [one(q) for q in queries]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            assert list(pool.map(one, queries)) == sequential


def test_linucb_select_from_threads_matches_sequential():
    from d2r_edge.policy import LinUCB

    rng = np.random.default_rng(0)
    pol = LinUCB(12, 40, 1.0)
    for _ in range(200):
        pol.update(int(rng.integers(12)), rng.normal(size=40), float(rng.random()))
    xs = rng.normal(size=(5000, 40))      # the shared-scratch race hit ~1 select in 1,000 here
    want = [pol.select(x) for x in xs]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(pol.select, xs))
    assert sum(a != b for a, b in zip(got, want)) == 0


# --- also seen -------------------------------------------------------------------------------

def test_memory_is_metered_on_the_host_when_sessions_run_on_the_cpu(world, monkeypatch):
    from d2r_edge.budget import MemoryKind, MemoryProbe

    tried = []
    monkeypatch.setattr(MemoryProbe, "_try_nvml", lambda self, *a: tried.append(1))
    p = _pipeline(world)
    assert not tried and p.meter.probe.kind is MemoryKind.HOST


def test_model_hashes_are_cached_by_size_and_mtime(tmp_path, monkeypatch):
    import os

    import d2r_edge.onnx.manifest as manifest

    f = tmp_path / "role" / "model.onnx"
    f.parent.mkdir()
    f.write_bytes(b"weights")
    calls = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p: calls.append(p) or real(p))
    monkeypatch.setattr(manifest, "_verified", {})
    first = manifest.verified_sha256(f, tmp_path)
    assert manifest.verified_sha256(f, tmp_path) == first and len(calls) == 1
    manifest._verified.clear()                                     # another process: the file cache answers
    assert manifest.verified_sha256(f, tmp_path) == first and len(calls) == 1
    f.write_bytes(b"WEIGHTS")                                      # same size, changed: hashed again
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert manifest.verified_sha256(f, tmp_path) != first and len(calls) == 2


def test_the_remaining_memory_feature_reads_the_first_pass(world):
    from d2r_edge.budget import Measurement, MemoryKind, MemorySource

    p = _pipeline(world)

    class Growing:
        probe = p.meter.probe

        def measure(self):
            class M:
                def __enter__(s):
                    return s

                def __exit__(s, *exc):
                    s.result = Measurement(0.01, 4.5, MemoryKind.HOST, MemorySource.HOST_RSS, 1)
            return M()

    p.meter = Growing()
    xs = []
    real = p.context.build
    p.context.build = lambda *a, **kw: xs.append(real(*a, **kw)) or xs[-1]
    from d2r_edge.runner import load_queries

    for q in load_queries(world["queries"]):
        p.run(q.text, learn=False)
    assert xs and all(abs(x[-2] - (6 - 4.5) / 6) < 1e-9 for x in xs)   # budget 6 MiB, 4.5 used
