"""The calibrated failure detector: fit, features, file round trip and refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest

from d2r_edge.detector import Detector, feature_names, features
from d2r_edge.diagnose import Diagnosis, Label
from d2r_edge.errors import ConfigError
from d2r_edge.eval.detection import auroc
from d2r_edge.generate.base import Generation
from d2r_edge.pipeline import Attempt
from d2r_edge.retrieval.retriever import Passage
from d2r_edge.signals import Entailment, FailureType, KGStatus


def _fit_data(n=200, seed=0):
    rng = np.random.default_rng(seed)
    names = feature_names(True)
    x = rng.normal(size=(n, len(names)))
    wrong = (x[:, 0] - 0.8 * x[:, 7] + 0.3 * rng.normal(size=n)) > 0
    return x, wrong, names


def test_fit_separates_what_the_features_separate():
    x, wrong, names = _fit_data(n=400)          # 30 features, 28 of them noise
    det = Detector.fit(x, wrong, names, "fever")
    xt, wt, _ = _fit_data(seed=1)
    p = det.p_wrong_many(xt)
    assert auroc(p, wt) > 0.95
    assert 0.0 < det.threshold < 1.0 and det.fit_stats["n"] == 400
    # noise features carry little weight next to the two that decide
    w = np.abs(det.weights)
    assert w[0] > 3 * np.median(w) and w[7] > 3 * np.median(w)


def test_a_fitted_detector_round_trips_through_its_file(tmp_path):
    x, wrong, names = _fit_data()
    det = Detector.fit(x, wrong, names, "fever")
    det.save(tmp_path / "d.json")
    back = Detector.load(tmp_path / "d.json", fact_verification=True)
    np.testing.assert_allclose(back.p_wrong_many(x), det.p_wrong_many(x))
    assert back.threshold == det.threshold and back.names == names


def test_a_detector_with_other_features_is_refused(tmp_path):
    x, wrong, names = _fit_data()
    Detector.fit(x, wrong, names, "fever").save(tmp_path / "d.json")
    with pytest.raises(ConfigError, match="other features"):
        Detector.load(tmp_path / "d.json", fact_verification=False)       # QA computes other features
    raw = json.loads((tmp_path / "d.json").read_text())
    raw["weights"][0] = float("nan")
    (tmp_path / "bad.json").write_text(json.dumps(raw).replace("NaN", "1e999"))
    with pytest.raises(ConfigError, match="non-finite|wrong shape"):
        Detector.load(tmp_path / "bad.json", fact_verification=True)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        Detector.load(tmp_path / "junk.json", fact_verification=True)


def test_fit_refuses_one_class():
    x, _, names = _fit_data()
    with pytest.raises(ConfigError, match="right and wrong"):
        Detector.fit(x, np.zeros(len(x), dtype=bool), names, "fever")


def _attempt(response, label=None, scores=(3.0, 1.0)):
    passages = [Passage(i, f"d{i}", f"Title {i}", text, s) for i, (text, s) in
                enumerate([("Paris is the capital of France .", scores[0]), ("Lyon is a city .", scores[1])])]
    probs = [{"entailment": 0.7, "neutral": 0.2, "contradiction": 0.1},
             {"entailment": 0.1, "neutral": 0.8, "contradiction": 0.1}]
    d = Diagnosis(FailureType.NO_FAILURE, Entailment.ENTAILMENT, Entailment.ENTAILMENT, KGStatus.NO_TRIPLETS,
                  label, label, probs, probs)
    return Attempt(passages, Generation(response, label, response), d, {})


def test_features_of_one_attempt():
    f = features(_attempt("Paris"), fact_verification=False)
    assert set(f) == set(feature_names(False))
    assert f["qa_answer_in_passage"] == 1.0 and f["qa_answer_token_recall"] == 1.0
    assert f["ret_top1"] == 3.0 and f["ret_gap"] == 2.0 and f["n_passages"] == 2.0
    assert f["q_ent_max"] == pytest.approx(0.7) and f["q_bearing_share"] == 0.5 and f["r_entailing_share"] == 0.5
    assert features(_attempt("Marseille"), fact_verification=False)["qa_answer_in_passage"] == 0.0
    # in which passage (issue 53): the first one holding the answer, by retrieval rank; none: one past the last
    assert f["qa_answer_first_rank"] == 0.0
    assert features(_attempt("Lyon"), fact_verification=False)["qa_answer_first_rank"] == 1.0
    assert features(_attempt("Marseille"), fact_verification=False)["qa_answer_first_rank"] == 2.0
    assert features(_attempt("Ly"), fact_verification=False)["qa_answer_first_rank"] == 2.0    # words, not letters
    fv = features(_attempt("Paris is the capital", Label.REFUTES), fact_verification=True)
    assert set(fv) == set(feature_names(True)) and fv["label_refutes"] == 1.0 and fv["label_supports"] == 0.0
