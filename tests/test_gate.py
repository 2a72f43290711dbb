"""The calibrated gate and the generator's confidence signal.

- the gate: `paper` repairs what Alg. 1 flags, `calibrated` what the detector's
  P(wrong) puts at or above its threshold, whatever Alg. 1 said; P(wrong) joins
  the policy's context only under the calibrated gate; records carry p_wrong
  and its signals;
- log-probabilities: read from an OpenAI-compatible reply, cut to the answer's
  tokens, kept through the generation cache and the attempt store; a server that
  sends none (or rejects the parameter) leaves the feature missing, never made up.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from stand_ins import StubGenerator, top_score_detector

from d2r_edge.budget import CostModel, MemoryProbe, Meter
from d2r_edge.config import ContextConfig
from d2r_edge.detector import MAY_BE_MISSING, Detector, Gate, feature_matrix, feature_names, features
from d2r_edge.diagnose import Diagnosis, Label
from d2r_edge.errors import ConfigError, PolicyError
from d2r_edge.generate.base import Generation
from d2r_edge.generate.openai_compat import OpenAICompatible, answer_logprobs, token_logprobs
from d2r_edge.pipeline import Attempt, Pipeline
from d2r_edge.policy import LinUCB
from d2r_edge.policy.features import ContextBuilder
from d2r_edge.repair import ARM_NAMES, PromptStyle
from d2r_edge.retrieval.retriever import Passage
from d2r_edge.signals import Entailment, FailureType, KGStatus
from d2r_edge.tasks import Task

# --- a pipeline of stand-ins: the query's words choose Alg. 1's verdict and the detector's input


class _Retriever:
    kb = None

    def embed(self, query):
        return np.ones(4)

    def retrieve(self, query, cfg, query_vec=None):
        # the detector below reads the top score: 3 -> P(wrong) ~ 0.99, 1 -> ~ 0.01
        return [Passage(0, "d0", "T", "some text", 3.0 if "wrong" in query else 1.0)]


class _Diagnoser:
    def diagnose(self, query, passages, response, label, fact_verification):
        failure = FailureType.WRONG_RESPONSE if "flagged" in query else FailureType.NO_FAILURE
        e_r = Entailment.NEUTRAL if "flagged" in query else Entailment.ENTAILMENT
        probs = [{"entailment": 0.5, "neutral": 0.3, "contradiction": 0.2}]
        return Diagnosis(failure, Entailment.ENTAILMENT, e_r, KGStatus.NO_TRIPLETS, label, label, probs, probs)


def _pipeline(gate: Gate, detector: Detector | None) -> Pipeline:
    ctx = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None, p_wrong=gate is Gate.CALIBRATED))
    return Pipeline(task=Task.FEVER, retriever=_Retriever(), generator=StubGenerator(), diagnoser=_Diagnoser(),
                    policy=LinUCB(len(ARM_NAMES), ctx.dim, 2.0), context=ctx, costs=CostModel(len(ARM_NAMES)),
                    meter=Meter(MemoryProbe(prefer_device=False)), gate=gate, detector=detector)


CASES = {"wrong flagged": (True, True), "wrong clean": (False, True),
         "right flagged": (True, False), "right clean": (False, False)}   # query -> (paper, calibrated)


@pytest.mark.parametrize("gate", list(Gate))
def test_each_gate_repairs_what_it_should(gate):
    p = _pipeline(gate, top_score_detector())
    for query, want in CASES.items():
        rec = p.run(query, learn=True)
        repaired = rec["repair"] is not None
        assert repaired is want[gate is Gate.CALIBRATED], (gate, query)
        assert rec["gate"] == gate.value
        assert rec["failure"] == ("wrong_response" if "flagged" in query else "no_failure")  # Alg. 1's, always
        assert (rec["p_wrong"] > 0.9) is ("wrong" in query)
        assert rec["detector_signals"]["ret_top1"] == (3.0 if "wrong" in query else 1.0)
        # the extractive-like stand-in gives no log-probabilities: recorded as missing, not as a number
        assert rec["detector_signals"]["gen_logprobs_present"] == 0.0
        assert all(rec["detector_signals"][n] is None for n in MAY_BE_MISSING if n in feature_names(True))
        if repaired:
            x = rec["repair"]["x"]
            assert len(x) == p.context.dim
            if gate is Gate.CALIBRATED:          # P(wrong) sits before the bias
                assert x[-2] == pytest.approx(rec["p_wrong"]) and x[-1] == 1.0


def test_the_calibrated_gate_without_a_detector_says_how_to_get_one():
    with pytest.raises(ConfigError, match="--detector"):
        _pipeline(Gate.CALIBRATED, None).run("wrong clean", learn=False)
    rec = _pipeline(Gate.PAPER, None).run("wrong flagged", learn=False)
    assert rec["repair"] is not None and "p_wrong" not in rec


def test_the_p_wrong_context_is_one_longer_and_refuses_a_missing_value():
    plain, gated = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None)), \
        ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None, p_wrong=True))
    assert gated.dim == plain.dim + 1
    assert "p_wrong" not in plain.spec and gated.spec["p_wrong"] is True
    from d2r_edge.config import Budget

    args = (np.ones(4), FailureType.NO_FAILURE, KGStatus.NO_TRIPLETS, Entailment.ENTAILMENT,
            Entailment.ENTAILMENT, 1.0, 1.0, Budget())
    with pytest.raises(PolicyError, match="P\\(wrong\\)"):
        gated.build(*args)
    np.testing.assert_array_equal(gated.build(*args, p_wrong=0.25)[:-2], plain.build(*args)[:-1])


def test_a_policy_trained_without_the_gate_is_refused_under_it(tmp_path):
    from d2r_edge.app import RunSettings, load_policy
    from d2r_edge.errors import PolicyFileError

    plain = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None))
    pol = LinUCB(len(ARM_NAMES), plain.dim, 2.0, arm_names=ARM_NAMES)
    pol.context = plain.spec
    pol.save(tmp_path / "p.npz")
    s = RunSettings(kb=tmp_path, models=tmp_path, task=Task.FEVER, policy_path=tmp_path / "p.npz")
    gated = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None, p_wrong=True))
    with pytest.raises(PolicyFileError, match="p_wrong.*--gate"):
        load_policy(s, gated)
    load_policy(s, plain)


# --- the detector with missing signals


def _attempt(logprobs, top=1.0):
    probs = [{"entailment": 0.6, "neutral": 0.3, "contradiction": 0.1}]
    d = Diagnosis(FailureType.NO_FAILURE, Entailment.ENTAILMENT, Entailment.ENTAILMENT, KGStatus.NO_TRIPLETS,
                  None, None, probs, probs)
    return Attempt([Passage(0, "d", "T", "Paris is in France", top)],
                   Generation("Paris", None, "raw", logprobs=logprobs), d, {})


def test_missing_logprobs_are_marked_missing_and_imputed_from_training(tmp_path):
    f = features(_attempt(None), fact_verification=False)
    assert f["gen_logprobs_present"] == 0.0 and all(math.isnan(f[n]) for n in MAY_BE_MISSING)
    f = features(_attempt((-0.1, -2.0, -0.3)), fact_verification=False)
    assert f["gen_logprobs_present"] == 1.0 and f["gen_logprob_min"] == -2.0
    assert f["gen_logprob_first"] == -0.1 and f["gen_logprob_sum"] == pytest.approx(-2.4)
    # a fit where confident answers are right and unsure ones wrong; a third give no log-probabilities
    rng = np.random.default_rng(0)
    attempts, wrong = [], []
    for i in range(90):
        bad = i % 2 == 0
        lp = None if i % 3 == 0 else tuple(rng.normal(-3.0 if bad else -0.2, 0.3, size=3))
        attempts.append(_attempt(lp))
        wrong.append(bad)
    x = feature_matrix(attempts, False)
    det = Detector.fit(x, np.array(wrong), feature_names(False), "qa")
    j = det.names.index("gen_logprob_first")
    assert det.fit_stats["missing_share"]["gen_logprob_first"] == pytest.approx(1 / 3)
    assert det.impute[j] == pytest.approx(np.nanmean(x[:, j]))
    p = det.p_wrong_many(x)
    present = ~np.isnan(x[:, j])
    assert np.all(np.isfinite(p))
    assert np.mean((p[present] >= 0.5) == np.array(wrong)[present]) > 0.95
    det.save(tmp_path / "d.json")
    back = Detector.load(tmp_path / "d.json", fact_verification=False)
    np.testing.assert_allclose(back.p_wrong_many(x), p)
    raw = json.loads((tmp_path / "d.json").read_text())
    assert raw["format"] == "d2r-edge-detector/3" and "gen_logprob_min" in raw["features"]
    raw["format"] = "d2r-edge-detector/2"       # a file of the version with the mean log-prob
    (tmp_path / "old.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="refit"):
        Detector.load(tmp_path / "old.json", fact_verification=False)


# --- log-probabilities from an OpenAI-compatible server


def _lp_reply(content: str, tokens: list[tuple[str, float]] | None) -> dict:
    choice = {"message": {"content": content}}
    if tokens is not None:
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                           "top_logprobs": []} for t, lp in tokens]}
    return {"choices": [choice]}


def test_answer_logprobs_are_the_answer_tokens_only():
    toks = tuple((t.encode(), lp) for t, lp in (('{"', -0.01), ("answer", -0.02), ('":', -0.01), (' "', -0.05),
                                                  ("Par", -1.5), ("is", -0.5), ('"}', -0.01)))
    assert answer_logprobs(toks, "Paris") == (-1.5, -0.5)
    # not found: missing (it was every token, the scaffolding's near-certain ones passing for confidence)
    assert answer_logprobs(toks, "London") is None
    assert answer_logprobs(None, "Paris") is None
    assert token_logprobs({"message": {}}) is None
    assert token_logprobs({"logprobs": {"content": [{"token": "a"}]}}) is None        # unreadable: missing
    assert token_logprobs({"logprobs": {"content": [{"token": "a", "logprob": float("-inf")}]}}) is None


def test_a_server_gives_rejects_or_omits_logprobs(tmp_path):
    from stand_ins import ScriptedServer

    from d2r_edge.eval.outcomes import CachedGenerator

    content = '{"label": "REFUTES", "response": "x"}'
    toks = [('{"label": "', -0.01), ("REF", -0.7), ("UTES", -0.1), ('", "response": "x"}', -0.02)]
    with ScriptedServer() as srv:
        client = OpenAICompatible(srv.url, "m", max_retries=0)
        srv.replies.append((200, _lp_reply(content, toks)))
        cache = CachedGenerator(client, tmp_path / "g.jsonl")
        g = cache.generate(Task.FEVER, PromptStyle.SIMPLE, "claim", ["p"])
        assert srv.seen[-1]["logprobs"] is True and srv.seen[-1]["top_logprobs"] == 1
        assert g.label is Label.REFUTES and g.logprobs == (-0.7, -0.1)
        cache.close()
        again = CachedGenerator(client, tmp_path / "g.jsonl")          # replayed from the file
        assert again.generate(Task.FEVER, PromptStyle.SIMPLE, "claim", ["p"]).logprobs == (-0.7, -0.1)
        again.close()
        srv.replies.append((200, _lp_reply(content, None)))              # a server that sends none
        assert client.generate(Task.FEVER, PromptStyle.SIMPLE, "claim 2", ["p"]).logprobs is None
        srv.replies += [(400, '{"error": "logprobs is not supported"}'), (200, _lp_reply(content, None))]
        assert client.generate(Task.FEVER, PromptStyle.SIMPLE, "claim 3", ["p"]).logprobs is None
        assert client.logprobs is False and "logprobs" not in srv.seen[-1]   # asked without, from now on


def test_stored_attempts_keep_their_logprobs():
    from d2r_edge.eval.outcomes import attempt_from_json, attempt_to_json

    a = _attempt((-0.5, -1.0))
    chunks = [{"chunk_id": 0, "doc_id": "d", "title": "T", "text": "Paris is in France"}]
    assert attempt_from_json(attempt_to_json(a), chunks).generation.logprobs == (-0.5, -1.0)
    assert attempt_from_json(attempt_to_json(_attempt(None)), chunks).generation.logprobs is None


def test_answer_logprobs_match_decoded_bytes_and_json_escapes():
    # "Café": the é (c3 a9) split over two tokens whose `token` strings are replacement characters
    reply = _lp_reply('{"answer": "Café"}', [('{"answer": "', -0.01), ("Caf", -0.3), ("\ufffd", -0.9),
                                              ("\ufffd", -0.05), ('"}', -0.01)])
    items = reply["choices"][0]["logprobs"]["content"]
    items[2]["bytes"], items[3]["bytes"] = [0xC3], [0xA9]
    toks = token_logprobs(reply["choices"][0])
    assert answer_logprobs(toks, "Café") == (-0.3, -0.9, -0.05)
    # a quote inside the answer is escaped in the raw JSON
    raw = [('{"answer": "', -0.01), ("He said ", -0.2), ('\\"', -0.4), ("hi", -0.6), ('\\""}', -0.01)]
    assert answer_logprobs(tuple((t.encode(), lp) for t, lp in raw), 'He said "hi"') == (-0.2, -0.4, -0.6, -0.01)
    # a label the model wrote in lower case is found; the first token is the decision
    low = tuple((t.encode(), lp) for t, lp in (('{"label": "', -0.01), ("sup", -1.2), ("ports", -0.02), ('"}', 0.0)))
    assert answer_logprobs(low, "SUPPORTS") == (-1.2, -0.02)


def test_first_token_logprob_not_the_mean_which_counts_tokens():
    names = feature_names(True)
    assert "gen_logprob_mean" not in names and {"gen_logprob_first", "gen_logprob_sum"} <= set(names)
    # two answers equally sure of their decision: the mean differs with the label's token count, the first not
    nei = features(_attempt((-0.7, -0.01, -0.01, -0.01)), fact_verification=False)
    ref = features(_attempt((-0.7, -0.01)), fact_verification=False)
    assert nei["gen_logprob_first"] == ref["gen_logprob_first"] == -0.7


# --- the detector's fit: chosen out of fold, refused on what cannot be fitted


def _noise(n=60, seed=0):
    names = feature_names(False)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(names)))
    x[:, [names.index(m) for m in MAY_BE_MISSING]] = rng.normal(size=(n, len(MAY_BE_MISSING)))
    return x, np.arange(n) % 2 == 0, names


def test_threshold_is_chosen_and_scored_out_of_fold():
    from d2r_edge.detector import best_balanced_threshold, out_of_fold

    x, y, names = _noise()
    det = Detector.fit(x, y, names, "qa", l2=0.1, keys=[f"q{i}" for i in range(len(y))])
    s = det.fit_stats
    assert "balanced_accuracy_at_threshold" not in s and "out of fold" in s["threshold_rule"].replace("-", " ")
    oof = out_of_fold(x, y.astype(float), 0.1, s["folds"], s["fold_seeds"])
    assert det.threshold == best_balanced_threshold(oof, y)[0]
    # on pure noise the in-sample fit separates the 60 queries; out of fold it is near chance
    p_in = det.p_wrong_many(x)
    assert best_balanced_threshold(p_in, y)[1] > 0.8
    assert s["out_of_fold_balanced_accuracy_at_threshold"] < 0.75
    assert det.out_of_fold == {f"q{i}": pytest.approx(v) for i, v in enumerate(oof)}
    # the penalty, when not given, is the grid's value with the lowest out-of-fold log-loss
    auto = Detector.fit(x, y, names, "qa")
    losses = auto.fit_stats["l2_out_of_fold_log_loss"]
    assert len(losses) == 5 and auto.fit_stats["l2"] == float(min(losses, key=losses.get))


def test_threshold_compares_like_with_like():
    from d2r_edge.detector import best_balanced_threshold

    # rounded to 6 decimals, the first two collapse and no threshold separates them
    t, bal = best_balanced_threshold(np.array([0.3000004, 0.3000001, 0.9]), np.array([True, False, True]))
    assert t == 0.3000004 and bal == 1.0


def test_non_finite_inputs_are_refused_or_reported():
    from d2r_edge.eval.detection import auprc, auroc

    x, y, names = _noise()
    bad = x.copy()
    bad[3, names.index("ret_top1")] = np.inf
    with pytest.raises(ConfigError, match="ret_top1"):
        Detector.fit(bad, y, names, "qa")
    bad = x.copy()
    bad[3, names.index("q_ent_max")] = np.nan           # only the log-prob features may be missing
    with pytest.raises(ConfigError, match="q_ent_max"):
        Detector.fit(bad, y, names, "qa")
    with pytest.raises(ConfigError, match="converge"):
        Detector.fit(x, y, names, "qa", l2=1.0, iterations=1)
    det = Detector.fit(x, y, names, "qa", l2=1.0)
    row = x[:1].copy()
    row[0, names.index("ret_gap")] = -np.inf
    with pytest.raises(ValueError, match="ret_gap"):
        det.p_wrong_many(row)
    for metric in (auroc, auprc):
        with pytest.raises(ValueError, match="NaN"):
            metric([0.1, np.nan, 0.3], [True, False, True])


def test_auroc_and_auprc_agree_with_the_definitions():
    from d2r_edge.eval.detection import auprc, auroc

    rng = np.random.default_rng(1)
    s = rng.integers(0, 5, size=40).astype(float)      # many ties
    y = rng.random(40) < 0.4
    pairs = [(a, b) for a in s[y] for b in s[~y]]
    assert auroc(s, y) == pytest.approx(np.mean([1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs]))
    ap = 0.0
    for t in sorted(set(s), reverse=True):
        at = s >= t
        new = s == t
        ap += y[new].sum() / y.sum() * (y[at].sum() / at.sum())
    assert auprc(s, y) == pytest.approx(ap)


# --- detection figures: intervals, per test file, training CV over seeds


class _FakeCtx:
    """What eval.detection reads from a Context: first attempts, scoring, the files queries came from."""

    def __init__(self, out, n_train=60, n_test=80):
        from types import SimpleNamespace

        rng = np.random.default_rng(3)
        self.settings = SimpleNamespace(task=Task.QA, out=out, bootstrap_resamples=300)
        self._wrong, self._att = {}, {}
        qs = []
        for i in range(n_train + n_test):
            q = SimpleNamespace(id=f"q{i}", text=f"question {i}")
            bad = bool(rng.random() < 0.4)
            self._wrong[q.id] = bad
            self._att[q.id] = _attempt(tuple(rng.normal(-1.0 if bad else -0.5, 0.8, size=2)),
                                       top=float(rng.normal()))
            qs.append(q)
        self.train, self.test = qs[:n_train], qs[n_train:]
        self.train_files = {q.id: "distractor.jsonl" for q in self.train}
        self.test_files = {q.id: ("distractor.jsonl" if i % 2 else "fullwiki.jsonl") for i, q in enumerate(self.test)}
        self.pipeline = SimpleNamespace(detector=None)

    def first(self, q):
        return self._att[q.id]

    def score(self, q, answer):
        return (0.0, 0.0) if self._wrong[q.id] else (1.0, 1.0)


def test_detection_rows_carry_intervals_per_test_file_and_warn_on_a_shift(caplog, tmp_path):
    from d2r_edge.eval.detection import detection, fit_detector, train_cross_validation

    ctx = _FakeCtx(tmp_path)
    ctx.pipeline.detector = fit_detector(ctx)
    assert set(ctx.pipeline.detector.out_of_fold) == {q.text for q in ctx.train}
    with caplog.at_level("WARNING"):
        rows = detection(ctx)
    assert "fullwiki.jsonl has no training counterpart" in caplog.text
    pooled = [r for r in rows if "file" not in r]
    assert [r["score"] for r in pooled] == ["alg1_nli", "calibrated"]
    cal = pooled[1]
    assert {r["bootstrap_resamples"] for r in rows} == {300}          # --bootstrap reaches the detection rows
    lo, hi = cal["auroc_ci95"]
    assert lo < cal["auroc"] < hi and 0.0 <= lo and hi <= 1.0
    assert cal["auroc_minus_alg1_nli"]["ci95"][0] < cal["auroc_minus_alg1_nli"]["mean"]
    per_file = {(r["file"], r["score"]): r for r in rows if "file" in r}
    assert set(per_file) == {(f, s) for f in ("distractor.jsonl", "fullwiki.jsonl") for s in ("alg1_nli", "calibrated")}
    assert per_file[("fullwiki.jsonl", "calibrated")]["file_in_training"] is False
    assert sum(per_file[(f, "calibrated")]["n"] for f in ("distractor.jsonl", "fullwiki.jsonl")) == cal["n"]
    cv = train_cross_validation(ctx)
    assert cv["fold_seeds"] == 5 and cv["stratified"] and cv["calibrated_auroc_sd"] > 0


def test_stratified_folds_spread_each_class():
    from d2r_edge.detector import stratified_folds

    y = np.array([True] * 7 + [False] * 23)
    for seed in range(3):
        fold = stratified_folds(y, 5, seed)
        assert {int(np.sum(y[fold == k])) for k in range(5)} <= {1, 2}
        assert {int(np.sum(~y[fold == k])) for k in range(5)} <= {4, 5}


def test_fever_findings_name_the_gated_and_the_pre_gate_first_answer_apart():
    from d2r_edge.eval.report import findings

    summary = {"task": "fever", "n_test": 10, "methods": {},
               "detection": {"score": "alg1_nli", "n": 10, "n_wrong": 4, "flagged": 3, "flagged_wrong": 2,
                             "auroc": 0.7, "auprc": 0.6, "auroc_ci95": [0.5, 0.9]},
               "gate": {"name": "paper"}, "arms_by_failure": {},
               "diagnosis": {"failure_types": {"no_failure": {"n": 7, "first_accuracy": 0.8}},
                             "insufficient_vs_no_gold_retrieved": {"recall": None, "precision": None}}}
    text = "\n".join(findings(summary))
    assert "4 of 10 generator labels (before the UNVERIFIED gate) were wrong" in text
    assert "gated first answer (UNVERIFIED counts as NOT ENOUGH INFO) right in 80%" in text


# --- while a policy trains, the detector's own training queries get their out-of-fold P(wrong)


def test_training_queries_get_out_of_fold_p_wrong_while_the_policy_learns():
    det = top_score_detector()
    p = _pipeline(Gate.CALIBRATED, det)
    in_sample = p.run("wrong clean", learn=False)["p_wrong"]
    assert in_sample > 0.9
    det.out_of_fold["wrong clean"] = 0.2         # what a fit that did not see this query said
    learned = p.run("wrong clean", learn=True)
    assert learned["p_wrong"] == 0.2 and learned["repair"] is None        # the gate reads it too
    frozen = p.run("wrong clean", learn=False)                             # at test time: the fitted model
    assert frozen["p_wrong"] == pytest.approx(in_sample) and frozen["repair"] is not None


def test_the_ablation_finds_the_signal_that_carries_detection(tmp_path):
    """Wrong answers here differ only in their log-probabilities: the log-prob group alone detects them,
    the detector without it does not; a group missing everywhere is skipped, not faked; QA has two labels."""
    from d2r_edge.detector import feature_groups, feature_names
    from d2r_edge.eval.ablation import ablation, variants
    from d2r_edge.eval.report import _ablation_lines

    class Ctx(_FakeCtx):
        def score(self, q, answer):       # a third of the wrong answers are near-misses (F1 0.6)
            if not self._wrong[q.id]:
                return 1.0, 1.0
            return (0.0, 0.6) if int(q.id[1:]) % 3 == 0 else (0.0, 0.0)

    ctx = Ctx(tmp_path, n_train=90, n_test=120)
    for i, q in enumerate(ctx.train + ctx.test):
        ctx.first(q).timings_s.update(diagnose_s=0.02, generate_s=2.0 + (i % 2), retrieve_s=0.01)
    ab = ablation(ctx, cv_seeds=1)
    assert set(ab["labels"]) == {"em_wrong", "f1_below_half"}
    em, f1 = ab["labels"]["em_wrong"], ab["labels"]["f1_below_half"]
    assert f1["n_test_wrong"] < em["n_test_wrong"] and em["n_test"] == 120 and em["n_train"] == 90
    rows = {r["variant"]: r for r in em["rows"]}
    assert list(rows)[:3] == ["alg1_nli", "selected", "all"] and len(rows) == 2 + len(variants(feature_groups(False)))
    assert "log_probs" in rows["selected"]["groups_kept"] and rows["selected"]["auroc"] > 0.65
    assert rows["only log_probs"]["auroc"] > 0.65 and rows["without log_probs"]["auroc"] < 0.6
    lo, hi = rows["only log_probs"]["auroc_ci95"]
    assert lo < rows["only log_probs"]["auroc"] < hi and rows["only log_probs"]["train_cv_auroc"] > 0.6
    assert "missing on every training query" in rows["only self_consistency"]["skipped"]
    assert sorted(n for g in ab["groups"].values() for n in g) == sorted(feature_names(False))
    costs = ab["costs_s"]
    assert costs["answer with log-probs (log_probs, answer)"]["median"] == pytest.approx(2.5)
    assert costs["samples (self_consistency)"] is None                # no samples drawn: no cost claimed
    load = ab["generator_per_query"]
    assert load["samples (self_consistency)"] is None and load["self-check request (self_check)"] is None
    assert load["answer with log-probs (log_probs, answer)"]["requests"] == 1.0
    text = "\n".join(_ablation_lines(ab))
    assert "Label `f1_below_half`" in text and "| only log_probs |" in text


def _log_probs_world(seed: int, n: int):
    """QA features where only the log-probabilities carry the label (40% wrong), the rest noise."""
    from d2r_edge.detector import feature_groups

    names, groups = feature_names(False), feature_groups(False)
    rng = np.random.default_rng(seed)
    y = rng.random(n) < 0.4
    x = rng.normal(size=(n, len(names)))
    for name in groups["log_probs"]:
        x[:, names.index(name)] = np.where(y, -2.0, -0.5) + rng.normal(0, 0.9, size=n)
    return names, groups, rng, y, x


def test_the_detector_chooses_its_signal_groups_on_training_folds(tmp_path):
    """Only the log-probabilities carry the label; 25 noise features beside them: backward elimination
    keeps log_probs, drops noise groups (their weights exactly 0), and the file round-trips."""
    from d2r_edge.eval.detection import auroc

    names, groups, rng, y, x = _log_probs_world(7, 160)
    n = len(y)
    x[rng.random(n) < 0.2, names.index("sc_agreement")] = np.nan          # a missing signal is still fine
    det = Detector.fit(x, y, names, "qa", groups=groups)
    kept, dropped = det.fit_stats["groups_kept"], det.fit_stats["groups_dropped"]
    assert "log_probs" in kept and dropped and set(kept) | set(dropped) == set(groups)
    for g in dropped:
        assert all(det.weights[names.index(m)] == 0.0 for m in groups[g])
    every = Detector.fit(x, y, names, "qa")                               # no choice: every feature weighs
    assert np.count_nonzero(every.weights) > np.count_nonzero(det.weights)
    assert det.fit_stats["out_of_fold_log_loss"] <= every.fit_stats["out_of_fold_log_loss"] + 1e-9
    det.save(tmp_path / "d.json")
    back = Detector.load(tmp_path / "d.json", fact_verification=False)
    assert np.allclose(back.p_wrong_many(x), det.p_wrong_many(x))
    x_new = rng.normal(size=(40, len(names)))
    y_new = rng.random(40) < 0.4
    for name in groups["log_probs"]:
        x_new[:, names.index(name)] = np.where(y_new, -2.0, -0.5) + rng.normal(0, 0.9, size=40)
    assert auroc(det.p_wrong_many(x_new), y_new) > 0.8


def test_a_signal_group_missing_on_every_training_query_is_never_kept():
    """Found from outside (issue 53): with no self-consistency samples drawn, the detector reported the
    self_consistency group as kept (a constant column the elimination never dropped)."""
    names, groups, _, y, x = _log_probs_world(3, 120)
    for name in groups["self_consistency"]:
        x[:, names.index(name)] = np.nan                                   # no samples drawn at all
    det = Detector.fit(x, y, names, "qa", groups=groups)
    s = det.fit_stats
    assert s["groups_missing"] == ["self_consistency"] and "self_consistency" not in s["groups_kept"]
    assert set(s["groups_kept"]) | set(s["groups_dropped"]) == set(groups) - {"self_consistency"}
    assert all(det.weights[names.index(m)] == 0.0 for m in groups["self_consistency"])


def test_a_training_side_too_small_to_select_on_is_said_in_the_fit_and_the_report(caplog):
    """Issue 53: with ~23 right answers on the training side the group choice was noise and nothing said so."""
    from d2r_edge.detector import SELECT_MIN_SMALLER_CLASS
    from d2r_edge.eval.report import _group_choice_lines

    names, groups, _, y, x = _log_probs_world(3, 400)
    big = Detector.fit(x, y, names, "qa", groups=groups).fit_stats
    assert big["selection_smaller_class"] >= SELECT_MIN_SMALLER_CLASS and big["selection_reliable"] is True
    keep = np.flatnonzero(~y)[:SELECT_MIN_SMALLER_CLASS - 20].tolist() + np.flatnonzero(y).tolist()
    with caplog.at_level("WARNING", logger="d2r_edge.detector"):
        small = Detector.fit(x[keep], y[keep], names, "qa", groups=groups).fit_stats
    assert small["selection_smaller_class"] == SELECT_MIN_SMALLER_CLASS - 20 and small["selection_reliable"] is False
    assert "close to noise" in caplog.text
    row = {"score": "calibrated", "fit": small}
    said = " ".join(_group_choice_lines([{"score": "alg1_nli"}, row]))
    assert "too small to select on" in said and str(SELECT_MIN_SMALLER_CLASS - 20) in said
    assert "too small" not in " ".join(_group_choice_lines([{**row, "fit": big}]))
    assert ", ".join(big["groups_kept"]) in " ".join(_group_choice_lines([{**row, "fit": big}]))


def test_per_file_detection_rows_name_files_that_share_a_name_apart():
    # HotpotQA's distractor and fullwiki questions are both dev.jsonl: the per-file table said 'dev.jsonl' twice
    from d2r_edge.eval.report import file_labels

    labels = file_labels(["data/hotpotqa/dev.jsonl", "data/hotpotqa_fullwiki/dev.jsonl", "data/fever/test.jsonl"])
    assert labels == {"data/hotpotqa/dev.jsonl": "hotpotqa/dev.jsonl",
                      "data/hotpotqa_fullwiki/dev.jsonl": "hotpotqa_fullwiki/dev.jsonl",
                      "data/fever/test.jsonl": "test.jsonl"}
    assert file_labels(["a/x.jsonl", "a/x.jsonl"]) == {"a/x.jsonl": "x.jsonl"}


def test_the_arm_table_covers_the_queries_the_gate_repairs():
    """Under the calibrated gate the arm table reads the gated queries (those whose every arm the outcome pass
    computed), with Alg. 1's no_failure as a row; it used to read Alg. 1's flags, and so asked the generator for
    arms of queries no method repairs (new generations in the report phase) while leaving gated ones out."""
    from types import SimpleNamespace

    from d2r_edge.eval.context import Context
    from d2r_edge.eval.report import arm_table
    from d2r_edge.repair import PipelineConfig

    def attempt(failure, answer):
        return SimpleNamespace(diagnosis=SimpleNamespace(failure=failure), answer=answer)

    firsts = {"gated, Alg. 1 clean": attempt(FailureType.NO_FAILURE, "wrong"),
              "not gated, Alg. 1 flags": attempt(FailureType.WRONG_RESPONSE, "wrong")}
    asked = []

    def arm_outcome(q, arm):
        asked.append(q.text)
        return attempt(FailureType.NO_FAILURE, "right"), SimpleNamespace(latency_s=1.0)

    one_arm = np.zeros(len(ARM_NAMES), dtype=bool)
    one_arm[ARM_NAMES.index("dense_k3")] = True
    ctx = SimpleNamespace(
        test=[SimpleNamespace(text=t) for t in firsts], first=lambda q: firsts[q.text],
        repairs=lambda first, training_query=None: first is firsts["gated, Alg. 1 clean"],
        allowed=lambda first: one_arm,
        arm_outcome=arm_outcome, answer=lambda a: a.answer, score=lambda q, ans: (float(ans == "right"), 0.0),
        pipeline=SimpleNamespace(default=PipelineConfig(), effective=lambda cfg: cfg))
    # the real walk over the gated queries' allowed arms, on this stand-in
    ctx.gated_arm_outcomes = lambda queries, training: Context.gated_arm_outcomes(ctx, queries, training)
    table = arm_table(ctx)
    assert asked == ["gated, Alg. 1 clean"]
    assert set(table) == {"no_failure"} and table["no_failure"]["dense_k3"]["fixed"] == 1
