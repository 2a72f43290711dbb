"""Issue 35 §1: the `sample_majority` arm (the first attempt's self-consistency samples, voted) and
samples drawn for the first attempt only (a repair is never gated again, so it pays for none)."""

from __future__ import annotations

import numpy as np

from d2r_edge.budget import CostModel, MemoryProbe, Meter
from d2r_edge.config import Budget, ContextConfig
from d2r_edge.consistency import majority
from d2r_edge.diagnose import Diagnosis, Label
from d2r_edge.generate.base import Generation
from d2r_edge.onnx.manifest import Role
from d2r_edge.pipeline import Pipeline
from d2r_edge.policy import LinUCB
from d2r_edge.policy.features import ContextBuilder
from d2r_edge.repair import ARM_NAMES, ARMS, ArmAvailability, PromptStyle, arm_availability
from d2r_edge.signals import Entailment, FailureType, KGStatus
from d2r_edge.tasks import Task
from stand_ins import RomeRetriever as Retriever

VOTE = ARM_NAMES.index("sample_majority")
ROLES = (Role.NLI, Role.RERANKER, Role.EMBEDDER, Role.TRIPLES, Role.READER)


class AliasNLI:
    labels = ["entailment", "neutral", "contradiction"]

    def score(self, pairs):
        same = lambda a, b: ("kennedy" in a.lower() or "jfk" in a.lower()) and \
            ("kennedy" in b.lower() or "jfk" in b.lower())  # noqa: E731
        return np.array([[0.9, 0.05, 0.05] if same(a, b) else [0.05, 0.9, 0.05] for a, b in pairs])


def test_the_majority_answer_and_its_ties():
    assert majority("q", "Paris", ["Rome", "rome", "Paris"], False) == "Paris"     # 2 : 2, the greedy's
    assert majority("q", "Paris", ["Rome", "Rome."], False) == "Rome"              # the cluster's first member
    assert majority("q", "Paris", ["Rome", "Oslo", "Oslo", "Rome"], False) == "Rome"   # tie without the greedy
    assert majority("c", "SUPPORTS", ["REFUTES", "REFUTES", "SUPPORTS"], True) == "SUPPORTS"
    assert majority("c", "SUPPORTS", ["NOT ENOUGH INFO", "UNVERIFIED", "REFUTES"], True) == "NOT ENOUGH INFO"
    # QA answers that entail each other are one meaning: JFK's cluster (3) beats Nixon's (2)
    assert majority("Who?", "Nixon", ["JFK", "Nixon", "John F. Kennedy", "kennedy"], False, AliasNLI()) == "JFK"
    assert majority("Who?", "Nixon", ["JFK", "Nixon", "John F. Kennedy", "kennedy"], False) == "Nixon"


def test_the_voting_arm_needs_samples():
    off = arm_availability(ROLES)
    assert not off.mask[VOTE] and "--self-consistency" in off.reason(VOTE)
    assert not arm_availability(ROLES, samples=1).mask[VOTE]         # one sample never outvotes the greedy
    on = arm_availability(ROLES, samples=4)
    assert on.mask.all() and on.reason(VOTE) is None


class Sampler:
    """Greedy 'Paris'; samples on request: Rome x3, Paris."""

    name, prompt_sensitive = "sampler", True

    def __init__(self) -> None:
        self.requests: list[tuple[PromptStyle, bool]] = []

    def generate(self, task, style, query, passages, sample=True):
        self.requests.append((style, sample))
        return Generation("Paris", None, '{"answer": "Paris"}', logprobs=(-0.1,),
                          samples=("Rome", "Rome", "Paris", "Rome") if sample else None,
                          samples_s=1.25 if sample else 0.0)


class Diagnoser:
    """Flags 'Paris', passes anything else; records what it was asked to judge."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple | None]] = []

    def diagnose(self, query, passages, response, label, fact_verification, samples=None):
        self.seen.append((response, samples))
        probs = [{"entailment": 0.1, "neutral": 0.8, "contradiction": 0.1}]
        ok = response != "Paris"
        return Diagnosis(FailureType.NO_FAILURE if ok else FailureType.WRONG_RESPONSE, Entailment.ENTAILMENT,
                         Entailment.ENTAILMENT if ok else Entailment.NEUTRAL, KGStatus.NO_TRIPLETS, None, None,
                         probs, probs, consistency={"sc_agreement": 0.0} if samples else None)


def _pipeline(only: str) -> Pipeline:
    ctx = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None))
    mask = np.array([name == only for name in ARM_NAMES])
    return Pipeline(task=Task.QA, retriever=Retriever(), generator=Sampler(), diagnoser=Diagnoser(),
                    policy=LinUCB(len(ARM_NAMES), ctx.dim, 2.0), context=ctx, costs=CostModel(len(ARM_NAMES)),
                    meter=Meter(MemoryProbe(prefer_device=False)), budget=Budget(device_mem_mib=1000.0),
                    arms=ArmAvailability(mask, {}))


def test_the_vote_repairs_without_generating_again():
    p = _pipeline("sample_majority")
    rec = p.run("What is the capital of Italy?", learn=True)
    assert rec["first_answer"] == "Paris" and rec["repair"]["arm"] == "sample_majority"
    assert rec["final_answer"] == "Rome" and rec["final"]["failure"] == "no_failure"
    # one generation (the first, with its samples) and one retrieval: the vote reuses both
    assert p.generator.requests == [(PromptStyle.SIMPLE, True)] and p.retriever.calls == 1
    assert rec["final"]["passages"] == rec["first"]["passages"]
    # the repaired answer is diagnosed with the same samples (its own agreement), and its latency is the vote's
    assert p.diagnoser.seen[-1] == ("Rome", ("Rome", "Rome", "Paris", "Rome"))
    assert rec["repair"]["latency_s"] < 1.0
    assert rec["first"]["timings_s"]["samples_s"] == 1.25 and "samples_s" not in rec["final"]["timings_s"]


def test_a_repair_that_generates_draws_no_samples():
    p = _pipeline("prompt_paraphrase")
    rec = p.run("What is the capital of Italy?", learn=True)
    assert rec["repair"]["arm"] == "prompt_paraphrase"
    assert p.generator.requests == [(PromptStyle.SIMPLE, True), (PromptStyle.PARAPHRASE, False)]
    assert "samples" in rec["first"] and "samples" not in rec["final"]


def test_without_the_first_attempt_at_hand_the_vote_computes_it(tmp_path):
    p = _pipeline("sample_majority")
    a, cost = p.metered_attempt("q", ARMS[VOTE].apply(p.default))
    assert a.generation.response == "Rome" and a.generation.logprobs is None     # not the greedy's tokens
    assert p.generator.requests == [(PromptStyle.SIMPLE, True)]
    # a greedy answer that wins keeps its log-probabilities
    p.generator.generate = lambda task, style, query, passages, sample=True: Generation(
        "Paris", None, "raw", logprobs=(-0.1,), samples=("Paris", "Rome") if sample else None)
    won, _ = p.metered_attempt("q2", ARMS[VOTE].apply(p.default))
    assert won.generation.response == "Paris" and won.generation.logprobs == (-0.1,)


def test_fever_votes_on_labels_and_keeps_the_evidence():
    class FeverSampler(Sampler):
        def generate(self, task, style, query, passages, sample=True):
            self.requests.append((style, sample))
            return Generation("Rome is the capital.", Label.SUPPORTS, "raw",
                              samples=("REFUTES", "REFUTES", "SUPPORTS", "REFUTES") if sample else None)

    p = _pipeline("sample_majority")
    p.task, p.generator = Task.FEVER, FeverSampler()
    a, _ = p.metered_attempt("Rome is not the capital.", ARMS[VOTE].apply(p.default))
    assert a.generation.label is Label.REFUTES and a.generation.response == "Rome is the capital."


def test_the_cache_keys_a_sampled_request_apart_from_a_plain_one(tmp_path):
    from d2r_edge.eval.outcomes import CachedGenerator

    class LLM(Sampler):
        model, base_url, temperature, max_tokens = "m", "http://x", 0.0, 256
        samples, sample_temperature = 4, 0.7

    inner = LLM()
    cache = CachedGenerator(inner, tmp_path / "g.jsonl")
    sampled = cache.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"])
    plain = cache.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"], sample=False)
    assert sampled.samples and plain.samples is None and inner.requests == [(PromptStyle.SIMPLE, True),
                                                                             (PromptStyle.SIMPLE, False)]
    replayed = CachedGenerator(inner, tmp_path / "g.jsonl").generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"])
    assert replayed.samples == sampled.samples and replayed.samples_s == 1.25     # the signal's cost kept
    assert cache.key(Task.QA, PromptStyle.SIMPLE, "q", ["p"]) != cache.key(Task.QA, PromptStyle.SIMPLE, "q", ["p"],
                                                                             sample=False)
    # a plain request of a sampling generator is the request a generator without samples makes
    inner.samples = 0
    assert CachedGenerator(inner, tmp_path / "h.jsonl").key(Task.QA, PromptStyle.SIMPLE, "q", ["p"]) == \
        cache.key(Task.QA, PromptStyle.SIMPLE, "q", ["p"], sample=False)
    cache.close()
