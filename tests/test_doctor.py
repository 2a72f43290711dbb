"""Trajectory mode: every real dev trajectory parses; the diagnosis follows the paper's phases."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from d2r_edge.doctor.commands import DiagnoseRequest, run_diagnose, simple_format_rule
from d2r_edge.doctor.diagnose import ErrorType, TrajectoryDiagnoser, is_success, key_entities, unsupported
from d2r_edge.doctor.parse import TrajectoryFormat, detect, parse_file
from d2r_edge.doctor.trajectory import StepKind
from d2r_edge.errors import InputError

DEV = {"react_fever": 334, "reflexion_react_hotpotqa": 65, "fireact_react_hotpotqa": 1015}


class WordNLI:
    """Entailed when every content word of the hypothesis is in the premise; contradicted when the
    premise holds the hypothesis with "not" in it. Enough to drive each phase on purpose."""

    labels = ["entailment", "neutral", "contradiction"]

    def score(self, pairs):
        out = []
        for p, h in pairs:
            pw, hw = set(re.findall(r"\w+", p.lower())), set(re.findall(r"\w+", h.lower())) - {"the", "is", "a"}
            if "not" in pw and hw - {"not"} <= pw and "not" not in hw:
                out.append([0.05, 0.05, 0.9])
            elif hw <= pw:
                out.append([0.9, 0.05, 0.05])
            else:
                out.append([0.05, 0.9, 0.05])
        return np.asarray(out, dtype=np.float32)


def _write(tmp_path, rows, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _traj(question, gold, prediction, steps):
    return {"question": question, "gold": gold, "prediction": prediction,
            "steps": [{"type": t, "text": x} for t, x in steps]}


@pytest.mark.parametrize("name", sorted(DEV))
def test_every_dev_trajectory_parses(shared_data, name):
    parsed = parse_file(shared_data / "agentic_trajectories" / name / "dev.jsonl")
    assert len(parsed.trajectories) == DEV[name] and not parsed.issues
    for t in parsed.trajectories:
        assert t.question and t.steps
        searches, evidence = t.of(StepKind.SEARCH), t.of(StepKind.EVIDENCE)
        assert [s.index for s in searches] == list(range(1, len(searches) + 1))
        assert {e.index for e in evidence} <= {s.index for s in searches}
        ks = [s.index for s in t.steps if s.kind in (StepKind.REASONING, StepKind.ANSWER)]
        assert ks == list(range(1, len(ks) + 1))


def test_labels_and_invalid_actions(tmp_path):
    row = {"claim": "X is a film.", "answer": None, "gt_answer": "NOT ENOUGH INFO", "em": 0,
           "trajectory": "Thought 1: I should search X.\nAction 1: Search[X]\nObservation 1: X is a 2001 film.\n"
                         "Thought 2: It is a film.\nAction 2: \n\nFinish[SUPPORTS]\n"
                         "Observation 2: Invalid action: Finish[SUPPORTS]\n\nThought 3: Try again.\n"
                         "Action 3: Finish[SUPPORTS]\nObservation 3: Episode finished, reward = 0\n"}
    t = parse_file(_write(tmp_path, [row])).trajectories[0]
    assert t.task == "fever" and t.prediction == "SUPPORTS"
    assert [s.label for s in t.steps] == ["[Step 1] (Reasoning)", "[Action 1] (Search)", "[Evidence 1] (Information)",
                                          "[Step 2] (Reasoning)", "[Step 3] (Reasoning)", "[Step 4] (Answer)"]
    assert t.steps[2].text == "X is a 2001 film."         # the retracted finish left no answer step behind


def test_malformed_lines_are_reported_and_skipped(tmp_path):
    good = _traj("Who?", "Ann", "Bob", [("reasoning", "Think."), ("answer", "Bob")])
    bad_step = _traj("Who?", "Ann", "Bob", [("dance", "x")])
    path = _write(tmp_path, [good, "{not json", bad_step, good])
    parsed = parse_file(path)
    assert parsed.format is TrajectoryFormat.JSONL and len(parsed.trajectories) == 2
    assert [i.line for i in parsed.issues] == [2, 3] and "dance" in parsed.issues[1].reason
    with pytest.raises(InputError, match="--format"):
        detect({"foo": 1})
    with pytest.raises(InputError, match="--format"):
        parse_file(_write(tmp_path, [{"foo": 1}], "odd.jsonl"))
    with pytest.raises(InputError, match="no trajectory file"):
        parse_file(tmp_path / "missing.jsonl")


def _abbey_rows():
    """One question, four failures: format, reasoning, search (all queries poisoned), retriever."""
    return [
        # 1. format: the same answer, longer surface form
        _traj("Which band released Abbey Road?", "The Beatles", "the Beatles band",
              [("search", "Abbey Road"), ("evidence", "Abbey Road is an album by the Beatles."),
               ("answer", "the Beatles band")]),
        # 3. sufficient evidence, reasoning names an entity from nowhere at step 2
        _traj("Which band released Abbey Road?", "The Beatles", "The Rolling Stones",
              [("reasoning", "I need to search Abbey Road."), ("search", "Abbey Road"),
               ("evidence", "Abbey Road is an album by the Beatles."),
               ("reasoning", "Abbey Road was released by Decca Records."),
               ("reasoning", "So the band is The Rolling Stones."), ("answer", "The Rolling Stones")]),
        # 4a. insufficient, every query poisoned (Decca comes from no source)
        _traj("Which band released Abbey Road?", "The Beatles", "Decca",
              [("reasoning", "It was probably Decca Records."), ("search", "Decca Records"),
               ("evidence", "Decca Records is a British label."), ("answer", "Decca")]),
        # 4b. insufficient, a valid query whose evidence lacked the answer -> retriever at its evidence
        _traj("Which band released Abbey Road?", "The Beatles", "unknown",
              [("search", "Abbey Road"), ("evidence", "Abbey Road is a street in London."),
               ("search", "Paul Smith"), ("evidence", "Paul Smith is a designer."), ("answer", "unknown")]),
    ]


def test_phases_in_priority_order(tmp_path):
    d = TrajectoryDiagnoser(WordNLI())
    rows = _abbey_rows()
    ts = parse_file(_write(tmp_path, rows)).trajectories
    got = [d.diagnose(t) for t in ts]
    assert [(g.type, g.culprit) for g in got] == [
        (ErrorType.FORMAT, None), (ErrorType.REASONING, "[Step 2] (Reasoning)"),
        (ErrorType.SEARCH, "[Action 1] (Search)"), (ErrorType.RETRIEVER, "[Evidence 1] (Information)")]
    assert [g.sufficient for g in got] == [True, True, False, False]
    assert got[1].signals["reasoning"][1]["unsupported_entities"] == ["Decca Records"]
    assert [q["poisoned"] for q in got[3].signals["queries"]] == [False, True]


def test_fever_sufficiency_follows_the_gold_label(tmp_path):
    d = TrajectoryDiagnoser(WordNLI())
    base = {"question": "Paris is in France.", "steps": [
        {"type": "search", "text": "Paris"}, {"type": "evidence", "text": "Paris is not in France."},
        {"type": "answer", "text": "SUPPORTS"}], "task": "fever", "prediction": "SUPPORTS"}
    refuted, nei = dict(base, gold="REFUTES"), dict(base, gold="NOT ENOUGH INFO")
    supported = dict(base, gold="SUPPORTS", prediction="supported")
    ts = parse_file(_write(tmp_path, [refuted, nei, supported])).trajectories
    r, n, s = (d.diagnose(t) for t in ts)
    assert r.sufficient and r.type is ErrorType.REASONING and r.signals["sufficiency"]["rule"] == "nli_verdict"
    assert n.sufficient and n.signals["sufficiency"]["rule"] == "gold_not_enough_info"
    assert s.type is ErrorType.FORMAT and not is_success(ts[2]) and not simple_format_rule(ts[2])


def test_format_rules_for_names_plurals_and_numbers(tmp_path):
    d = TrajectoryDiagnoser(WordNLI())
    rows = [_traj("Who?", gold, pred, [("answer", pred)]) for pred, gold in (
        ("naomi campbell", "Naomi Elaine Campbell"), ("ribosome", "ribosomes"), ("5", "five"),
        ("boston celtics and orlando magic and spurs", "Boston Celtics"), ("Queen", "The Beatles"))]
    ts = parse_file(_write(tmp_path, rows)).trajectories
    assert [d.format_check(t)["rule"] for t in ts] == ["token_subset", "number_words_or_plural",
                                                       "number_words_or_plural", None, None]


def test_entity_provenance():
    # pronouns and a leading "The" are not names
    assert key_entities('He met "Big Ben" in 1961 and The Rolling Stones.') == ["Big Ben", "1961", "Rolling Stones"]
    assert unsupported(["VIVA Plus", "Comedy Central"], "Similar: ['Paramount', 'VIVA Plus']") == ["Comedy Central"]


def test_diagnose_command_is_resumable(tmp_path):
    rows = [_traj("Which band released Abbey Road?", "The Beatles", x,
                  [("search", "Abbey Road"), ("evidence", "Abbey Road is an album by the Beatles."), ("answer", x)])
            for x in ("The Beatles", "Queen", "the Beatles band")]
    src, out = _write(tmp_path, rows), tmp_path / "out" / "d.jsonl"
    summary = run_diagnose(DiagnoseRequest(src, out), WordNLI())
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["line"] for r in recs] == [2, 3] and summary["failed"] == 2 and summary["parsed"] == 3
    assert [r["type"] for r in recs] == ["reasoning", "format"] and summary["format_agrees_with_rule"] == 1.0
    assert summary["sufficiency_agrees_with_gold_in_evidence"] == 1.0

    class Boom(WordNLI):
        def score(self, pairs):
            raise AssertionError("a finished record was recomputed")

    again = run_diagnose(DiagnoseRequest(src, out), Boom())
    assert again["types"] == summary["types"] and json.loads((tmp_path / "out" / "d.jsonl.summary.json").read_text())


class ScriptedChat:
    """An LLM stand-in: answers by the first rule whose key is in the prompt; counts calls and tokens."""

    def __init__(self, rules):
        self.rules, self.prompts = rules, []

    def __call__(self, messages, max_tokens, stop=None, json_mode=False):
        from d2r_edge.generate.openai_compat import ChatResult

        prompt = "\n".join(m["content"] for m in messages)
        self.prompts.append(prompt)
        text = next((v for k, v in self.rules if k in prompt), "<answer>no idea</answer>")
        return ChatResult(text, len(prompt.split()), len(text.split()), 0.0)


def _search_log():
    calls = []

    def search(query, k):
        calls.append(query)
        return ["Abbey Road\nAbbey Road is the eleventh studio album by the Beatles."][:k]

    return search, calls


def test_repair_operators_keep_the_prefix_and_answer(tmp_path):
    from d2r_edge.doctor.repair import Method, Repairer, answer_variants, best_span, extract_answer

    span = best_span("the Beatles band", ["Abbey Road is an album by the Beatles."])
    assert span == ("Beatles", pytest.approx(2 / 3))
    assert best_span("fortnightly women interest magazines",
                     ["Woman's Era is a fortnightly women interest magazine, published in English."])[0] == \
        "fortnightly women interest magazine"                      # plural-insensitive: the whole phrase
    assert extract_answer("So it is them. <answer>The Beatles</answer>") == "The Beatles"
    from d2r_edge.doctor.repair import json_field
    assert json_field("{'answer': 'The Beatles', reasoning: 'x'", "answer") == "The Beatles"   # repaired
    assert json_field("no json here", "answer") is None
    v = answer_variants("The Beatles (band)")
    assert "Beatles" in v and "The Beatles" in v and len(v) == len(set(v))
    rows = _abbey_rows()
    ts = parse_file(_write(tmp_path, rows)).trajectories
    chat = ScriptedChat([("Write one better search query", '{"query": "Abbey Road album"}'),
                         ("next Thought and Action", "Thought: look it up\nAction: search[Abbey Road album]"),
                         ("Continue the reasoning", '{"reasoning": "It is by the Beatles.", "answer": "The Beatles"}')])
    search, calls = _search_log()
    d = TrajectoryDiagnoser(WordNLI())
    rep = Repairer(chat, search, d)
    fmt, rsn, srch, rtv = (rep.repair(t, d.diagnose(t), Method.DRRAG) for t in ts)
    assert fmt.answer == "Beatles" and fmt.cost.llm_calls == 0 and fmt.kept_steps == 3
    assert rsn.answer == "The Beatles" and rsn.cost.llm_calls == 1 and rsn.kept_steps == 3
    assert "Decca" not in chat.prompts[0].split("Reasoning so far (valid):")[1]    # the culprit step is dropped
    assert srch.type == "search" and srch.kept_steps == 1 and srch.answer == "The Beatles"
    assert srch.cost.searches == 4 and srch.cost.llm_calls == 5                   # 4 turns, then a forced answer
    assert rtv.type == "retriever" and rtv.kept_steps == 0 and calls[-1] == "Abbey Road album"
    assert rtv.answer == "The Beatles" and rtv.cost.llm_calls == 2
    rerun = rep.repair(ts[1], d.diagnose(ts[1]), Method.RERUN)
    assert rerun.kept_steps == 0 and rerun.cost.llm_calls == 5
    finish = Repairer(ScriptedChat([("next Thought", "Thought: known.\nAction: finish[The Beatles]")]), search, d)
    assert finish.repair(ts[2], d.diagnose(ts[2]), Method.NO_TAXONOMY).answer == "The Beatles"


def test_fever_repairs_answer_with_a_label(tmp_path):
    from d2r_edge.doctor.repair import Method, Repairer, fever_label_in

    assert fever_label_in("It is refuted. <answer>The Beach (film)</answer>") == "REFUTES"
    assert fever_label_in("Not enough information here") == "NOT ENOUGH INFO" and fever_label_in("no idea") is None
    row = {"question": "Paris is in France.", "gold": "SUPPORTS", "prediction": "REFUTES", "task": "fever",
           "steps": [{"type": "search", "text": "Paris"}, {"type": "evidence", "text": "Paris is in France."},
                     {"type": "reasoning", "text": "So it is false."}, {"type": "answer", "text": "REFUTES"}]}
    t = parse_file(_write(tmp_path, [row])).trajectories[0]
    d = TrajectoryDiagnoser(WordNLI())
    chat = ScriptedChat([("Continue the reasoning", "The claim is supported. <answer>Paris, France</answer>")])
    r = Repairer(chat, _search_log()[0], d).repair(t, d.diagnose(t), Method.DRRAG)
    assert r.type == "reasoning" and r.answer == "SUPPORTS"


def test_doctor_eval_reports_and_resumes(tmp_path):
    from d2r_edge.doctor.evaluate import DoctorEvalSettings, parse_doctor_methods, rouge_l, run_doctor_eval

    rows = [_traj("Which band released Abbey Road?", "The Beatles", x,
                  [("reasoning", "I need to search Abbey Road."), ("search", "Abbey Road"),
                   ("evidence", "Abbey Road is an album by the Beatles."), ("reasoning", f"So it is {x}."),
                   ("answer", x)])
            for x in ("The Beatles", "Queen", "the Beatles band", "Pink Floyd")]
    src = _write(tmp_path, rows)
    chat = ScriptedChat([("Continue the reasoning", "<answer>The Beatles</answer>"),
                         ("next Thought", "Action: finish[Queen]")])
    search, _ = _search_log()
    s = DoctorEvalSettings((src,), tmp_path / "ev", parse_doctor_methods("drrag,rerun"))
    summary = run_doctor_eval(s, WordNLI(), chat, search)
    m = summary["methods"]
    assert summary["failed"] == 3 and summary["diagnosis_types"] == {"format": 1, "reasoning": 2}
    assert m["drrag"]["repair_rate"] == 1.0 and m["rerun"]["repair_rate"] == 0.0
    assert m["drrag"]["delta_em_points"] == pytest.approx(75.0)
    assert m["drrag"]["format_any_variant_rate"] == 1.0 and m["rerun"]["kept_steps_mean"] == 0
    assert m["drrag"]["by_diagnosis"]["checkable, correct"]["n"] == 3
    assert "| drrag | 100.0 |" in (tmp_path / "ev" / "report.md").read_text()
    n_calls = len(chat.prompts)
    assert run_doctor_eval(s, WordNLI(), chat, search)["methods"] == m and len(chat.prompts) == n_calls
    # a kill mid-write leaves a torn last line: that record is redone, the others are not
    path = tmp_path / "ev" / "drrag.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])
    assert run_doctor_eval(s, WordNLI(), chat, search)["methods"] == m
    assert len(chat.prompts) == n_calls + 1
    assert [json.loads(x)["key"] for x in path.read_text().splitlines()] == [json.loads(x)["key"] for x in lines]
    assert rouge_l("the Beatles band", ("The Beatles",)) == pytest.approx(2 / 3)
    with pytest.raises(InputError, match="unknown doctor method"):
        parse_doctor_methods("drrag,magic")


def test_llm_diagnoser_json_is_repaired_and_bad_replies_fall_back(tmp_path):
    from d2r_edge.doctor.llm_diagnose import LLMDiagnoser

    rows = [_traj("Which band released Abbey Road?", "The Beatles", "Queen",
                  [("reasoning", "I need to search Abbey Road."), ("search", "Abbey Road"),
                   ("evidence", "Abbey Road is an album by the Beatles."), ("reasoning", "So it is Queen."),
                   ("answer", "Queen")])] * 3
    src, out = _write(tmp_path, rows), tmp_path / "d.jsonl"
    replies = iter(["{'type': 'reasoning', 'culprit': '[Step 2] (Reasoning)', evidence_sufficient: true",  # broken
                    '{"type": "retriever", "culprit": "[Evidence 9] (Information)"}',                    # no step
                    '{"type": "reasoning", "culprit": "[Step 1] (Reasoning)", "evidence_sufficient": true}'])

    def chat(messages, max_tokens, stop=None):
        from d2r_edge.generate.openai_compat import ChatResult

        prompt = messages[0]["content"]
        assert "The gold answer is correct" in prompt and "[Action 1] (Search)" in prompt
        return ChatResult(next(replies), 10, 5, 0.0)

    summary = run_diagnose(DiagnoseRequest(src, out), WordNLI(), LLMDiagnoser(chat))
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["type"], r["culprit"]) for r in recs] == [("reasoning", "[Step 2] (Reasoning)")] * 2 + [
        ("reasoning", "[Step 1] (Reasoning)")]
    assert [r["signals"]["llm"]["llm_usable"] for r in recs] == [True, False, True]
    agree = summary["llm_vs_nli"]
    assert agree["llm_reply_usable"] == 2 and agree["type_agreement"] == 1.0
    assert agree["type_and_culprit_agreement"] == 0.5


def test_summary_scores_the_checkable_labels_as_recall_specificity_and_balanced_accuracy():
    from d2r_edge.doctor.commands import summarize

    def rec(kind, rule, sufficient=False, gold_in=None):
        return {"type": kind, "culprit": None, "sufficient": sufficient,
                "checks": {"format_rule": rule, "gold_in_evidence": gold_in}}

    records = ([rec("format", True)] * 4 + [rec("retriever", True)]           # recall 4/5
               + [rec("reasoning", False, True, True)] * 2                    # sufficient, gold in: TP
               + [rec("retriever", False, True, False)]                       # sufficient, gold absent: FP
               + [rec("retriever", False, False, False)] * 3                  # TN
               + [rec("format", False)])                                      # a Format call the rule lacks
    s = summarize(records, n_parsed=20, n_issues=0, fmt="jsonl")
    assert s["format_recall"] == 0.8 and s["format_rule_positive"] == 5
    assert s["format_specificity"] == 6 / 7
    assert s["sufficiency_recall"] == 1.0 and s["sufficiency_specificity"] == 3 / 4
    assert s["sufficiency_balanced_accuracy"] == (1.0 + 0.75) / 2 and s["sufficiency_checked"] == 6
    # an always-insufficient diagnoser gets 0.5, however few failures have the evidence
    lazy = summarize([rec("retriever", False, False, g) for g in [True] + [False] * 9], 10, 0, "jsonl")
    assert lazy["sufficiency_balanced_accuracy"] == 0.5 and lazy["sufficiency_agrees_with_gold_in_evidence"] == 0.9


def test_the_doctors_llm_client_never_asks_for_log_probabilities():
    """Nothing in trajectory mode reads them; llama-cpp-python's server pays a vocabulary sort per token."""
    import argparse

    from stand_ins import ScriptedServer

    from d2r_edge.doctor.cli import _doctor_chat

    with ScriptedServer() as srv:
        srv.replies.append((200, {"choices": [{"message": {"content": "{}"}}]}))
        chat = _doctor_chat(argparse.Namespace(base_url=srv.url, model="m", api_key_env=None, timeout_s=5.0))
        assert chat([{"role": "user", "content": "hi"}], 8).text == "{}"
        assert "logprobs" not in srv.seen[0] and "top_logprobs" not in srv.seen[0]
