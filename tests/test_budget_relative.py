"""A budget relative to the generator: a repair action may take `latency_x` times the query's own
first attempt (issue 35 §2), alone or capped by the absolute seconds, in run, eval and serve."""

from __future__ import annotations

import numpy as np
import pytest

from d2r_edge.budget import CostModel, MemoryProbe, Meter
from d2r_edge.config import Budget, ContextConfig, RewardConfig
from d2r_edge.diagnose import Diagnosis, Label
from d2r_edge.errors import ConfigError
from d2r_edge.generate.base import Generation
from d2r_edge.pipeline import Pipeline, attempt_seconds
from d2r_edge.policy import LinUCB
from d2r_edge.policy.features import ContextBuilder
from d2r_edge.policy.reward import reward
from d2r_edge.repair import ARM_NAMES
from d2r_edge.retrieval.retriever import Passage
from d2r_edge.signals import Entailment, FailureType, KGStatus
from d2r_edge.tasks import Task


def test_the_bound_is_x_times_the_first_attempt_capped_by_the_seconds():
    rel = Budget(latency_s=None, latency_x=2.0)
    assert rel.relative and rel.for_attempt(1.5).latency_s == pytest.approx(3.0)
    assert not rel.for_attempt(1.5).relative and rel.for_attempt(1.5).device_mem_mib == 6.0
    capped = Budget(latency_s=5.0, latency_x=2.0)
    assert capped.for_attempt(1.0).latency_s == pytest.approx(2.0)       # the relative bound is smaller
    assert capped.for_attempt(4.0).latency_s == pytest.approx(5.0)       # the cap is smaller
    assert Budget().for_attempt(10.0) == Budget()                        # absolute: unchanged
    assert rel.for_attempt(0.0).latency_s > 0 and rel.for_attempt(float("nan")).latency_s > 0
    half = capped.scaled(0.5)
    assert (half.latency_s, half.latency_x, half.device_mem_mib) == (2.5, 1.0, 3.0)
    assert rel.describe() == {"latency_s": None, "device_mem_mib": 6.0, "latency_x": 2.0}
    assert capped.describe(1.0) == {"latency_s": 2.0, "device_mem_mib": 6.0, "latency_x": 2.0,
                                    "first_attempt_s": 1.0, "latency_s_cap": 5.0}
    assert Budget().describe(1.0) == {"latency_s": 3.0, "device_mem_mib": 6.0}     # records as before
    for bad in ({"latency_s": None}, {"latency_x": 0.0}, {"latency_x": float("inf")}, {"latency_x": -1.0}):
        with pytest.raises(ConfigError):
            Budget(**bad)


def test_an_unresolved_relative_budget_is_refused_where_a_bound_is_needed():
    rel = Budget(latency_s=3.0, latency_x=2.0)
    with pytest.raises(ConfigError, match="for_attempt"):
        reward(no_failure=True, kg_consistent=True, nli_entailed=True, latency_s=1.0, device_mem_mib=1.0,
               budget=rel, cfg=RewardConfig())
    with pytest.raises(ConfigError, match="for_attempt"):
        CostModel(3).mask(rel)
    ctx = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None))
    with pytest.raises(ConfigError, match="for_attempt"):
        ctx.build(np.ones(4), FailureType.NO_FAILURE, KGStatus.NO_TRIPLETS, Entailment.ENTAILMENT,
                  Entailment.ENTAILMENT, 1.0, 1.0, rel)


# --- a pipeline whose generator "takes" FIRST_S per answer (a replayed cache answer's recorded time)

FIRST_S = 2.0


class _Retriever:
    kb = None

    def embed(self, query):
        return np.ones(4)

    def retrieve(self, query, cfg, query_vec=None):
        return [Passage(0, "d0", "T", "some text", 1.0)]


class _Generator:
    name = "stub"

    def generate(self, task, style, query, passages, sample=True):
        return Generation("some text", Label.SUPPORTS, "raw", replayed_s=FIRST_S)


class _Diagnoser:
    """The first answer is flagged, the repaired one entailed (so a repair within budget earns reward)."""

    def __init__(self) -> None:
        self.calls = 0

    def diagnose(self, query, passages, response, label, fact_verification):
        self.calls += 1
        probs = [{"entailment": 0.2, "neutral": 0.7, "contradiction": 0.1}]
        if self.calls % 2:
            return Diagnosis(FailureType.WRONG_RESPONSE, Entailment.ENTAILMENT, Entailment.NEUTRAL,
                             KGStatus.NO_TRIPLETS, label, label, probs, probs)
        return Diagnosis(FailureType.NO_FAILURE, Entailment.ENTAILMENT, Entailment.ENTAILMENT,
                         KGStatus.NO_TRIPLETS, label, label, probs, probs)


def _pipeline(budget: Budget, slow_arm: int) -> Pipeline:
    ctx = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None))
    costs = CostModel(len(ARM_NAMES))
    for arm in range(len(ARM_NAMES)):          # known costs: one arm takes 3.5 s, every other 0.5 s
        for _ in range(3):
            costs.observe(arm, 3.5 if arm == slow_arm else 0.5, 0.0)
    return Pipeline(task=Task.FEVER, retriever=_Retriever(), generator=_Generator(), diagnoser=_Diagnoser(),
                    policy=LinUCB(len(ARM_NAMES), ctx.dim, 2.0), context=ctx, costs=costs,
                    meter=Meter(MemoryProbe(prefer_device=False)), budget=budget)


@pytest.mark.parametrize("x, masked", [(1.5, True), (2.0, False)])
def test_cost_masking_follows_the_query_s_own_first_attempt(x, masked):
    slow = 3
    rec = _pipeline(Budget(latency_s=None, device_mem_mib=1000.0, latency_x=x), slow).run("a claim", learn=True)
    repair = rec["repair"]
    first_s = sum(rec["first"]["timings_s"].get(k, 0.0) for k in ("embed_query_s", "refresh_s", "retrieve_s",
                                                                    "generate_s", "diagnose_s"))
    assert first_s >= FIRST_S
    b = repair["budget"]
    assert b["latency_x"] == x and b["first_attempt_s"] == pytest.approx(first_s)
    assert b["latency_s"] == pytest.approx(x * first_s) and b["latency_s_cap"] is None
    # 1.5 x ~2 s = ~3 s: the 3.5 s arm is masked; 2 x ~2 s = ~4 s: it fits
    assert (ARM_NAMES[slow] in repair["cost_masked"]) is masked
    # the repair itself took ~FIRST_S (the generator again): within both bounds
    assert repair["latency_s"] >= FIRST_S and repair["over_budget"] is False and repair["reward"] > 0


def test_the_cap_and_the_absolute_budget_still_hold():
    rec = _pipeline(Budget(latency_s=1.0, device_mem_mib=1000.0, latency_x=3.0), 0).run("a claim", learn=True)
    r = rec["repair"]
    assert r["budget"]["latency_s"] == 1.0 and r["budget"]["latency_s_cap"] == 1.0
    assert r["over_budget"] is True and r["reward"] == 0.0     # ~2 s against 1 s: the gate of Eq. 2
    plain = _pipeline(Budget(latency_s=3.0, device_mem_mib=1000.0), 0).run("a claim", learn=True)["repair"]
    assert plain["budget"] == {"latency_s": 3.0, "device_mem_mib": 1000.0}


def _cli_budget(*argv):
    from d2r_edge.cli import _budget, build_parser

    argv = ["run", "--kb", "k", "--task", "fever", "--queries", "q", "--out", "o", *argv]
    return _budget(build_parser().parse_args(argv))


def test_the_cli_composes_the_flags():
    assert _cli_budget() == Budget()
    assert _cli_budget("--budget-latency-x", "2") == Budget(latency_s=None, latency_x=2.0)
    assert _cli_budget("--budget-latency-x", "2", "--budget-latency-s", "10") == Budget(10.0, 6.0, 2.0)
    assert _cli_budget("--budget-preset", "relaxed", "--budget-latency-x", "1.5") == Budget(4.5, 9.0, 1.5)
    with pytest.raises(ConfigError, match="latency_x"):
        _cli_budget("--budget-latency-x", "0")


def test_an_llm_generator_defaults_to_a_budget_relative_to_its_first_attempt():
    # issue 35 §2: the paper's 3 s stays the extractive default; an LLM server gets 1.5x its own first attempt
    assert _cli_budget("--generator", "extractive") == Budget()
    llm = _cli_budget("--generator", "openai")
    assert llm == Budget(latency_s=None, latency_x=1.5)
    assert llm.for_attempt(4.0).latency_s == pytest.approx(6.0)
    assert _cli_budget("--generator", "openai", "--budget-mem-mib", "2").device_mem_mib == 2.0
    # any latency flag replaces the default, as before
    assert _cli_budget("--generator", "openai", "--budget-latency-s", "10") == Budget(10.0, 6.0, None)
    assert _cli_budget("--generator", "openai", "--budget-latency-x", "3") == Budget(None, 6.0, 3.0)
    assert _cli_budget("--generator", "openai", "--budget-preset", "paper") == Budget()


def test_attempt_seconds_is_the_sum_of_the_stages():
    from d2r_edge.pipeline import Attempt

    a = Attempt([], Generation("x", None, "x"), None,
                {"embed_query_s": 0.1, "retrieve_s": 0.2, "generate_s": 1.0, "diagnose_s": 0.3,
                 "refresh_s": 0.0, "mem_growth_mib": 50.0, "refresh_docs": 7.0})
    assert attempt_seconds(a) == pytest.approx(1.6)


def test_serve_reports_the_request_s_own_bound():
    from types import SimpleNamespace

    from d2r_edge.serve.openai_api import _repair_bounds

    res = SimpleNamespace(record={"first": {"timings_s": {"embed_query_s": 0.5, "generate_s": 1.0,
                                                          "diagnose_s": 0.5, "mem_growth_mib": 99.0}}})
    assert _repair_bounds(res, Budget(latency_s=None, latency_x=1.5)) == {
        "repair_latency_s": pytest.approx(3.0), "repair_device_mem_mib": 6.0, "repair_latency_x": 1.5,
        "repair_latency_s_cap": None}
    assert _repair_bounds(res, Budget()) == {"repair_latency_s": 3.0, "repair_device_mem_mib": 6.0}
    assert _repair_bounds(SimpleNamespace(record={}), Budget(latency_s=2.0, latency_x=3.0))["repair_latency_s"] > 0
