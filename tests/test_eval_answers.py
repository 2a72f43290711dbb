"""`d2r-edge eval answers` on the tiny models with a varied stand-in NLI, so repairs happen."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from d2r_edge.cli import main
from d2r_edge.errors import InputError

ROOT = Path(__file__).resolve().parent.parent

_HASH_NLI = f'''
import sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
from d2r_edge.onnx.encoders import NLI
from stand_ins import hash_nli_scores

NLI.score = lambda self, pairs: hash_nli_scores(pairs)
'''


@pytest.fixture(scope="module")
def fever_file(tmp_path_factory, shared_data):
    path = tmp_path_factory.mktemp("evq") / "fever.jsonl"
    lines = (shared_data / "fever" / "dev.jsonl").read_text(encoding="utf-8").splitlines()[:400]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _args(fever_file, models, out, *extra):
    return ["eval", "answers", "--task", "fever", "--train", str(fever_file), "--test", str(fever_file),
            "--train-limit", "12", "--test-limit", "30", "--models", str(models), "--allow-random-weights",
            "--out", str(out), "--bootstrap", "500", *extra]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_models, fever_file):
    from d2r_edge.onnx.encoders import NLI

    out = tmp_path_factory.mktemp("eval") / "out"
    real = NLI.score
    exec(_HASH_NLI, {})                                   # patches NLI.score for this module's runs
    try:
        assert main(_args(fever_file, tiny_models, out)) == 0
    finally:
        NLI.score = real
    return out, json.loads((out / "summary.json").read_text())


def _evaluate_hashed(fever_file, models, out, train_limit: int, *extra) -> None:
    """eval answers with the stand-in NLI and `train_limit` training claims (must exit 0)."""
    from d2r_edge.onnx.encoders import NLI

    real = NLI.score
    exec(_HASH_NLI, {})
    try:
        args = _args(fever_file, models, out, *extra)
        args[args.index("--train-limit") + 1] = str(train_limit)
        assert main(args) == 0
    finally:
        NLI.score = real


def _records(out: Path, method: str) -> list[dict]:
    return [json.loads(line) for line in (out / "methods" / f"{method}.jsonl").read_text().splitlines()]


def test_summary_has_every_method_and_the_paper_columns(evaluated):
    out, s = evaluated
    assert s["task"] == "fever" and s["n_test"] == 30 and s["n_train"] == 12
    for m in ("naive", "paraphrase", "expansion", "best_fixed", "linucb", "thompson", "oracle",
              "linucb_unweighted", "linucb_unconstrained", "linucb_stringent", "linucb_relaxed"):
        v = s["methods"][m]
        assert {"accuracy", "macro_f1", "delta_vs_naive", "ci95", "faithfulness", "budget_violations_pct",
                "wrong_to_right", "right_to_wrong", "repaired_share"} <= set(v)
        assert v["ci95"][0] <= v["delta_vs_naive"] <= v["ci95"][1]
        assert len(_records(out, m)) == 30
    assert s["methods"]["naive"]["delta_vs_naive"] == 0.0
    assert sum(v["n"] for v in s["diagnosis"]["failure_types"].values()) == 30
    assert s["methods"]["linucb"]["repaired_share"] > 0          # the stand-in NLI makes failures
    report = (out / "report.md").read_text()
    assert "## Table 1" in report and "## What this says" in report and "linucb_relaxed" in report
    # every arm of the registry, ours included, gets its row for the failures it may repair
    from d2r_edge.repair import ARM_NAMES
    tried = {arm for cells in s["arms_by_failure"].values() for arm in cells}
    assert "second_hop" in tried and "| second_hop |" in report and tried <= set(ARM_NAMES)
    assert (out / "fig_budget.png").is_file() or "figures" not in s
    # failure detection of the first answers: counts agree with the naive records and Table 4
    det = s["detection"]
    naive = _records(out, "naive")
    assert det["score"] == "alg1_nli" and det["n"] == 30 and s["detection_scores"][0] == det
    assert det["flagged"] == 30 - s["diagnosis"]["failure_types"].get("no_failure", {"n": 0})["n"]
    assert 0 <= det["flagged_wrong"] <= min(det["flagged"], det["n_wrong"])
    assert det["auroc"] is None or 0.0 <= det["auroc"] <= 1.0
    assert len(naive) == 30 and "## Failure detection" in report
    # what the run spent, per phase: the outcomes first, then each method in order
    phases = list(s["phases"])
    assert phases[0].startswith("outcomes") and phases[1:] == [f"method {m}" for m in s["methods"]]
    assert all(v["wall_s"] >= 0 and v["answers_generated"] >= 0 for v in s["phases"].values())
    assert s["answers_per_query"]["stored_attempts_per_query"] >= 1.0 and "## What this run spent" in report
    assert "needs >= 50" in s["detection_ablation"]["skipped"]      # 12 training queries: no ablation


def test_oracle_is_never_below_any_fixed_arm(evaluated):
    out, s = evaluated
    oracle = {r["id"]: r["final_correct"] for r in _records(out, "oracle")}
    for m in ("naive", "paraphrase", "expansion", "best_fixed", "linucb", "thompson"):
        for r in _records(out, m):
            assert oracle[r["id"]] >= r["final_correct"], (m, r["id"])
    # and per arm, from the arm table: the oracle's right answers bound every arm's
    for cells in s["arms_by_failure"].values():
        for c in cells.values():
            assert c["after"] <= c["n"]
    assert s["methods"]["oracle"]["accuracy"] >= max(
        s["methods"][m]["accuracy"] for m in s["methods"] if m != "oracle")


def test_first_attempts_are_shared_and_nothing_is_computed_twice(evaluated):
    out, s = evaluated
    rows = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    keys = [(r["query"], r["config"], r["cost"] is None) for r in rows]
    assert len(keys) == len(set(keys))
    firsts = [r for r in rows if r["config"] == "dense|k5|rerank0:3|simple|refresh0|titles1" and r["cost"] is None]
    assert len(firsts) == 42                                      # 12 train + 30 test, once each
    gens = [json.loads(line)["key"] for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == len(set(gens))
    # extractive has no prompt: the prompt arms collapse onto the default config, refresh onto its twin
    assert not any("paraphrase" in r["config"] or "refresh1" in r["config"] for r in rows)


def test_a_relative_budget_bounds_each_query_by_its_own_first_attempt(tmp_path, tiny_models, fever_file):
    """--budget-latency-x 2: each record's bound is twice its first attempt's recorded stage times."""
    from d2r_edge.onnx.encoders import NLI
    from d2r_edge.pipeline import STAGES

    out = tmp_path / "out"
    real = NLI.score
    exec(_HASH_NLI, {})
    try:
        assert main(_args(fever_file, tiny_models, out, "--budget-latency-x", "2", "--methods",
                          "naive,oracle,linucb", "--train-limit", "6", "--test-limit", "10")) == 0
    finally:
        NLI.score = real
    s = json.loads((out / "summary.json").read_text())
    assert s["budget"] == {"latency_s": None, "device_mem_mib": 6.0, "latency_x": 2.0}
    claims = {str(json.loads(line)["id"]): json.loads(line)["question"] for line in fever_file.open()}
    firsts = {r["query"]: sum(r["attempt"]["timings_s"].get(k, 0.0) for k in STAGES)
              for r in map(json.loads, (out / "attempts.jsonl").read_text().splitlines())
              if r["config"] == "dense|k5|rerank0:3|simple|refresh0|titles1" and r["cost"] is None}
    for m in ("naive", "oracle", "linucb"):
        for r in _records(out, m):
            assert r["budget_latency_s"] == pytest.approx(2 * firsts[claims[r["id"]]]), (m, r["id"])
            assert r["over_budget"] is None or r["over_budget"] == (r["latency_s"] > r["budget_latency_s"]
                                                                    or r["mem_growth_mib"] > 6.0)
    assert len({r["budget_latency_s"] for r in _records(out, "naive")}) > 1      # one bound per query


def test_a_generator_failure_leaves_its_query_out_and_a_rerun_retries_it(tmp_path, tiny_models, fever_file,
                                                                          monkeypatch):
    """One test and one training query whose generator fails (after the client's retries): the evaluation
    goes on without them in every method and says so; the same --out run again computes them."""
    from d2r_edge.generate.extractive import Extractive
    from d2r_edge.generate.openai_compat import GeneratorError
    from d2r_edge.onnx.encoders import NLI

    rows = [json.loads(line) for line in fever_file.open()]
    train_claim, test_claim = rows[1]["question"], rows[8]["question"]      # --train-limit 6, test from 6 on
    down = {train_claim, test_claim}
    real_generate = Extractive.generate

    def flaky(self, task, style, query, passages, sample=True):
        if query in down:
            raise GeneratorError("generator http://127.0.0.1:1/v1 failed after 4 attempt(s): TimeoutError",
                                 timed_out=True, attempts=4)
        return real_generate(self, task, style, query, passages)

    monkeypatch.setattr(Extractive, "generate", flaky)
    out = tmp_path / "out"
    args = _args(fever_file, tiny_models, out, "--methods", "naive,best_fixed,oracle,linucb", "--train-limit", "6",
                 "--test-limit", "8", "--split", "all")
    real = NLI.score
    exec(_HASH_NLI, {})
    try:
        assert main(args) == 0
        s = json.loads((out / "summary.json").read_text())
        failures = s["generator_failures"]
        assert (failures["train"], failures["test"], s["n_test"], s["n_train"]) == (1, 1, 7, 5)
        assert {r["id"] for r in failures["queries"]} == {str(rows[1]["id"]), str(rows[8]["id"])}
        assert all("TimeoutError" in r["error"] for r in failures["queries"])
        for m in ("naive", "best_fixed", "oracle", "linucb"):
            assert str(rows[8]["id"]) not in {r["id"] for r in _records(out, m)}
            assert len(s["methods"][m]) and len(_records(out, m)) == 7
        assert "Left out after a generator failure" in (out / "report.md").read_text()
        down.clear()                                   # the server is back: the rerun computes them
        assert main(args) == 0
    finally:
        NLI.score = real
    s = json.loads((out / "summary.json").read_text())
    assert (s["generator_failures"]["test"], s["n_test"], s["n_train"]) == (0, 8, 6)
    assert str(rows[8]["id"]) in {r["id"] for r in _records(out, "oracle")}
    # every test query failing leaves nothing to evaluate: one clear error, the generator's exit code
    down.update(r["question"] for r in rows)
    exec(_HASH_NLI, {})
    try:
        assert main(_args(fever_file, tiny_models, tmp_path / "none", "--methods", "naive", "--train-limit", "2",
                          "--test-limit", "3", "--split", "all")) == GeneratorError.exit_code
    finally:
        NLI.score = real


def test_which_generator_failures_a_query_may_have_alone():
    from d2r_edge.generate.openai_compat import GeneratorError

    assert GeneratorError("x", status=401).client_error and GeneratorError("x", status=404).client_error
    for transient in (GeneratorError("x", status=503), GeneratorError("x", status=429),
                      GeneratorError("x", timed_out=True), GeneratorError("x", status=400, timed_out=True),
                      GeneratorError("x")):
        assert not transient.client_error


def test_rerun_redoes_nothing(evaluated, tiny_models, fever_file):
    out, s = evaluated
    before = (out / "attempts.jsonl").read_bytes(), (out / "generations.jsonl").read_bytes()
    from d2r_edge.onnx.encoders import NLI

    real = NLI.score
    NLI.score = lambda self, pairs: (_ for _ in ()).throw(AssertionError("the NLI ran again"))
    try:
        assert main(_args(fever_file, tiny_models, out)) == 0
    finally:
        NLI.score = real
    assert ((out / "attempts.jsonl").read_bytes(), (out / "generations.jsonl").read_bytes()) == before
    again = json.loads((out / "summary.json").read_text())
    assert again["methods"]["linucb"]["accuracy"] == s["methods"]["linucb"]["accuracy"]


def test_a_moved_folder_with_its_data_elsewhere_resumes_without_recomputing(evaluated, tiny_models, fever_file,
                                                                            tmp_path):
    """Another machine: the --out folder copied, the query file under another path. Nothing is computed
    again; a query file with other contents under the old name is still refused."""
    import shutil

    from d2r_edge.onnx.encoders import NLI

    out, s = evaluated
    moved, data = tmp_path / "elsewhere" / "out", tmp_path / "data"
    shutil.copytree(out, moved)
    data.mkdir()
    shutil.copy(fever_file, data / fever_file.name)
    real = NLI.score
    NLI.score = lambda self, pairs: (_ for _ in ()).throw(AssertionError("the NLI ran again"))
    try:
        assert main(_args(data / fever_file.name, tiny_models, moved)) == 0
    finally:
        NLI.score = real
    again = json.loads((moved / "summary.json").read_text())
    assert again["methods"]["linucb"]["accuracy"] == s["methods"]["linucb"]["accuracy"]
    assert json.loads((moved / "settings.json").read_text())["test"] == [str(data / fever_file.name)]
    lines = (data / fever_file.name).read_text().splitlines()
    (data / fever_file.name).write_text("\n".join(lines[:-1]) + "\n")     # same name, other contents
    assert main(_args(data / fever_file.name, tiny_models, moved)) != 0


def test_a_folder_from_before_an_arm_this_task_never_uses_resumes(evaluated, tiny_models, fever_file, tmp_path):
    """Issue 51's fresh FEVER run was written before the reader_span arm (questions only) existed: its folder
    holds what this version computes for claims, so it resumes; a folder lacking an arm FEVER runs is refused."""
    import shutil

    out, s = evaluated
    old = tmp_path / "old"
    shutil.copytree(out, old)
    settings = json.loads((old / "settings.json").read_text())
    assert "reader_span" in settings["arms"]
    before = {**settings, "arms": [a for a in settings["arms"] if a != "reader_span"]}
    (old / "settings.json").write_text(json.dumps(before))
    assert main(_args(fever_file, tiny_models, old)) == 0
    assert json.loads((old / "settings.json").read_text())["arms"] == settings["arms"]
    assert json.loads((old / "summary.json").read_text())["methods"]["linucb"] == s["methods"]["linucb"]
    (old / "settings.json").write_text(json.dumps({**before, "arms": [a for a in before["arms"] if a != "rerank"]}))
    assert main(_args(fever_file, tiny_models, old)) == InputError.exit_code



def test_the_unverified_rule_ablation_is_another_evaluation(evaluated, tiny_models, fever_file, capsys):
    """--no-unverified-rule lets other arms act on UNVERIFIED answers: its records must never be mixed into a
    folder whose methods ran under the rule (the rule was missing from the folder's settings)."""
    out, _ = evaluated
    assert main(_args(fever_file, tiny_models, out, "--no-unverified-rule")) == InputError.exit_code
    assert "unverified_rule differ" in capsys.readouterr().err


_RUN = _HASH_NLI + '''
import sys
from d2r_edge.cli import main
sys.exit(main(sys.argv[1:]))
'''


def test_kill_during_eval_then_rerun_loses_and_repeats_nothing(evaluated, tiny_models, fever_file, tmp_path):
    src, _ = evaluated
    out = tmp_path / "out"
    out.mkdir()
    for name in ("kb", "kb-docs.jsonl", "kb.input-sha256"):      # the KB is cached; reuse it
        (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, out / name)
    args = [sys.executable, "-c", _RUN, *_args(fever_file, tiny_models, out)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    attempts = out / "attempts.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not attempts.is_file() or attempts.read_text().count("\n") < 25):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    n_before = attempts.read_text().count("\n")
    assert 25 <= n_before
    with open(attempts, "a") as fh:                                # a torn last line, as a crash leaves
        fh.write('{"query": "torn')
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in attempts.read_text().splitlines()]
    keys = [(r["query"], r["config"], r["cost"] is None) for r in rows]
    assert len(keys) == len(set(keys))                             # nothing repeated
    full = [json.loads(line) for line in (src / "attempts.jsonl").read_text().splitlines()]
    assert {(r["query"], r["config"]) for r in rows} == {(r["query"], r["config"]) for r in full}  # nothing lost
    for m in ("naive", "oracle", "linucb"):
        assert sorted(r["id"] for r in _records(out, m)) == sorted(r["id"] for r in _records(src, m))
        a = {r["id"]: r["final_answer"] for r in _records(out, "naive")}
        b = {r["id"]: r["final_answer"] for r in _records(src, "naive")}
        assert a == b


def test_bad_inputs_give_one_clear_error_each(tmp_path, fever_file, tiny_models, capsys):
    from d2r_edge.eval.answers import parse_methods
    from d2r_edge.eval.querysets import load_queryset

    with pytest.raises(InputError, match="unknown method 'lincub'"):
        parse_methods("naive,lincub")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InputError, match="no usable line"):
        load_queryset(empty)
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"foo": 1, "bar": "x"}) + "\n")
    with pytest.raises(InputError, match="layout not recognized"):
        load_queryset(odd)
    cases = [
        (_args(fever_file, tiny_models, tmp_path / "o1", "--methods", "naive,bogus"), "unknown method"),
        (["eval", "answers", "--task", "fever", "--train", str(fever_file), "--test", str(empty),
          "--models", str(tiny_models), "--out", str(tmp_path / "o2")], "no usable line"),
        (["eval", "answers", "--task", "qa", "--train", str(fever_file), "--test", str(fever_file),
          "--models", str(tiny_models), "--out", str(tmp_path / "o3")], "--task is qa"),
        (["eval", "answers", "--task", "fever", "--train", str(fever_file), "--test", str(odd),
          "--models", str(tiny_models), "--out", str(tmp_path / "o4")], "layout not recognized"),
    ]
    for argv, msg in cases:
        capsys.readouterr()
        assert main(argv) == InputError.exit_code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


def test_qa_layouts_load_with_gold_and_aliases(shared_data):
    from d2r_edge.eval.querysets import Layout, load_queryset

    for name, layout in (("hotpotqa", Layout.HOTPOT), ("hotpotqa_fullwiki", Layout.HOTPOT),
                         ("2wikimultihopqa", Layout.HOTPOT), ("hotpotqa_ircot_subsample", Layout.IRCOT),
                         ("musique", Layout.MUSIQUE)):
        qs = load_queryset(shared_data / name / "dev.jsonl", limit=5)
        assert qs.layout is layout and len(qs.queries) == 5
        ids = {d.id for d in qs.documents}
        for q in qs.queries:
            assert q.answers and q.gold_doc_ids and q.gold_doc_ids <= ids, (name, q.id)


def test_replayed_generations_keep_the_generators_cost(tmp_path):
    """A cached answer is free to replay, but the attempt's metered latency must still be the
    generator's: budgets, rewards and the report read it."""
    from d2r_edge.budget import Meter
    from d2r_edge.diagnose import Diagnosis
    from d2r_edge.eval.outcomes import CachedGenerator
    from d2r_edge.generate.base import Generation
    from d2r_edge.pipeline import Pipeline
    from d2r_edge.repair import PipelineConfig
    from d2r_edge.signals import Entailment, FailureType, KGStatus
    from d2r_edge.tasks import Task

    class Slow:
        name, model = "slow", "m"

        def generate(self, task, style, query, passages, sample=True):
            time.sleep(0.2)
            return Generation("Paris", None, '{"answer": "Paris"}')

    class NoRetrieval:
        def retrieve(self, query, cfg, vec=None):
            return []

    class Fixed:
        def diagnose(self, *a):
            return Diagnosis(FailureType.NO_FAILURE, Entailment.ENTAILMENT, Entailment.ENTAILMENT,
                             KGStatus.NO_TRIPLETS, None, None)

    gen = CachedGenerator(Slow(), tmp_path / "g.jsonl")
    p = Pipeline(Task.QA, NoRetrieval(), gen, Fixed(), None, None, None, Meter())
    live, live_cost = p.metered_attempt("q", PipelineConfig())
    again, again_cost = p.metered_attempt("q", PipelineConfig())
    assert gen.calls == 1 and gen.hits == 1
    assert again.generation.response == "Paris" and again.generation.replayed_s >= 0.2
    assert again_cost.latency_s >= 0.2 and again.timings_s["generate_s"] >= 0.2
    assert abs(again_cost.latency_s - live_cost.latency_s) < 0.1
    gen.close()
    # a new process reads the recorded latency back from the cache file
    reread = CachedGenerator(Slow(), tmp_path / "g.jsonl")
    from d2r_edge.repair import PromptStyle

    assert reread.generate(Task.QA, PromptStyle.SIMPLE, "q", []).replayed_s >= 0.2


def test_test_offset_takes_a_later_disjoint_slice(tmp_path):
    from d2r_edge.app import RunSettings
    from d2r_edge.eval.answers import EvalSettings, load_splits
    from d2r_edge.eval.split import Split
    from d2r_edge.tasks import Task

    f = tmp_path / "claims.jsonl"
    with open(f, "w") as fh:
        for i in range(12):
            fh.write(json.dumps({"id": str(i), "claim": f"Claim number {i}.", "label": "SUPPORTS",
                                 "derived_evidence_sentences": [[f"Page_{i}", 0, f"Claim number {i}."]]}) + "\n")

    def ids(offset, limit):
        s = EvalSettings(task=Task.FEVER, train=(f,), test=(f,), models=tmp_path, out=tmp_path / "o",
                         train_limit=3, test_limit=limit, test_offset=offset, split=Split.ALL,
                         run=RunSettings(kb=tmp_path, models=tmp_path, task=Task.FEVER))
        train, test = load_splits(s)
        return [q.id for qs in train for q in qs.queries], [q.id for qs in test for q in qs.queries], test

    train, first, _ = ids(0, 4)
    assert train == ["0", "1", "2"] and first == ["3", "4", "5", "6"]
    _, later, sets = ids(4, 4)
    assert later == ["7", "8", "9", "10"]
    docs = {d.id for qs in sets for d in qs.documents}
    assert {f"Page_{i}#0" for i in range(3, 11)} <= docs      # the skipped claims' evidence stays in the KB
    assert ids(4, None)[1] == ["7", "8", "9", "10", "11"]
    with pytest.raises(InputError, match="--test-offset"):
        ids(-1, 4)
    with pytest.raises(InputError, match="--test-offset 9 leaves no test query"):
        ids(9, 4)


def test_a_per_file_training_limit_takes_each_file_s_head(tmp_path):
    """HotpotQA's distractor and fullwiki questions on both sides: N training queries from each file,
    the test slice continues after each file's own N; in the fingerprint only when given."""
    from d2r_edge.app import RunSettings
    from d2r_edge.eval.answers import EvalSettings, fingerprint, load_splits
    from d2r_edge.eval.split import Split
    from d2r_edge.tasks import Task

    files = []
    for name in ("a", "b"):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps({"id": f"{name}{i}", "claim": f"Claim {name} {i}.", "label": "SUPPORTS",
                                         "derived_evidence_sentences": [[f"P_{name}{i}", 0, "x"]]}) + "\n"
                             for i in range(5)))
        files.append(f)

    def settings(**kw):
        return EvalSettings(task=Task.FEVER, train=tuple(files), test=tuple(files), models=tmp_path,
                            out=tmp_path / "o", split=Split.ALL,
                            run=RunSettings(kb=tmp_path, models=tmp_path, task=Task.FEVER), **kw)

    train, test = load_splits(settings(train_limit_per_file=2))
    assert [q.id for qs in train for q in qs.queries] == ["a0", "a1", "b0", "b1"]
    assert [q.id for qs in test for q in qs.queries] == ["a2", "a3", "a4", "b2", "b3", "b4"]
    # the next N of each file: a slice of each file's training side (settings compared on training queries)
    train, test = load_splits(settings(train_limit_per_file=1, test_limit_per_file=2))
    assert [q.id for qs in test for q in qs.queries] == ["a1", "a2", "b1", "b2"]
    assert fingerprint(settings(test_limit_per_file=2), "k")["test_limit_per_file"] == 2
    assert "test_limit_per_file" not in fingerprint(settings(test_limit=2), "k")
    for kw in ({"test_limit": 2}, {"test_offset": 1}):
        with pytest.raises(InputError, match="not both"):
            settings(test_limit_per_file=2, **kw)
    train, _ = load_splits(settings(train_limit=2))            # in all: the first file's head only
    assert [q.id for qs in train for q in qs.queries] == ["a0", "a1"]
    assert fingerprint(settings(train_limit_per_file=2), "k")["train_limit_per_file"] == 2
    assert "train_limit_per_file" not in fingerprint(settings(train_limit=2), "k")
    # the samples are part of every stored first attempt: another --self-consistency is another evaluation
    assert "self_consistency" not in fingerprint(settings(train_limit=2), "k")
    sampled = replace(settings(train_limit=2), run=RunSettings(
        kb=tmp_path, models=tmp_path, task=Task.FEVER, generator="openai", base_url="http://127.0.0.1:9/v1",
        model="m", self_consistency=3, sample_temperature=0.7))
    assert fingerprint(sampled, "k")["self_consistency"] == [3, 0.7]
    with pytest.raises(InputError, match="not both"):
        settings(train_limit=2, train_limit_per_file=2)
    with pytest.raises(InputError, match="--train-limit-per-file must be"):
        settings(train_limit_per_file=0)


def test_eval_on_ray_gives_the_local_records(tiny_models, fever_file, tmp_path):
    """The attempts computed by 2 Ray workers make every method decide as in a local evaluation
    (the real tiny models: a stand-in NLI patched here would not reach the workers)."""
    ray = pytest.importorskip("ray")
    keep = ("id", "first_answer", "final_answer", "first_failure", "final_failure", "arm", "first_passages")
    extra = ("--methods", "naive,linucb,thompson,oracle", "--train-limit", "6", "--test-limit", "12")
    try:
        assert main(_args(fever_file, tiny_models, tmp_path / "local", *extra)) == 0
        assert main(_args(fever_file, tiny_models, tmp_path / "ray", *extra, "--engine", "ray",
                          "--workers", "2", "--batch-queries", "3")) == 0
    finally:
        ray.shutdown()
    for m in ("naive", "linucb", "thompson", "oracle"):
        local, remote = ([{k: r.get(k) for k in keep} for r in _records(tmp_path / d, m)] for d in ("local", "ray"))
        assert sorted(local, key=lambda r: r["id"]) == sorted(remote, key=lambda r: r["id"]), m
    attempts = [(tmp_path / d / "attempts.jsonl").read_text().splitlines() for d in ("local", "ray")]
    key = [sorted((json.loads(a)["query"], json.loads(a)["config"], json.loads(a)["cost"] is None) for a in x)
           for x in attempts]
    assert key[0] == key[1] and len(key[0]) > 12   # the same attempts, each stored once


def test_the_calibrated_gate_repairs_by_p_wrong(tmp_path, tiny_models, fever_file, capsys):
    """--gate calibrated: the detector is fitted on the training queries before any arm runs, and a
    test query gets a repair exactly when its P(wrong) reaches the detector's threshold."""
    out = tmp_path / "out"
    _evaluate_hashed(fever_file, tiny_models, out, 40, "--gate", "calibrated",
                     "--methods", "naive,best_fixed,oracle,linucb,vote_k2")
    s = json.loads((out / "summary.json").read_text())
    det = json.loads((out / "detector.json").read_text())
    tau = det["threshold"]
    assert s["gate"] == {"name": "calibrated", "detector_threshold": tau}
    assert s["detection"]["score"] == "calibrated" and s["detection"]["threshold"] == tau
    assert det["fit"]["n"] == 40
    cv = s["detection_train_cv"]       # what a choice between the gates reads: training queries only
    assert cv["n"] == 40 and 0.0 <= cv["calibrated_auroc"] <= 1.0 and 0.0 <= cv["alg1_nli_auroc"] <= 1.0
    naive = {r["id"]: r for r in _records(out, "naive")}
    assert all(r["p_wrong"] is not None and "q_ent_max" in r["detector_signals"] for r in naive.values())
    gated = {i for i, r in naive.items() if r["p_wrong"] >= tau}
    assert s["detection"]["flagged"] == len(gated)
    for m in ("best_fixed", "oracle", "linucb", "vote_k2"):
        for r in _records(out, m):
            if r["repaired"]:
                assert r["id"] in gated, (m, r["id"])
    # the vote: at most 2 arms, the delivered answer is the heaviest group's (first answer included)
    votes = [r for r in _records(out, "vote_k2") if r["repaired"]]
    assert votes and s["methods"]["vote_k2"]["repaired_share"] > 0
    for r in votes:
        v = r["vote"]
        assert 1 <= len(v["arms"]) <= 2 and len(v["answers"]) == len(v["arms"]) + 1
        totals = {}
        for g, w in zip(v["groups"], v["weights"]):
            totals[g] = totals.get(g, 0.0) + w
        assert totals[v["groups"][v["winner"]]] == pytest.approx(max(totals.values()))
        assert r["final_answer"] == v["answers"][v["winner"]]
        assert r["kept"] == ("first" if v["winner"] == 0 else "repaired")
    # the oracle tries every allowed arm of every gated query; an un-gated one keeps its first answer
    oracle = _records(out, "oracle")
    assert all(not r["repaired"] for r in oracle if r["id"] not in gated)
    assert "This run's gate: `calibrated`" in (out / "report.md").read_text()
    # selective answering: the test side's risk-coverage curve is the naive records' own (P(wrong), right?)
    sel = s["selective"]
    wrong = np.array([r["first_correct"] < 1.0 for r in naive.values()])
    p = np.array([r["p_wrong"] for r in naive.values()])
    order = np.argsort(p, kind="stable")
    assert sel["naive_error"] == pytest.approx(wrong.mean()) and sel["n_calibration"] == 40
    curve = sel["curves"]["calibrated"]
    assert curve["coverage"][-1] == 1.0 and curve["error"][-1] == pytest.approx(wrong.mean())
    if len(np.unique(p)) == len(p):
        assert curve["error"][0] == float(wrong[order[0]])
    assert {(r["score"], r["epsilon"]) for r in sel["rows"]} == {
        (k, e) for k in ("alg1_nli", "calibrated") for e in (0.05, 0.1, 0.2, 0.25, 0.3, 0.4)}
    for r in sel["rows"]:
        if r["threshold"] is None:
            assert r["coverage"] == 0.0 and "labeled queries" in r["refused"]
        elif r["score"] == "calibrated":
            keep = p <= r["threshold"]
            assert r["trusted"] == int(keep.sum()) and r["errors"] == int(wrong[keep].sum())
    assert len(sel["resplit"]) == 12 and all(0 <= c["violation_rate"] <= 1 for c in sel["resplit"])
    assert "## Selective answering" in (out / "report.md").read_text()
    assert (out / "fig_risk_coverage.png").is_file() or not s.get("figures")
    # the same --out under the other gate is another evaluation: refused rather than mixed
    args = _args(fever_file, tiny_models, out, "--methods", "naive")
    args[args.index("--train-limit") + 1] = "40"
    assert main(args) == InputError.exit_code
    assert "(gate differ)" in capsys.readouterr().err


def test_the_generation_cache_keys_the_served_model_not_the_url(tmp_path):
    """Issue 54: the key held the server's base_url, so the same model behind another port was asked
    again; and it must not hold only the URL, or another model behind the same port would replay."""
    from stand_ins import ScriptedServer

    from d2r_edge.eval.outcomes import CachedGenerator
    from d2r_edge.generate.openai_compat import GeneratorError, OpenAICompatible
    from d2r_edge.repair import PromptStyle
    from d2r_edge.tasks import Task

    ok = {"choices": [{"message": {"content": '{"answer": "Paris"}'}}]}
    path = tmp_path / "g.jsonl"
    with ScriptedServer() as srv:
        srv.replies.append((200, ok))
        first = CachedGenerator(OpenAICompatible(srv.url, "m", max_retries=0), path)
        assert first.served == {"id": "m.gguf", "meta": {"n_params": 494032768, "size": 491400064}}
        assert first.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"]).response == "Paris"
        first.close()
        moved = CachedGenerator(OpenAICompatible(srv.other_url, "m", max_retries=0), path)   # another port
        assert moved.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"]).response == "Paris"
        assert len(srv.seen) == 1 and (moved.calls, moved.hits) == (0, 1)                 # one call in all
        moved.close()
        # another gguf behind the same port: the server says so, and nothing is replayed
        srv.models["data"][0].update(id="/srv/models/other.gguf", meta={"n_params": 1, "size": 2})
        srv.replies.append((200, {"choices": [{"message": {"content": '{"answer": "Rome"}'}}]}))
        other = CachedGenerator(OpenAICompatible(srv.url, "m", max_retries=0), path)
        assert other.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"]).response == "Rome"
        assert len(srv.seen) == 2 and other.hits == 0
        other.close()
        # a hosted API with many models: the requested name names it
        srv.models["data"] = [{"id": "a"}, {"id": "b"}]
        assert OpenAICompatible(srv.url, "b").served_model() == {"id": "b"}
        assert OpenAICompatible(srv.url, "c").served_model() == {"id": "c"}
    with pytest.raises(GeneratorError, match="GET /models failed"):     # no server: no key to trust
        CachedGenerator(OpenAICompatible(srv.url, "m", max_retries=0), path)


def test_a_cache_from_before_the_served_model_key_is_read_once_the_server_repeats_an_answer(tmp_path):
    """Caches written under the old key (URL + requested name) replay after one fresh answer matches
    a stored one; a server that answers otherwise (another model) gets none of them."""
    from stand_ins import ScriptedServer

    from d2r_edge.eval.outcomes import CachedGenerator
    from d2r_edge.generate.openai_compat import OpenAICompatible
    from d2r_edge.repair import PromptStyle
    from d2r_edge.tasks import Task

    def answer(text):
        return (200, {"choices": [{"message": {"content": json.dumps({"answer": text})}}]})

    def old_cache(path, url):
        gen = CachedGenerator(OpenAICompatible(url, "m", max_retries=0), path)
        rows = [{"key": gen.legacy_key(Task.QA, PromptStyle.SIMPLE, q, ["p"]), "response": a, "label": None,
                 "raw": json.dumps({"answer": a}), "latency_s": 1.5, "logprobs": None}
                for q, a in (("q1", "Paris"), ("q2", "Rome"), ("q3", "Oslo"))]
        gen.close()
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    with ScriptedServer() as srv:
        old_cache(tmp_path / "same.jsonl", srv.url)
        srv.replies.append(answer("Paris"))                     # the check: the server repeats q1's answer
        gen = CachedGenerator(OpenAICompatible(srv.url, "m", max_retries=0), tmp_path / "same.jsonl")
        got = [gen.generate(Task.QA, PromptStyle.SIMPLE, q, ["p"]).response for q in ("q1", "q2", "q3")]
        assert got == ["Paris", "Rome", "Oslo"] and len(srv.seen) == 1 and gen.legacy_ok is True
        assert (gen.calls, gen.hits, gen.legacy_hits) == (1, 2, 2)
        gen.close()
        moved = CachedGenerator(OpenAICompatible(srv.other_url, "m", max_retries=0), tmp_path / "same.jsonl")
        assert moved.generate(Task.QA, PromptStyle.SIMPLE, "q3", ["p"]).response == "Oslo"   # stored anew
        assert len(srv.seen) == 1 and moved.legacy_hits == 0
        moved.close()
        old_cache(tmp_path / "changed.jsonl", srv.url)
        srv.replies += [answer("Lyon"), answer("Milan")]       # another model: q1's answer differs
        gen = CachedGenerator(OpenAICompatible(srv.url, "m", max_retries=0), tmp_path / "changed.jsonl")
        got = [gen.generate(Task.QA, PromptStyle.SIMPLE, q, ["p"]).response for q in ("q1", "q2")]
        assert got == ["Lyon", "Milan"] and gen.legacy_ok is False and gen.legacy_hits == 0
        gen.close()


def test_the_accept_methods_keep_the_answer_their_comparator_trusts(tmp_path, tiny_models, fever_file, monkeypatch):
    """Issue 51 §1 in eval answers: the comparator is fitted on the training queries' every-arm outcomes
    (each repair that changed whether the answer was right: a row) and saved in --out; best_fixed_accept
    and linucb_accept record what they kept and why, and a kept first answer is the final one. The stand-in
    NLI's repairs only break answers here (13 breaks, 0 fixes on 80 training claims): too few of either kind
    to fit on, so the fit is replaced by one that records its rows and trusts no repair, and every repair
    counts as changing the answer (on these claims none does), so each one is compared and reverted."""
    import numpy as np

    from d2r_edge import accept
    from d2r_edge.accept import PAIR_NAMES, Comparator
    from d2r_edge.detector import Detector

    seen = {}

    def fit(cls, rows, better, task):
        seen.update(rows=rows, better=better)
        n = len(PAIR_NAMES)
        return cls(Detector(PAIR_NAMES, task, np.zeros(n), np.ones(n), np.zeros(n), float(np.log(0.1 / 0.9)), 0.5))

    monkeypatch.setattr(Comparator, "fit", classmethod(fit))
    monkeypatch.setattr(accept, "changed", lambda first, repaired, fv: True)
    out = tmp_path / "out"
    _evaluate_hashed(fever_file, tiny_models, out, 80, "--split", "all",
                     "--methods", "naive,best_fixed,best_fixed_accept,linucb_accept")
    s = json.loads((out / "summary.json").read_text())
    assert len(seen["rows"]) == len(seen["better"]) >= 10 and not any(seen["better"])      # 13 breaks
    assert all(list(r) == list(PAIR_NAMES) for r in seen["rows"])
    assert (out / "comparator.json").is_file() and (out / "detector.json").is_file()
    plain = {r["id"]: r for r in _records(out, "best_fixed")}
    for method in ("best_fixed_accept", "linucb_accept"):
        recs = [r for r in _records(out, method) if r["repaired"]]
        assert recs and all(r["kept"] == "first" and r["accept"]["p_repaired_better"] == pytest.approx(0.1)
                            and "threshold" in r["accept"]["why"] for r in recs)
        assert all(r["final_answer"] == r["first_answer"] and r["final_correct"] == r["first_correct"]
                   for r in recs)
        assert s["methods"][method]["reverted"] == len(recs) and s["methods"][method]["right_to_wrong"] == 0
        if method == "best_fixed_accept":
            assert {r["id"] for r in recs} == {r["id"] for r in plain.values() if r["repaired"]}


def test_the_methods_training_cv_scores_each_training_query_once_out_of_fold(tmp_path, tiny_models, fever_file):
    """Issue 51: the default method is chosen on the training queries by K-fold cross-validation: each fold's
    methods re-chosen on the other folds, every training query scored once, held out, with its out-of-fold
    P(wrong) (the detector was fitted on it), and the same queries gated as when the methods trained."""
    from d2r_edge.detector import Detector

    out = tmp_path / "out"
    _evaluate_hashed(fever_file, tiny_models, out, 40, "--gate", "calibrated", "--methods",
                     "naive,best_fixed,linucb", "--methods-cv", "4")
    s = json.loads((out / "summary.json").read_text())
    cv = s["methods_train_cv"]
    assert cv["folds"] == 4 and cv["n"] == 40 and set(cv["methods"]) == {"naive", "best_fixed", "linucb"}
    assert cv["methods"]["naive"]["delta_vs_naive"] == 0.0 and cv["default_by_training_cv"] in ("best_fixed", "linucb")
    det = Detector.load(out / "detector.json", fact_verification=True)
    for m in ("naive", "best_fixed", "linucb"):
        folds = [[json.loads(x) for x in (out / "train-cv" / f"fold{k}" / "methods" / f"{m}.jsonl").read_text()
                  .splitlines()] for k in range(4)]
        ids = [r["id"] for recs in folds for r in recs]
        assert len(ids) == len(set(ids)) == 40 and all(9 <= len(recs) <= 11 for recs in folds)
        for recs in folds:
            for r in recs:        # gated exactly by the out-of-fold P(wrong) the record carries
                assert not r["repaired"] or r["p_wrong"] >= det.threshold
    naive = [r for k in range(4) for r in
             map(json.loads, (out / "train-cv" / f"fold{k}" / "methods" / "naive.jsonl").read_text().splitlines())]
    in_sample = [det.p_wrong_of_signals(r["detector_signals"]) for r in naive]
    # out of fold, not the detector's own P(wrong) of queries it was fitted on
    assert sum(abs(r["p_wrong"] - p) > 1e-9 for r, p in zip(naive, in_sample)) >= 30
    assert (out / "train-cv" / "fold0" / "policies" / "linucb.npz").is_file()
    assert "Which method should be the default" in (out / "report.md").read_text()


class _FlipWorld:
    """A stand-in evaluation context for the arm choice by outcome: per query, whether the gate repairs it,
    the first answer, the allowed arms and each arm's answer; 'right' is the gold answer of every query."""

    def __init__(self, rows):
        from types import SimpleNamespace

        self.train = [SimpleNamespace(text=f"q{i}", row=row) for i, row in enumerate(rows)]

    def first(self, q):
        return ("first", q)

    def repairs(self, first, training_query=None):
        return first[1].row["gated"]

    def allowed(self, first):
        import numpy as np

        from d2r_edge.repair import ARM_NAMES

        return np.array([a in first[1].row["arms"] for a in ARM_NAMES])

    def arm_outcome(self, q, arm):
        from d2r_edge.repair import ARM_NAMES

        return ("arm", q, ARM_NAMES[arm]), None

    def answer(self, attempt):
        kind, q = attempt[0], attempt[1]
        return q.row["first"] if kind == "first" else q.row["arms"][attempt[2]]

    def score(self, q, answer):
        ok = float(answer == "right")
        return ok, ok

    from d2r_edge.eval.context import Context

    gated_arm_outcomes = Context.gated_arm_outcomes        # the real walk over gated queries and allowed arms
    del Context


def test_best_fixed_labeled_picks_the_arm_that_fixes_most_net_of_what_it_breaks():
    """best_fixed_labeled (qa-t1reader's finding: Eq. 2's reward chose an arm that fixes nothing): the arm with the
    most gated training answers turned right, net of those it turned wrong, over the queries where it is allowed;
    an ungated query's outcomes do not count, ties go to the arm that breaks fewer."""
    from d2r_edge.eval.methods import arm_flips, labeled_fixed_arm
    from d2r_edge.repair import ARM_NAMES

    rows = [
        {"gated": True, "first": "wrong", "arms": {"bm25_k10": "right", "reader_span": "wrong", "dense_k3": "right"}},
        {"gated": True, "first": "wrong", "arms": {"bm25_k10": "right", "reader_span": "wrong", "dense_k3": "right"}},
        {"gated": True, "first": "right", "arms": {"bm25_k10": "right", "reader_span": "wrong", "dense_k3": "wrong"}},
        {"gated": True, "first": "wrong", "arms": {"reader_span": "right"}},          # bm25 not allowed here
        # not gated: its fixes must not count (dense_k3 would lead with them)
        {"gated": False, "first": "wrong", "arms": {"bm25_k10": "wrong", "dense_k3": "right", "reader_span": "x"}},
        {"gated": False, "first": "wrong", "arms": {"bm25_k10": "wrong", "dense_k3": "right", "reader_span": "x"}},
    ]
    world = _FlipWorld(rows)
    fixed, broken = arm_flips(world, world.train)
    at = ARM_NAMES.index
    assert (fixed[at("bm25_k10")], broken[at("bm25_k10")]) == (2, 0)
    assert (fixed[at("dense_k3")], broken[at("dense_k3")]) == (2, 1)
    assert (fixed[at("reader_span")], broken[at("reader_span")]) == (1, 1)
    assert ARM_NAMES[labeled_fixed_arm(world)] == "bm25_k10"
    # equal net gain (+1 each): the arm that breaks fewer wins
    tie = _FlipWorld([{"gated": True, "first": "wrong", "arms": {"bm25_k10": "right", "dense_k3": "right"}},
                      {"gated": True, "first": "right", "arms": {"bm25_k10": "wrong", "dense_k3": "right"}},
                      {"gated": True, "first": "wrong", "arms": {"bm25_k10": "right", "dense_k3": "wrong"}}])
    fixed, broken = arm_flips(tie, tie.train)
    assert (fixed[at("bm25_k10")], broken[at("bm25_k10")], fixed[at("dense_k3")], broken[at("dense_k3")]) == (2, 1, 1, 0)
    assert ARM_NAMES[labeled_fixed_arm(tie)] == "dense_k3"


def test_eval_answers_runs_best_fixed_labeled_with_the_arm_its_training_flips_choose(tmp_path, tiny_models,
                                                                                    fever_file):
    """The method through eval answers: its arm is the one the summary's training flips rank first, and every
    repaired test record carries it; the report names it with the flips. Beside it best_fixed, and the training
    arm table both choose from (summary.arms_on_train: per arm allowed on a gated training claim, its count,
    mean Eq. 2 reward and flips): best_fixed's arm has the highest mean reward, and the report's table names
    which method chose which arm."""
    out = tmp_path / "out"
    _evaluate_hashed(fever_file, tiny_models, out, 20, "--methods", "naive,best_fixed,best_fixed_labeled")
    s = json.loads((out / "summary.json").read_text())
    arm, flips = s["best_fixed_labeled_arm"], s["arm_flips_on_train"]
    assert "best_fixed_labeled" in s["methods"]
    net = {a: f["fixed"] - f["broken"] for a, f in flips.items()}      # an arm absent here flipped nothing: 0
    assert not net or net.get(arm, 0) >= max(net.values())
    recs = [r for r in _records(out, "best_fixed_labeled") if r["repaired"]]
    assert all(r["arm"] == arm for r in recs)
    assert f"best_fixed_labeled uses `{arm}`" in (out / "report.md").read_text()

    arms = s["arms_on_train"]
    assert arms and all(a["n"] > 0 and a["fixed"] + a["broken"] <= a["n"] for a in arms.values())
    assert arms[s["best_fixed_arm"]]["mean_reward"] == max(a["mean_reward"] for a in arms.values())
    net = {k: a["fixed"] - a["broken"] for k, a in arms.items()}
    assert not any(net.values()) or net[s["best_fixed_labeled_arm"]] == max(net.values())
    assert {k: {"fixed": a["fixed"], "broken": a["broken"]} for k, a in arms.items()
            if a["fixed"] + a["broken"]} == s["arm_flips_on_train"]
    report = (out / "report.md").read_text()
    assert "## Arms on the training queries" in report
    for k, a in arms.items():
        assert f"| `{k}` | {a['n']} | {a['mean_reward']:.3f} | {a['fixed']} | {a['broken']} |" in report
    chosen = [line for line in report.splitlines() if line.startswith(f"| `{s['best_fixed_arm']}` |")]
    assert "best_fixed" in chosen[0].split("|")[-2]
