"""The reward's quality from the calibrated detector (`--reward-quality detector`, issue 35): 1 - P(wrong)
of the repaired answer in place of Eq. 2's NF/KG/NLI indicators, with Eq. 2's budget terms unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from stand_ins import StubGenerator, top_score_detector

from d2r_edge.budget import CostModel, MemoryProbe, Meter
from d2r_edge.config import Budget, ContextConfig, RewardConfig, RewardQuality
from d2r_edge.detector import Detector, Gate
from d2r_edge.diagnose import Diagnosis
from d2r_edge.errors import ConfigError, InputError, PolicyError
from d2r_edge.pipeline import Pipeline
from d2r_edge.policy import LinUCB
from d2r_edge.policy.features import ContextBuilder
from d2r_edge.policy.reward import reward
from d2r_edge.repair import ARM_NAMES, PipelineConfig
from d2r_edge.retrieval.retriever import Passage
from d2r_edge.signals import Entailment, FailureType, KGStatus
from d2r_edge.tasks import Task

BUDGET = Budget(latency_s=10.0, device_mem_mib=1000.0)


def test_the_detector_quality_replaces_the_indicators_and_keeps_the_cost_terms():
    det = RewardConfig(quality=RewardQuality.DETECTOR)
    args = dict(no_failure=False, kg_consistent=False, nli_entailed=False, device_mem_mib=0.0, budget=BUDGET)
    assert reward(latency_s=0.0, **args) == 0.0                                  # Eq. 2: every indicator off
    assert reward(latency_s=0.0, cfg=det, p_wrong=0.2, **args) == pytest.approx(0.8)
    assert reward(latency_s=5.0, cfg=det, p_wrong=0.2, **args) == pytest.approx(0.8 * 0.5)   # (1 - 5/10)
    assert reward(latency_s=11.0, cfg=det, p_wrong=0.0, **args) == 0.0           # the budget gate holds
    assert reward(latency_s=11.0, cfg=RewardConfig(RewardQuality.DETECTOR), p_wrong=0.0, **args) == 0.0
    # Eq. 2 ignores a P(wrong) it is given
    assert reward(latency_s=0.0, p_wrong=0.0, **{**args, "nli_entailed": True}) == pytest.approx(0.5)
    for bad in (None, float("nan"), -0.1, 1.5, "0.2"):
        with pytest.raises(PolicyError, match="P\\(wrong\\)"):
            reward(latency_s=0.0, cfg=det, p_wrong=bad, **args)
    assert RewardConfig(quality="detector").quality is RewardQuality.DETECTOR
    with pytest.raises(ConfigError, match="quality"):
        RewardConfig(quality="judge")


# --- a pipeline of stand-ins: Alg. 1 calls every answer a failure; the detector reads the top retrieval
# score, which only the default retrieval (k = 5) gives high (P(wrong) ~ 1); every other config ~ 0


class _Retriever:
    kb = None

    def embed(self, query):
        return np.ones(4)

    def retrieve(self, query, cfg, query_vec=None):
        return [Passage(0, "d0", "T", "some text", 3.0 if cfg.top_k == PipelineConfig().retrieval.top_k else 1.0)]


class _Diagnoser:
    def diagnose(self, query, passages, response, label, fact_verification):
        probs = [{"entailment": 0.1, "neutral": 0.8, "contradiction": 0.1}]
        return Diagnosis(FailureType.WRONG_RESPONSE, Entailment.NEUTRAL, Entailment.NEUTRAL, KGStatus.NO_TRIPLETS,
                         label, label, probs, probs)


def _pipeline(quality: RewardQuality, detector: Detector | None) -> Pipeline:
    ctx = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None))
    return Pipeline(task=Task.FEVER, retriever=_Retriever(), generator=StubGenerator(), diagnoser=_Diagnoser(),
                    policy=LinUCB(len(ARM_NAMES), ctx.dim, 2.0), context=ctx, costs=CostModel(len(ARM_NAMES)),
                    meter=Meter(MemoryProbe(prefer_device=False)), budget=BUDGET, gate=Gate.PAPER,
                    detector=detector, reward_cfg=RewardConfig(quality=quality))


def test_a_repair_the_detector_trusts_earns_reward_where_eq2_gives_none():
    from d2r_edge.repair import ARMS

    det, default_k = top_score_detector(), PipelineConfig().retrieval.top_k
    seen, learner = set(), _pipeline(RewardQuality.DETECTOR, det)    # one policy: it tries other arms in turn
    for i in range(len(ARM_NAMES)):
        query = f"claim {i}"
        paper = _pipeline(RewardQuality.ALG1, det).run(query, learn=True)["repair"]
        assert paper["reward"] == 0.0 and paper["p_wrong_after"] is None and paper["reward_quality"] == "alg1"
        rec = learner.run(query, learn=True)
        rep = rec["repair"]
        assert rec["p_wrong"] > 0.99 and rep["reward_quality"] == "detector"
        # the repaired attempt's own P(wrong), not the first answer's: low where the arm retrieved differently
        other_k = ARMS[rep["arm_index"]].apply(PipelineConfig()).retrieval.top_k != default_k
        assert (rep["p_wrong_after"] < 0.01) is other_k, rep["arm"]
        factor = max(0.0, 1.0 - rep["latency_s"] / BUDGET.latency_s) * max(0.0, 1.0 - rep["mem_growth_mib"] / 1000.0)
        assert rep["reward"] == pytest.approx((1.0 - rep["p_wrong_after"]) * factor)
        seen.add(other_k)
    assert seen == {True, False}        # both kinds of arm were tried


def test_the_detector_reward_without_a_detector_says_how_to_get_one(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--detector FILE"):
        _pipeline(RewardQuality.DETECTOR, None).run("a claim", learn=True)
    from d2r_edge.cli import main

    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "1", "question": "a claim"}\n', encoding="utf-8")
    code = main(["run", "--kb", str(tmp_path / "kb"), "--task", "fever", "--queries", str(queries),
                 "--out", str(tmp_path / "out"), "--reward-quality", "detector"])
    assert code == InputError.exit_code
    assert "--reward-quality detector needs a fitted detector: give --detector FILE" in capsys.readouterr().err
    # serve refuses before it opens the port, for the detector reward and the calibrated gate alike
    for flags, says in ((["--reward-quality", "detector"], "--reward-quality detector needs"),
                        (["--gate", "calibrated"], "--gate calibrated needs")):
        code = main(["serve", "--kb", str(tmp_path / "kb"), "--task", "fever", "--port", "1", *flags])
        assert code == InputError.exit_code
        assert says in capsys.readouterr().err


def test_the_cli_wires_the_flag():
    from d2r_edge.cli import _settings, build_parser

    argv = ["run", "--kb", "k", "--task", "fever", "--queries", "q", "--out", "o"]
    assert _settings(build_parser().parse_args(argv)).reward.quality is RewardQuality.ALG1
    s = _settings(build_parser().parse_args([*argv, "--reward-quality", "detector", "--unweighted"]))
    assert s.reward == RewardConfig(cost_weighting=False, quality=RewardQuality.DETECTOR)
