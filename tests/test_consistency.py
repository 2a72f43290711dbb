"""Self-consistency: samples drawn by the OpenAI-compatible client, clustered by string and by
bidirectional NLI entailment, carried through the diagnosis, the stores and into the detector."""

from __future__ import annotations

import math

import numpy as np
import pytest

from d2r_edge.consistency import clusters, signals
from d2r_edge.detector import features
from d2r_edge.diagnose import Diagnoser, Label
from d2r_edge.generate.base import Generation
from d2r_edge.generate.openai_compat import OpenAICompatible
from d2r_edge.pipeline import Attempt
from d2r_edge.repair import PromptStyle
from d2r_edge.retrieval.retriever import Passage
from d2r_edge.signals import KGStatus
from d2r_edge.tasks import Task


class PairNLI:
    """Entailment exactly when both texts name the same person (a fixed list of aliases); label order
    not entailment-first, as a real model's need not be."""

    labels = ["neutral", "entailment", "contradiction"]
    SAME = [{"jfk", "john f. kennedy", "kennedy"}]

    def __init__(self) -> None:
        self.pairs: list[tuple[str, str]] = []

    def score(self, pairs):
        self.pairs += pairs
        out = []
        for a, b in pairs:
            same = any(any(x in a.lower() for x in g) and any(x in b.lower() for x in g) for g in self.SAME)
            out.append([0.1, 0.8, 0.1] if same else [0.8, 0.1, 0.1])
        return np.array(out, dtype=np.float32)


def test_unanimous_samples_agree_fully():
    assert signals("q", "Paris", ["paris", "Paris.", "the Paris"], False) == {
        "sc_agreement": 1.0, "sc_clusters": 1.0, "sc_entropy": 0.0}
    fever = signals("claim", "SUPPORTS", ["supports", "SUPPORTS"], True)
    assert fever["sc_agreement"] == 1.0 and fever["sc_clusters"] == 1.0


def test_scattered_samples_and_their_entropy():
    s = signals("q", "Paris", ["London", "paris", "Rome"], False)
    assert s["sc_agreement"] == pytest.approx(1 / 3) and s["sc_clusters"] == 3.0
    assert s["sc_entropy"] == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    # FEVER: UNVERIFIED / unparsable count as NOT ENOUGH INFO, as the scorer reads them
    assert signals("c", "NOT ENOUGH INFO", ["UNVERIFIED", "REFUTES"], True)["sc_agreement"] == 0.5
    assert signals("q", "Paris", None, False) is None and signals("q", "Paris", (), False) is None


def test_answers_that_entail_each_other_are_one_meaning():
    nli = PairNLI()
    ids = clusters("Who was president?", ["JFK", "John F. Kennedy", "Nixon", "jfk"], False, nli)
    assert ids[0] == ids[1] == ids[3] != ids[2]
    # each direction asked, in the question's context
    assert ("Who was president? JFK", "Who was president? John F. Kennedy") in nli.pairs
    assert ("Who was president? John F. Kennedy", "Who was president? JFK") in nli.pairs
    s = signals("Who was president?", "JFK", ["John F. Kennedy", "Nixon"], False, nli)
    assert s["sc_agreement"] == 0.5 and s["sc_clusters"] == 2.0
    # FEVER labels are compared as labels: the NLI is not asked
    nli.pairs.clear()
    assert clusters("c", ["SUPPORTS", "REFUTES"], True, nli) == [0, 1] and not nli.pairs


def _reply(content: str) -> dict:
    return {"choices": [{"message": {"content": content}}]}


def test_the_client_draws_samples_at_a_temperature_with_seeds():
    from stand_ins import ScriptedServer

    with ScriptedServer() as srv:
        client = OpenAICompatible(srv.url, "m", max_retries=0, samples=2, sample_temperature=0.9)
        srv.replies += [(200, _reply('{"answer": "Paris"}')), (200, _reply('{"answer": "London"}')),
                        (200, _reply('{"answer": "Paris"}'))]
        g = client.generate(Task.QA, PromptStyle.SIMPLE, "Capital of France?", ["p"])
        assert g.response == "Paris" and g.samples == ("London", "Paris") and g.samples_s > 0
        greedy, *drawn = srv.seen
        assert greedy["temperature"] == 0.0 and "seed" not in greedy and greedy["logprobs"] is True
        assert [d["temperature"] for d in drawn] == [0.9, 0.9] and [d["seed"] for d in drawn] == [0, 1]
        assert all("logprobs" not in d for d in drawn)                     # samples need no log-probs
        assert all(d["messages"] == greedy["messages"] for d in drawn)     # the same prompt: cached prefix
        srv.replies += [(200, _reply('{"label": "SUPPORTS", "response": "x"}')), (200, _reply("garbage")),
                        (200, _reply('{"label": "refutes"}'))]
        f = client.generate(Task.FEVER, PromptStyle.SIMPLE, "claim", ["p"])
        assert f.label is Label.SUPPORTS and f.samples == ("NOT ENOUGH INFO", "REFUTES")
        plain = OpenAICompatible(srv.url, "m", max_retries=0)
        srv.replies.append((200, _reply('{"answer": "Paris"}')))
        assert plain.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"]).samples is None
        srv.replies.append((200, _reply('{"answer": "Paris"}')))          # a repair's request: no samples
        unsampled = client.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"], sample=False)
        assert unsampled.samples is None and unsampled.samples_s == 0.0 and not srv.replies


class _KG:
    def check(self, response):
        from d2r_edge.kg.check import KGResult

        return KGResult(KGStatus.NO_TRIPLETS)


def test_the_diagnosis_carries_the_signals_into_records_stores_and_the_detector(tmp_path):
    from d2r_edge.eval.outcomes import CachedGenerator, attempt_from_json, attempt_to_json

    d = Diagnoser(PairNLI(), _KG()).diagnose("Who was president?", ["p1"], "JFK", None, False,
                                                samples=("John F. Kennedy", "Nixon", "JFK"))
    assert d.consistency == pytest.approx({"sc_agreement": 2 / 3, "sc_clusters": 2.0,
                                           "sc_entropy": -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))})
    a = Attempt([Passage(0, "d", "T", "text", 1.0)],
                Generation("JFK", None, "raw", samples=("John F. Kennedy", "Nixon", "JFK")), d, {})
    f = features(a, fact_verification=False)
    assert f["sc_agreement"] == pytest.approx(2 / 3) and f["sc_clusters"] == 2.0
    assert a.summary()["consistency"] == d.consistency and a.summary()["samples"] == ["John F. Kennedy", "Nixon",
                                                                                        "JFK"]
    chunks = [{"chunk_id": 0, "doc_id": "d", "title": "T", "text": "text"}]
    back = attempt_from_json(attempt_to_json(a), chunks)
    assert back.diagnosis.consistency == d.consistency and back.generation.samples == a.generation.samples
    # without samples: missing, never made up
    plain = Diagnoser(PairNLI(), _KG()).diagnose("q", ["p1"], "JFK", None, False)
    assert plain.consistency is None
    f = features(Attempt(a.passages, Generation("JFK", None, "raw"), plain, {}), fact_verification=False)
    assert all(math.isnan(f[n]) for n in ("sc_agreement", "sc_clusters", "sc_entropy"))

    class Sampler:
        name, model, base_url, temperature, max_tokens = "openai", "m", "http://x", 0.0, 256
        samples, sample_temperature, calls = 2, 0.7, 0

        def generate(self, task, style, query, passages, sample=True):
            self.calls += 1
            return Generation("Paris", None, "raw", samples=("Paris", "Rome"))

    inner = Sampler()
    cache = CachedGenerator(inner, tmp_path / "g.jsonl")
    assert cache.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"]).samples == ("Paris", "Rome")
    cache.close()
    again = CachedGenerator(inner, tmp_path / "g.jsonl")
    assert again.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"]).samples == ("Paris", "Rome")
    assert inner.calls == 1
    again.close()
    inner.samples = 4                    # another sampling setting is another request
    other = CachedGenerator(inner, tmp_path / "g.jsonl")
    other.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"])
    assert inner.calls == 2
    other.close()


def test_a_changed_prompt_template_is_another_request(tmp_path, monkeypatch):
    """Answers cached for one prompt are never replayed for another (issue 35's prompt work changes it)."""
    import d2r_edge.tasks as tasks
    from d2r_edge.eval.outcomes import CachedGenerator

    class LLM:
        name, model, calls = "llm", "m", 0

        def generate(self, task, style, query, passages, sample=True):
            self.calls += 1
            return Generation("Paris", None, "raw")

    inner = LLM()
    cache = CachedGenerator(inner, tmp_path / "g.jsonl")
    cache.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"])
    cache.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"])
    assert inner.calls == 1
    before = cache.key(Task.QA, PromptStyle.SIMPLE, "q", ["p"])
    real = tasks._templates()
    edited = {k: dict(v) for k, v in real.items()}
    edited["qa"]["simple"] = real["qa"]["simple"] + "\nAnswer in one word."
    monkeypatch.setattr(tasks, "_templates", lambda: edited)
    assert cache.key(Task.QA, PromptStyle.SIMPLE, "q", ["p"]) != before
    assert cache.key(Task.QA, PromptStyle.PARAPHRASE, "q", ["p"]) != before    # unchanged style: its own key
    cache.generate(Task.QA, PromptStyle.SIMPLE, "q", ["p"])
    assert inner.calls == 2
    cache.close()


def test_samples_need_an_llm_generator(tmp_path):
    from d2r_edge.app import RunSettings
    from d2r_edge.errors import ConfigError

    with pytest.raises(ConfigError, match="--generator openai"):
        RunSettings(kb=tmp_path, models=tmp_path, task=Task.QA, self_consistency=3)
    with pytest.raises(ConfigError, match="sample_temperature"):
        OpenAICompatible("http://127.0.0.1:1/v1", "m", samples=2, sample_temperature=0.0)
    s = RunSettings(kb=tmp_path, models=tmp_path, task=Task.QA, generator="openai", self_consistency=3,
                    sample_temperature=0.5)
    from d2r_edge.generate.registry import Encoders, build_generator

    g = build_generator("openai", s, Encoders(None, None, None))
    assert g.samples == 3 and g.sample_temperature == 0.5
