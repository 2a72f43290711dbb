"""Trust marks and abstention: `calibrate` writes a certificate, run/serve/Runtime judge every answer by it.

- an untrusted first answer is offered a repair even where the gate would not, and
  the final answer is judged again; with --abstain one still untrusted is withheld
  (FEVER: NOT ENOUGH INFO; QA: the configured text), the withheld answer recorded;
- `d2r-edge calibrate` reads run records with gold and detector signals, leaves
  out the detector's own training queries, and refuses too few labeled answers
  with how many it would take.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from stand_ins import ScoreByCall, StubGenerator, top_score_detector

from d2r_edge.budget import CostModel, MemoryProbe, Meter
from d2r_edge.cli import main
from d2r_edge.config import ContextConfig
from d2r_edge.detector import Detector, Gate, feature_names, query_hash
from d2r_edge.diagnose import Diagnosis
from d2r_edge.errors import ConfigError
from d2r_edge.pipeline import Pipeline
from d2r_edge.policy import LinUCB
from d2r_edge.policy.features import ContextBuilder
from d2r_edge.repair import ARM_NAMES
from d2r_edge.selective import Certificate, file_sha256
from d2r_edge.signals import Entailment, FailureType, KGStatus
from d2r_edge.tasks import Task


def _retriever() -> ScoreByCall:
    """The query's words set the top score the detector reads: "wrong" -> P(wrong) ~ 0.99; the repair
    (the second retrieval) of a "fixable" query finds a passage the detector trusts."""
    return ScoreByCall(lambda q, n: 3.0 if "wrong" in q and (n == 1 or "fixable" not in q) else 1.0)


class _Diagnoser:
    def diagnose(self, query, passages, response, label, fact_verification):
        probs = [{"entailment": 0.5, "neutral": 0.3, "contradiction": 0.2}]
        return Diagnosis(FailureType.NO_FAILURE, Entailment.ENTAILMENT, Entailment.ENTAILMENT, KGStatus.NO_TRIPLETS,
                         label, label, probs, probs)


def _cert(threshold: float = 0.5) -> Certificate:
    return Certificate("calibrated", 0.2, 0.1, threshold, 200, 80, 10, 0.4, 0.001)


def _pipeline(trust=None, abstain_text=None, detector="default") -> Pipeline:
    ctx = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None))
    return Pipeline(task=Task.FEVER, retriever=_retriever(), generator=StubGenerator(), diagnoser=_Diagnoser(),
                    policy=LinUCB(len(ARM_NAMES), ctx.dim, 2.0), context=ctx, costs=CostModel(len(ARM_NAMES)),
                    meter=Meter(MemoryProbe(prefer_device=False)), gate=Gate.PAPER,
                    detector=top_score_detector() if detector == "default" else detector,
                    trust=trust, abstain_text=abstain_text)


def test_without_a_certificate_nothing_is_judged():
    rec = _pipeline().run("a wrong claim", learn=False)
    assert "trusted" not in rec and "abstained" not in rec and rec["repair"] is None   # Alg. 1 saw no failure


def test_a_trusted_first_answer_stands_and_says_so():
    rec = _pipeline(_cert(), "withheld").run("a right claim", learn=False)
    assert rec["trusted"] is True and rec["abstained"] is False and rec["repair"] is None
    assert rec["trust"] == {"p_wrong": pytest.approx(rec["p_wrong"]), "epsilon": 0.2, "delta": 0.1,
                            "threshold": 0.5, "judged": "first", "certified": True}
    assert rec["final_answer"] == "SUPPORTS"


def test_an_untrusted_answer_is_repaired_then_judged_again_and_withheld_only_if_still_untrusted():
    p = _pipeline(_cert(), "withheld")
    still = p.run("a wrong claim", learn=False)
    # Alg. 1 saw no failure, the certificate did not trust it: a repair was offered anyway
    assert still["repair"] is not None and still["repair_reason"] == "untrusted"
    assert still["trusted"] is False and still["abstained"] is True
    assert still["final_answer"] == "NOT ENOUGH INFO" and still["answer_withheld"] == "SUPPORTS"
    assert still["trust"]["judged"] == "repaired" and still["trust"]["certified"] is False
    assert still["trust"]["p_wrong"] > 0.9


def test_a_repair_that_earns_trust_is_delivered():
    rec = _pipeline(_cert(), "withheld").run("a wrong fixable claim", learn=False)
    assert rec["repair"] is not None and rec["trust"]["p_wrong"] < 0.5
    assert rec["trusted"] is True and rec["abstained"] is False and rec["final_answer"] == "SUPPORTS"
    assert rec["trust"]["judged"] == "repaired" and rec["trust"]["certified"] is False


def test_marks_without_abstention_keep_the_answer():
    rec = _pipeline(_cert()).run("a wrong claim", learn=False)
    assert rec["trusted"] is False and rec["abstained"] is False and rec["final_answer"] == "SUPPORTS"


def test_a_certificate_needs_its_detector_and_abstention_needs_a_certificate():
    with pytest.raises(ConfigError, match="--detector"):
        _pipeline(_cert(), detector=None)
    with pytest.raises(ConfigError, match="--trust"):
        _pipeline(None, "withheld")


def _qa_detector(path, bias: float) -> Detector:
    names = feature_names(False)
    det = Detector(names, "qa", np.zeros(len(names)), np.ones(len(names)), np.zeros(len(names)), bias, 0.5)
    det.save(path)
    return det


def test_runtime_abstains_on_qa_with_the_configured_text(demo_kb, tiny_models, tmp_path):
    from stand_ins import demo_questions, make_runtime

    det = tmp_path / "detector.json"
    _qa_detector(det, 5.0)                 # P(wrong) 0.993 for every answer: nothing is trusted
    cert = Certificate("calibrated", 0.2, 0.1, 0.5, 200, 80, 10, 0.4, 0.001, detector_sha256=file_sha256(det))
    cert.save(tmp_path / "trust.json")
    rt = make_runtime(demo_kb, tiny_models, detector_path=det, trust_path=tmp_path / "trust.json",
                      abstain_text="no reliable answer")
    res = rt.answer(demo_questions()[0])
    assert res.trusted is False and res.abstained is True and res.answer == "no reliable answer"
    assert res.record["answer_withheld"] and res.record["trust"]["threshold"] == 0.5
    from d2r_edge.serve.openai_api import d2r_object

    obj = d2r_object(res, rt.pipeline.budget, None)
    assert obj["trusted"] is False and obj["abstained"] is True and obj["trust"]["epsilon"] == 0.2
    # a certificate calibrated on another detector is refused at load
    _qa_detector(det, 4.0)
    with pytest.raises(ConfigError, match="another detector"):
        make_runtime(demo_kb, tiny_models, detector_path=det, trust_path=tmp_path / "trust.json")


def _records(n: int, seed: int, path) -> None:
    """Run records whose top retrieval score (the detector's input) predicts a wrong first answer."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for i in range(n):
            s = float(rng.uniform())
            signals = {k: 0.0 for k in feature_names(True)}
            signals["ret_top1"] = 1.0 + 2.0 * s          # P(wrong) = sigmoid(5 * ret_top1 - 10)
            fh.write(json.dumps({"id": str(i), "epoch": None, "query": f"claim {i}", "final_answer": "SUPPORTS",
                                 "first_correct": bool(rng.uniform() > s * s), "detector_signals": signals,
                                 "error": None}) + "\n")
        fh.write(json.dumps({"id": "x", "epoch": None, "query": "no gold", "final_answer": "SUPPORTS",
                             "first_correct": None, "detector_signals": signals, "error": None}) + "\n")


def test_calibrate_writes_a_certificate_bound_to_its_detector(tmp_path, capsys):
    det = tmp_path / "detector.json"
    d = top_score_detector()
    d.fit_stats = {"training_queries_sha256_16": [query_hash("claim 0"), query_hash("claim 1")]}
    d.save(det)
    _records(600, 0, tmp_path / "records.jsonl")
    args = ["calibrate", "--records", str(tmp_path / "records.jsonl"), "--detector", str(det), "--task", "fever",
            "--target-error", "0.2", "--out", str(tmp_path / "trust.json")]
    assert main(args) == 0
    cert = Certificate.load(tmp_path / "trust.json", det)
    assert cert.n_calibration == 598 and cert.epsilon == 0.2 and cert.delta == 0.1     # 2 training, 1 no gold
    assert cert.errors_trusted / cert.n_trusted < 0.2 and 0 < cert.coverage_calibration < 1
    out = capsys.readouterr().out
    assert "2 queries the detector was fitted on" in out and "1 without gold" in out
    # 20 labeled answers cannot certify 5%: refused, with the count it would take
    _records(20, 1, tmp_path / "few.jsonl")
    args[2], args[8] = str(tmp_path / "few.jsonl"), "0.05"
    assert main(args) != 0
    assert "labeled queries" in capsys.readouterr().err
