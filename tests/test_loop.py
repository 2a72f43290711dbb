"""The D2R loop end to end on the tiny models: records, resume, train, generator failures, crashes."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from stand_ins import HashNLI  # (subprocess scripts below import it from here)

from d2r_edge.app import RunSettings, build_pipeline, train
from d2r_edge.eval.datasets import fever_evidence, paragraphs, write_docs
from d2r_edge.retrieval.kb import KnowledgeBase
from d2r_edge.runner import load_queries, process, summary
from d2r_edge.tasks import Task

ROOT = Path(__file__).resolve().parent.parent

REQUIRED = {"id", "query", "task", "first", "failure", "repair", "final", "first_answer",
            "final_answer", "first_correct", "final_correct", "total_s", "error"}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_models, shared_data):
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest

    tmp = tmp_path_factory.mktemp("loop")
    docs, _ = fever_evidence(shared_data / "fever" / "dev.jsonl", limit=200)
    hdocs, _ = paragraphs(shared_data / "hotpotqa" / "dev.jsonl", limit=20)
    kb_dir = tmp / "kb"
    KnowledgeBase.build(write_docs(docs + hdocs, tmp / "docs.jsonl"), kb_dir,
                        Embedder(load_manifest(tiny_models)))
    queries = tmp / "q.jsonl"
    with open(queries, "w") as fh:
        for line in list(open(shared_data / "fever" / "dev.jsonl"))[:50]:
            row = json.loads(line)
            fh.write(json.dumps({"id": row["id"], "claim": row["question"], "label": row["label"]}) + "\n")
    return tmp, kb_dir, queries


def _pipeline(world, tiny_models, **kw):
    tmp, kb_dir, _ = world
    s = RunSettings(kb=kb_dir, models=tiny_models, task=Task.FEVER, allow_random_weights=True, **kw)
    p = build_pipeline(s)
    p.diagnoser.nli = HashNLI(p.diagnoser.nli)
    return p


def test_fifty_claims_every_record_complete_and_resume_exact(world, tiny_models, tmp_path):
    _, _, qpath = world
    queries = load_queries(qpath)
    assert len(queries) == 50
    out = tmp_path / "run.jsonl"
    p = _pipeline(world, tiny_models)
    process(p, queries[:20], out, learn=False)
    # simulate a crash mid-write: a torn last line
    with open(out, "a") as fh:
        fh.write('{"id": "torn", "que')
    log = process(p, queries, out, learn=False)
    ids = [r["id"] for r in log.records]
    assert sorted(ids) == sorted(q.id for q in queries) and len(ids) == len(set(ids)) == 50
    on_disk = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in on_disk] == ids
    for r in on_disk:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["error"] is None
        if r["repair"]:
            rep = r["repair"]
            assert rep["arm"] and rep["latency_s"] >= 0 and 0 <= rep["reward"] <= 1
            assert rep["memory_kind"] == "host" and rep["memory_source"] == "host-rss" and rep["allowed"]
            if r["first"]["gated_label"] == "UNVERIFIED":
                assert len(rep["allowed"]) == 10 and not rep["arm"].startswith("prompt")   # 8 + second_hop + dense_k3
    failures = {r["failure"] for r in on_disk}
    assert len(failures) >= 2 and any(r["repair"] for r in on_disk)
    text = summary(on_disk)
    assert "naive (first answer) accuracy" in text and "D2R (final answer)" in text



@pytest.mark.parametrize("keep", [True, False])
def test_record_log_open_drops_damage_and_redo_records_in_both_modes(tmp_path, keep):
    """keep=False (`run`) reads the log a line at a time and keeps only each record's key: the same
    records are found, damaged lines and records to redo taken out, good lines left byte for byte."""
    from d2r_edge.runner import RecordLog, run_record_ok

    good = [{"id": f"q{i}", "epoch": None, "final_answer": f"a{i}", "error": None, "x": "é"} for i in range(5)]
    failed = {"id": "q9", "epoch": None, "final_answer": None, "error": "Timeout: x"}
    lines = [json.dumps(good[0]), json.dumps(good[1], ensure_ascii=False), "not json", json.dumps(failed),
             json.dumps({"id": 3}), "", json.dumps(good[2]), json.dumps(good[3]) + "   ", '{"id": "torn", "fi']
    out = tmp_path / "run.jsonl"
    out.write_text("\n".join(lines), encoding="utf-8")
    rlog = RecordLog(out, drop=lambda r: bool(r.get("error")), valid=run_record_ok, keep=keep,
                     slim=lambda r: r["id"])
    rlog.append(good[4])
    rlog.close()
    want = ["q0", "q1", "q2", "q3"]
    assert rlog.records == (good[:4] if keep else want) + ([good[4]] if keep else [])
    text = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(t)["id"] for t in text] == want + ["q4"]
    if not keep:                                   # copied as they were (not re-serialized)
        assert text[:4] == [lines[0], lines[1], lines[6], lines[7]]
    again = RecordLog(out, valid=run_record_ok, keep=keep, slim=lambda r: r["id"])
    again.close()
    assert again.records[-1] == (good[4] if keep else "q4")

def test_train_two_epochs_then_resume_replays_nothing_twice(world, tiny_models, tmp_path):
    _, _, qpath = world
    queries = load_queries(qpath)[:15]
    policy = tmp_path / "policy.npz"
    p = _pipeline(world, tiny_models, policy_path=policy, create_policy=True, policy_kind="linucb")
    records = train(p, queries, tmp_path / "train.jsonl", policy, epochs=2)
    assert len(records) == 30 and {r["epoch"] for r in records} == {0, 1}
    n_updates = sum(1 for r in records if r.get("repair"))
    from d2r_edge.policy import LinUCB

    saved = LinUCB.load(policy)
    assert int(saved.counts.sum()) == n_updates > 0
    # rerun: nothing new, nothing replayed
    p2 = _pipeline(world, tiny_models, policy_path=policy)
    assert len(train(p2, queries, tmp_path / "train.jsonl", policy, epochs=2)) == 30
    assert int(LinUCB.load(policy).counts.sum()) == n_updates


class _Handler(http.server.BaseHTTPRequestHandler):
    mode = "ok"
    calls = 0

    def log_message(self, *a):
        pass

    def do_POST(self):
        type(self).calls += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.mode == "500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        if self.mode == "slow":
            time.sleep(1.5)
        content = {"ok": '{"label": "SUPPORTS", "response": "x"}',
                   "badjson": '{"label": "REFUTES", "response": "unterminated',
                   "slow": "{}"}[self.mode]
        body = json.dumps({"choices": [{"message": {"content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


def test_generator_failures_are_recorded_and_the_run_goes_on(world, tiny_models, tmp_path, server):
    from d2r_edge.generate import OpenAICompatible

    _, _, qpath = world
    queries = load_queries(qpath)[:3]
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    p = _pipeline(world, tiny_models)
    for mode, expect_error in (("ok", False), ("badjson", False), ("500", True), ("slow", True)):
        _Handler.mode, _Handler.calls = mode, 0
        p.generator = OpenAICompatible(url, "m", timeout_s=0.5, max_retries=1, backoff_s=0.01)
        log = process(p, queries, tmp_path / f"{mode}.jsonl", learn=False)
        assert len(log.records) == 3
        assert all(bool(r["error"]) is expect_error for r in log.records), (mode, log.records[0]["error"])
        if mode == "badjson":
            assert log.records[0]["first"]["label"] == "REFUTES"   # repaired, not eval'ed
        if mode == "500":
            assert _Handler.calls == 6   # 3 queries x (1 try + 1 retry)
    p.generator = OpenAICompatible("http://127.0.0.1:9/v1", "m", timeout_s=0.5, max_retries=0)
    log = process(p, queries, tmp_path / "down.jsonl", learn=False)
    assert all("could not connect (ConnectError) (attempt 1 of 1)" in r["error"] for r in log.records), log.records


def test_broken_query_lines_are_reported(tmp_path, caplog):
    q = tmp_path / "q.jsonl"
    q.write_text('{"id": 1, "claim": "a"}\nnot json\n{"_id": "h", "question": "b", "answer": "c"}\n'
                 '{"id": 2}\n{"id": 1, "claim": "dup"}\n')
    got = load_queries(q)
    assert [x.id for x in got] == ["1", "h"] and got[1].answer == "c"
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "line 2" in msgs and "line 4" in msgs and "line 5" in msgs


_TRAIN = """
import sys, hashlib, numpy as np
from pathlib import Path
sys.path.insert(0, sys.argv[5])
from test_loop import HashNLI
from d2r_edge.app import RunSettings, build_pipeline, train
from d2r_edge.runner import load_queries
from d2r_edge.tasks import Task
s = RunSettings(kb=Path(sys.argv[1]), models=Path(sys.argv[2]), task=Task.FEVER,
                allow_random_weights=True, policy_path=Path(sys.argv[4]), create_policy=True, policy_kind="linucb")
p = build_pipeline(s)
p.diagnoser.nli = HashNLI(p.diagnoser.nli)
train(p, load_queries(Path(sys.argv[3]))[:25], Path(sys.argv[4]).with_suffix(".jsonl"), s.policy_path, 2)
print("trained")
"""


def test_kill_during_train_then_rerun(world, tiny_models, tmp_path):
    _, kb_dir, qpath = world
    policy = tmp_path / "policy.npz"
    log = policy.with_suffix(".jsonl")
    args = [sys.executable, "-c", _TRAIN, str(kb_dir), str(tiny_models), str(qpath), str(policy),
            str(Path(__file__).parent)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 180
    while time.time() < deadline and (not log.is_file() or log.read_text().count("\n") < 12):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "trained" in done.stdout, done.stderr[-2000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    keys = [(r["epoch"], r["id"]) for r in records]
    assert len(keys) == len(set(keys)) == 50          # 25 queries x 2 epochs: 0 lost, 0 duplicated
    from d2r_edge.policy import LinUCB

    assert int(LinUCB.load(policy).counts.sum()) == sum(1 for r in records if r.get("repair"))


def test_generator_and_nli_read_titled_passages_unless_told_otherwise(world, tiny_models):
    """The offline NLI is fine-tuned on "title\\ntext" premises; serving bare text was a mismatch."""
    from d2r_edge.generate.base import Generation

    class Recording(HashNLI):
        def __init__(self, real):
            super().__init__(real)
            self.premises = []

        def score(self, pairs):
            self.premises += [p for p, _ in pairs]
            return super().score(pairs)

    class EchoGenerator:
        prompt_sensitive = True

        def __init__(self):
            self.seen = []

        def generate(self, task, style, query, passages, sample=True):
            self.seen.append(list(passages))
            return Generation(passages[0] if passages else "", None, "echo")

    claim = json.loads(open(world[2]).readline())["claim"]
    for titles in (True, False):
        p = _pipeline(world, tiny_models, evidence_titles=titles)
        nli, gen = Recording(p.diagnoser.nli), EchoGenerator()
        p.diagnoser.nli, p.generator = nli, gen
        a = p.attempt(claim, p.default)
        want = [f"{x.title}\n{x.text}" if titles else x.text for x in a.passages]
        assert all(x.title for x in a.passages)          # FEVER pages always have one
        assert gen.seen == [want]
        # e_q pairs, then e_r's (scored until the first entailing one: some of the same premises)
        assert nli.premises[:len(want)] == want and nli.premises[len(want):]
        assert set(nli.premises[len(want):]) <= set(want)


def test_train_with_the_calibrated_gate_fits_the_detector_and_run_uses_it(world, tiny_models, tmp_path, capsys):
    from d2r_edge.cli import main
    from d2r_edge.errors import InputError
    from d2r_edge.policy import LinUCB

    _, kb_dir, qpath = world
    policy = tmp_path / "p.npz"
    common = ["--kb", str(kb_dir), "--task", "fever", "--models", str(tiny_models), "--allow-random-weights",
              "--queries", str(qpath), "--limit", "30"]
    assert main(["train", *common, "--out", str(tmp_path / "t.jsonl"), "--policy", str(policy),
                 "--gate", "calibrated", "--epochs", "1", "--policy-kind", "linucb"]) == 0
    det = json.loads((tmp_path / "p.detector.json").read_text())      # beside the policy
    assert det["fit"]["n"] == 30 and det["task"] == "fever"
    pol = LinUCB.load(policy)
    assert pol.context["p_wrong"] is True
    records = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert all(r["gate"] == "calibrated" and (r["repair"] is not None) == (r["p_wrong"] >= det["threshold"])
               for r in records)
    # run finds the detector beside the policy; under the paper gate it still records p_wrong
    assert main(["run", *common, "--out", str(tmp_path / "r.jsonl"), "--policy", str(policy),
                 "--gate", "calibrated"]) == 0
    assert all("p_wrong" in json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines())
    capsys.readouterr()
    assert main(["run", *common, "--out", str(tmp_path / "r2.jsonl"), "--gate", "calibrated"]) == InputError.exit_code
    assert "needs a fitted detector" in capsys.readouterr().err
    # a policy trained under the calibrated gate is refused under the paper gate (its contexts differ)
    assert main(["run", *common, "--out", str(tmp_path / "r3.jsonl"), "--policy", str(policy)]) != 0
    assert "--gate" in capsys.readouterr().err


def test_qa_summary_counts_answers_holding_the_gold(tmp_path):
    """EM is 0 for sentence answers by construction; the summary also says how many hold the gold."""
    from d2r_edge.runner import summary_of

    recs = [{"id": "a", "task": "qa", "failure": "no_failure", "repair": None, "error": None, "total_s": 0.1,
             "gold_answer": "Agnes Morrow", "first_answer": "Designed by Agnes Morrow.",
             "final_answer": "Designed by Agnes Morrow.", "first_correct": False, "final_correct": False},
            {"id": "b", "task": "qa", "failure": "insufficient_evidence", "repair": None, "error": None,
             "total_s": 0.1, "gold_answer": "1967", "first_answer": "In 1966.", "final_answer": "Built in 1967.",
             "first_correct": False, "final_correct": False},
            {"id": "c", "task": "qa", "failure": "no_failure", "repair": None, "error": None, "total_s": 0.1,
             "gold_answer": None, "first_answer": "x", "final_answer": "x",
             "first_correct": None, "final_correct": None}]
    out = tmp_path / "qa.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = summary_of(out)
    assert "accuracy/EM: 0.000 over 2" in text
    assert "answers holding the gold answer: first 1/2, final 2/2" in text
    fever = [dict(r, task="fever") for r in recs]
    assert "holding the gold" not in summary(fever)
