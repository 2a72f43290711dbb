"""The self-check signal (issue 53): the same model's P(True) that its answer is right.

- read from the first token's top log-probabilities of one more request, normalized
  over True and False; a server without log-probabilities, or a reply where neither
  word is among the alternatives, leaves it missing (never 0.5);
- the request reuses the answer prompt's passages and query, asks without JSON mode,
  for one token, for a query's first answer only; a failed self-check loses the
  signal, not the answer;
- it is cached as a row of its own beside the answers (a run adding it to cached
  answers pays only for it), travels through the attempt store, and becomes the
  detector's `self_check` group.
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


def test_the_self_check_request_and_its_cache_row(tmp_path):
    from d2r_edge.eval.outcomes import CachedGenerator

    with ScriptedServer() as srv:
        client = OpenAICompatible(srv.url, "m", max_retries=0, self_check=True)
        srv.replies += [(200, _answer('{"answer": "Paris"}')),
                        (200, _verdict([("False", math.log(0.7)), ("True", math.log(0.3))]))]
        cache = CachedGenerator(client, tmp_path / "g.jsonl")
        passages = ["The Louvre is in Paris."]
        g = cache.generate(Task.QA, PromptStyle.SIMPLE, "Where is the Louvre?", passages)
        p, took = cache.p_true(Task.QA, "Where is the Louvre?", passages, g.response)
        assert g.response == "Paris" and p == pytest.approx(0.3) and took > 0 and cache.self_check
        ask = srv.seen[-1]
        assert ask["max_tokens"] == 1 and "response_format" not in ask and ask["top_logprobs"] >= 5
        user = ask["messages"][1]["content"]
        assert "Proposed answer: Paris" in user and "The Louvre is in Paris." in user
        # the passages and the query come first, as in the answer prompt (a prompt cache reuses them)
        answer_user = srv.seen[-2]["messages"][1]["content"]
        assert user.split("Proposed answer")[0].strip() == answer_user.split("Answer with")[0].strip()
        cache.close()
        # both replayed from the file, the self-check with the time it took; the answer row is the one a
        # run without the self-check reads (adding it to cached answers pays only for the self-check)
        again = CachedGenerator(OpenAICompatible(srv.url, "m", max_retries=0, self_check=True), tmp_path / "g.jsonl")
        asked = len(srv.seen)
        h = again.generate(Task.QA, PromptStyle.SIMPLE, "Where is the Louvre?", passages)
        assert again.p_true(Task.QA, "Where is the Louvre?", passages, "Paris") == (pytest.approx(0.3), took)
        assert len(srv.seen) == asked and h.response == "Paris"
        # another answer is another self-check
        srv.replies += [(200, _verdict([("True", -0.1)]))]
        assert again.p_true(Task.QA, "Where is the Louvre?", passages, "Lyon")[0] == 1.0
        again.close()
        # a server whose reply has no top alternatives: missing
        srv.replies += [(200, _verdict(None))]
        assert client.p_true(Task.QA, "q3", ["p"], "Oslo")[0] is None


class _Checked:
    """A generator with a self-check that says P(True) 0.8, or fails."""

    name = "stub"
    self_check = True

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.asked = fail, []

    def generate(self, task, style, query, passages, sample=True):
        from d2r_edge.diagnose import Label
        from d2r_edge.generate.base import Generation

        return Generation("some text", Label.SUPPORTS, "raw")

    def p_true(self, task, query, passages, answer):
        from d2r_edge.generate.openai_compat import GeneratorError

        self.asked.append(answer)
        if self.fail:
            raise GeneratorError("down")
        return 0.8, 0.01


def test_the_pipeline_asks_for_the_first_answer_only_and_survives_a_failed_self_check():
    from dataclasses import replace

    from test_gate import _pipeline

    from d2r_edge.detector import Gate

    p = replace(_pipeline(Gate.PAPER, None), generator=_Checked())
    rec, first, final = p.run_attempts("wrong flagged", learn=False)
    assert first.generation.p_true == 0.8 and p.generator.asked == ["SUPPORTS"]     # the label, not the text
    assert final is not first and final.generation.p_true is None                   # the repair asks nothing
    assert first.timings_s["p_true_s"] == 0.01
    q = replace(_pipeline(Gate.PAPER, None), generator=_Checked(fail=True))
    rec, first, _ = q.run_attempts("right clean", learn=False)
    assert first.generation.p_true is None and rec["final_answer"] == "SUPPORTS"


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


class _CheckedWithSamples(_Checked):
    """Draws samples and shows them in the self-check (self_check_samples)."""

    self_check_samples = True

    def generate(self, task, style, query, passages, sample=True):
        from dataclasses import replace

        return replace(super().generate(task, style, query, passages), samples=("SUPPORTS", "REFUTES") if sample
                       else None)

    def p_true(self, task, query, passages, answer, samples=()):
        self.shown = samples
        return super().p_true(task, query, passages, answer)


def test_the_self_check_can_show_the_samples_as_brainstormed_answers(tmp_path):
    """Kadavath et al. 2022 sec. 3.3: P(True) asked with the model's own samples shown; its own prompt and cache
    rows (a plain self-check never replays one asked with samples, or the reverse)."""
    from dataclasses import replace

    from test_gate import _pipeline

    from d2r_edge.app import RunSettings
    from d2r_edge.detector import Gate
    from d2r_edge.errors import ConfigError
    from d2r_edge.eval.outcomes import CachedGenerator

    from test_gate import _Diagnoser

    class _TakesSamples(_Diagnoser):
        def diagnose(self, query, passages, response, label, fact_verification, samples=None):
            return super().diagnose(query, passages, response, label, fact_verification)

    gen = _CheckedWithSamples()
    p = replace(_pipeline(Gate.PAPER, None), generator=gen, diagnoser=_TakesSamples())
    _, first, _ = p.run_attempts("wrong flagged", learn=False)
    assert gen.shown == ("SUPPORTS", "REFUTES") and first.generation.p_true == 0.8
    with ScriptedServer() as srv:
        client = OpenAICompatible(srv.url, "m", max_retries=0, self_check=True, self_check_samples=True)
        cache = CachedGenerator(client, tmp_path / "g.jsonl")
        srv.replies += [(200, _verdict([("True", math.log(0.6)), ("False", math.log(0.4))])),
                        (200, _verdict([("True", math.log(0.2)), ("False", math.log(0.8))]))]
        args = (Task.QA, "Where is the Louvre?", ["The Louvre is in Paris."], "Paris")
        with_samples = cache.p_true(*args, ("Paris", "Lyon"))[0]
        user = srv.seen[-1]["messages"][1]["content"]
        assert "Brainstormed answers:\n- Paris\n- Lyon\nProposed answer: Paris" in user
        plain = cache.p_true(*args)[0]
        assert "Brainstormed" not in srv.seen[-1]["messages"][1]["content"]
        assert (with_samples, plain) == (pytest.approx(0.6), pytest.approx(0.2)) and len(srv.seen) == 2
        assert cache.p_true(*args, ("Paris", "Lyon"))[0] == pytest.approx(0.6) and len(srv.seen) == 2
        srv.replies += [(200, _verdict([("True", -0.1)]))]
        assert cache.p_true(*args, ("Paris", "Rome"))[0] == 1.0 and len(srv.seen) == 3   # other samples: asked
        cache.close()
    with pytest.raises(ConfigError, match="--self-consistency"):
        RunSettings(kb=tmp_path, models=tmp_path, task=Task.QA, generator="openai", self_check=True,
                    self_check_samples=True)


def test_the_ablation_counts_what_each_signal_asks_of_the_generator():
    """Issue 53's cost per signal in generator terms: the self-check 1 request and 1 token, the samples N requests
    of about the answer's length, the answer its own tokens; nothing claimed for a signal no query had."""
    from dataclasses import replace

    from test_detector import _attempt

    from d2r_edge.eval.ablation import signal_generator_load

    def with_gen(**kw):
        a = _attempt("Paris")
        return replace(a, generation=replace(a.generation, **kw))

    firsts = [with_gen(logprobs=(-0.1, -0.2, -0.3), samples=("Paris",) * 4, p_true=0.4) for _ in range(3)]
    load = signal_generator_load(firsts)
    assert load["answer with log-probs (log_probs, answer)"] == {"requests": 1.0, "generated_tokens": 3.0}
    assert load["samples (self_consistency)"] == {"requests": 4.0, "generated_tokens": 12.0}
    assert load["self-check request (self_check)"] == {"requests": 1.0, "generated_tokens": 1.0}
    bare = signal_generator_load([with_gen(logprobs=(-0.1,))])
    assert bare["samples (self_consistency)"] is None and bare["self-check request (self_check)"] is None
