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


class _Generator:
    name = "stub"

    def generate(self, task, style, query, passages):
        return Generation("some text", Label.SUPPORTS, "raw")


class _Diagnoser:
    def diagnose(self, query, passages, response, label, fact_verification):
        failure = FailureType.WRONG_RESPONSE if "flagged" in query else FailureType.NO_FAILURE
        e_r = Entailment.NEUTRAL if "flagged" in query else Entailment.ENTAILMENT
        probs = [{"entailment": 0.5, "neutral": 0.3, "contradiction": 0.2}]
        return Diagnosis(failure, Entailment.ENTAILMENT, e_r, KGStatus.NO_TRIPLETS, label, label, probs, probs)


def _detector() -> Detector:
    names = feature_names(True)
    w = np.zeros(len(names))
    w[names.index("ret_top1")] = 5.0
    return Detector(names, "fever", np.zeros(len(names)), np.ones(len(names)), w, -10.0, 0.5)


def _pipeline(gate: Gate, detector: Detector | None) -> Pipeline:
    ctx = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None, p_wrong=gate is Gate.CALIBRATED))
    return Pipeline(task=Task.FEVER, retriever=_Retriever(), generator=_Generator(), diagnoser=_Diagnoser(),
                    policy=LinUCB(len(ARM_NAMES), ctx.dim, 2.0), context=ctx, costs=CostModel(len(ARM_NAMES)),
                    meter=Meter(MemoryProbe(prefer_device=False)), gate=gate, detector=detector)


CASES = {"wrong flagged": (True, True), "wrong clean": (False, True),
         "right flagged": (True, False), "right clean": (False, False)}   # query -> (paper, calibrated)


@pytest.mark.parametrize("gate", list(Gate))
def test_each_gate_repairs_what_it_should(gate):
    p = _pipeline(gate, _detector())
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
        assert all(rec["detector_signals"][n] is None for n in MAY_BE_MISSING)
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
    assert f["gen_logprob_mean"] == pytest.approx(-0.8)
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
    j = det.names.index("gen_logprob_mean")
    assert det.fit_stats["missing_share"]["gen_logprob_mean"] == pytest.approx(1 / 3)
    assert det.impute[j] == pytest.approx(np.nanmean(x[:, j]))
    p = det.p_wrong_many(x)
    present = ~np.isnan(x[:, j])
    assert np.all(np.isfinite(p))
    assert np.mean((p[present] >= 0.5) == np.array(wrong)[present]) > 0.95
    det.save(tmp_path / "d.json")
    back = Detector.load(tmp_path / "d.json", fact_verification=False)
    np.testing.assert_allclose(back.p_wrong_many(x), p)
    raw = json.loads((tmp_path / "d.json").read_text())
    assert raw["format"] == "d2r-edge-detector/2" and "gen_logprob_min" in raw["features"]
    raw["format"] = "d2r-edge-detector/1"       # a file of the version without these features
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
    toks = (('{"', -0.01), ("answer", -0.02), ('":', -0.01), (' "', -0.05), ("Par", -1.5), ("is", -0.5),
            ('"}', -0.01))
    assert answer_logprobs(toks, "Paris") == (-1.5, -0.5)
    assert answer_logprobs(toks, "London") == tuple(lp for _, lp in toks)     # not found: every token
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
