"""The self-check signal (issue 53): the same model's P(True) that its answer is right.

- read from the first token's top log-probabilities of one more request, normalized
  over True and False; a server without log-probabilities, or a reply where neither
  word is among the alternatives, leaves it missing (never 0.5);
- the request reuses the answer prompt's passages and query, asks without JSON mode,
  for one token; a failed self-check loses the signal, not the answer;
- it travels through the generation cache and the attempt store, becomes the
  detector's `self_check` group, and a cache row without it never answers a run
  that asks for it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from stand_ins import ScriptedServer

from d2r_edge.detector import MAY_BE_MISSING, feature_groups, feature_names, features
from d2r_edge.generate.openai_compat import OpenAICompatible, p_true_from_top
from d2r_edge.repair import PromptStyle
from d2r_edge.tasks import Task


def _answer(content: str) -> dict:
    return {"choices": [{"message": {"content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3}}


def _verdict(top: list[tuple[str, float]] | None) -> dict:
    first = {"token": top[0][0] if top else "True", "logprob": top[0][1] if top else -0.1,
             **({"top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]} if top is not None else {})}
    return {"choices": [{"message": {"content": first["token"]}, "finish_reason": "length",
                         "logprobs": {"content": [first]}}], "usage": {"prompt_tokens": 12, "completion_tokens": 1}}


def test_p_true_normalizes_over_the_two_words_and_is_missing_without_them():
    assert p_true_from_top((("True", math.log(0.6)), ("False", math.log(0.2)), ("The", math.log(0.1)))) == \
        pytest.approx(0.75)
    # spellings of one word add up; a missing word counts 0
    assert p_true_from_top(((" true", math.log(0.3)), ("True", math.log(0.3)), ("Yes", -0.5))) == 1.0
    assert p_true_from_top((("Yes", -0.1), ("No", -2.0))) is None
    assert p_true_from_top(None) is None


def test_the_self_check_request_and_its_signal_through_cache_and_store(tmp_path):
    from d2r_edge.eval.outcomes import CachedGenerator

    with ScriptedServer() as srv:
        client = OpenAICompatible(srv.url, "m", max_retries=0, self_check=True)
        srv.replies += [(200, _answer('{"answer": "Paris"}')),
                        (200, _verdict([("False", math.log(0.7)), ("True", math.log(0.3))]))]
        cache = CachedGenerator(client, tmp_path / "g.jsonl")
        g = cache.generate(Task.QA, PromptStyle.SIMPLE, "Where is the Louvre?", ["The Louvre is in Paris."])
        assert g.response == "Paris" and g.p_true == pytest.approx(0.3) and g.p_true_s > 0
        ask = srv.seen[-1]
        assert ask["max_tokens"] == 1 and "response_format" not in ask and ask["top_logprobs"] >= 5
        user = ask["messages"][1]["content"]
        assert "Proposed answer: Paris" in user and "The Louvre is in Paris." in user
        # the passages and the query come first, as in the answer prompt (a prompt cache reuses them)
        answer_user = srv.seen[-2]["messages"][1]["content"]
        assert user.split("Proposed answer")[0].strip() == answer_user.split("Answer with")[0].strip()
        cache.close()
        again = CachedGenerator(client, tmp_path / "g.jsonl")          # replayed from the file, P(True) too
        asked = len(srv.seen)
        h = again.generate(Task.QA, PromptStyle.SIMPLE, "Where is the Louvre?", ["The Louvre is in Paris."])
        assert len(srv.seen) == asked and h.p_true == pytest.approx(0.3)
        again.close()
        # a run without the self-check does not replay the row that has one, and vice versa
        plain = CachedGenerator(OpenAICompatible(srv.url, "m", max_retries=0), tmp_path / "g.jsonl")
        assert plain.sampled_identity != again.sampled_identity
        plain.close()
        # a self-check that fails loses the signal, not the answer
        srv.replies += [(200, _answer('{"answer": "Rome"}')), (400, '{"error": "bad"}')]
        r = client.generate(Task.QA, PromptStyle.SIMPLE, "q2", ["p"])
        assert r.response == "Rome" and r.p_true is None
        # a server whose reply has no top alternatives: missing
        srv.replies += [(200, _answer('{"answer": "Oslo"}')), (200, _verdict(None))]
        assert client.generate(Task.QA, PromptStyle.SIMPLE, "q3", ["p"]).p_true is None
        # repairs (sample=False) ask nothing more
        srv.replies += [(200, _answer('{"answer": "Bern"}'))]
        n = len(srv.seen)
        assert client.generate(Task.QA, PromptStyle.SIMPLE, "q4", ["p"], sample=False).p_true is None
        assert len(srv.seen) == n + 1


def test_the_detector_reads_p_true_as_its_own_missing_signal():
    from d2r_edge.eval.outcomes import attempt_from_json, attempt_to_json
    from test_gate import _attempt

    assert "self_check_p_true" in MAY_BE_MISSING
    assert feature_groups(False)["self_check"] == ("self_check_p_true",)
    assert set(feature_names(False)) == {n for g in feature_groups(False).values() for n in g}
    a = _attempt(None)
    assert math.isnan(features(a, True)["self_check_p_true"])
    from dataclasses import replace

    b = replace(a, generation=replace(a.generation, p_true=0.25))
    assert features(b, True)["self_check_p_true"] == 0.25
    chunks = [{"chunk_id": 0, "doc_id": "d", "title": "T", "text": "Paris is in France"}]
    assert attempt_from_json(attempt_to_json(b), chunks).generation.p_true == 0.25
    assert attempt_from_json(attempt_to_json(a), chunks).generation.p_true is None


def test_a_signal_missing_on_every_training_query_is_left_out():
    from d2r_edge.detector import Detector

    names = feature_names(False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, len(names)))
    x[:, names.index("self_check_p_true")] = np.nan
    y = (x[:, names.index("q_ent_max")] + rng.normal(scale=0.5, size=60)) > 0
    det = Detector.fit(x, y, names, "qa", groups=feature_groups(False))
    assert "self_check" in det.fit_stats["groups_missing"] and "self_check" not in det.fit_stats["groups_kept"]
