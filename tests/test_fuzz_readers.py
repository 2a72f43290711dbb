"""Every reader of a file a user brings, searched with generated input (hypothesis).

The property: a reader returns records, or raises one `D2RError` subclass whose
message names the file; never another exception. Valid files round-trip (what
was written is what is read). The default run caps the examples to keep the
suite quick; `-m slow` searches longer (D2R_FUZZ_EXAMPLES overrides both).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stand_ins import longer, search_longer

from d2r_edge.errors import D2RError

EXAMPLES = int(os.environ.get("D2R_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# JSON values of every shape, with the strings that break naive code
_text = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\x00", "\ufeff", "é" * 3, "a\r\nb", "x" * 5000]))
_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), _text)
_json = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                     max_leaves=12)


def _keyed(keys: list[str]):
    """Objects that have (some of) the keys a reader looks for, with values of any type."""
    return st.fixed_dictionaries({}, optional={k: _json for k in keys}).flatmap(
        lambda d: st.dictionaries(st.text(max_size=8), _json, max_size=3).map(lambda extra: {**extra, **d}))


def _broken_line():
    return st.one_of(
        st.just("[" * 5_000 + "]" * 5_000),                 # nested past the parser's recursion limit
        st.just('{"id": "x", "text": "unterminated'),          # a truncated last line
        st.just("\ufeff{}"), st.just("null"), st.just("{}\r"), st.just("\x00"),
        _json.map(json.dumps),
    )


def _write(path: Path, rows: list, tail: bytes = b"") -> Path:
    with open(path, "wb") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)).encode("utf-8", "surrogatepass") + b"\n")
        fh.write(tail)
    return path


_tail = st.sampled_from([b"", b"\xff\xfe not utf-8\n", b'{"id": "t", "te', b"\x00\x00"])


def _must_be_clear(fn, path: Path):
    """fn(path) returns, or raises a D2RError naming the file; anything else fails the test."""
    try:
        return fn(path)
    except D2RError as exc:
        assert str(path.name) in str(exc) or str(path) in str(exc), f"error does not name the file: {exc}"
        return None


# --- docs.jsonl -----------------------------------------------------------------------

@FUZZ
@given(rows=st.lists(st.one_of(_keyed(["id", "title", "text"]), _broken_line()), max_size=6), tail=_tail)
def test_documents_reader_never_crashes(tmp_path, rows, tail):
    from d2r_edge.retrieval.docs import read_documents

    _must_be_clear(read_documents, _write(tmp_path / "docs.jsonl", rows, tail))


@FUZZ
@given(docs=st.lists(st.tuples(st.text(min_size=1, max_size=10), st.text(max_size=20),
                               st.text(max_size=60).filter(lambda t: t.strip())), min_size=1, max_size=6,
                     unique_by=lambda d: d[0]))
def test_documents_round_trip(tmp_path, docs):
    from d2r_edge.retrieval.docs import read_documents

    path = _write(tmp_path / "docs.jsonl", [{"id": i, "title": t, "text": x} for i, t, x in docs])
    got = read_documents(path).documents
    assert [(d.id, d.title, d.text) for d in got] == docs


# --- query files (run / train) -----------------------------------------------------------

@FUZZ
@given(rows=st.lists(st.one_of(_keyed(["id", "_id", "claim", "question", "label", "answer"]), _broken_line()),
                     max_size=6), tail=_tail)
def test_query_reader_never_crashes(tmp_path, rows, tail):
    from d2r_edge.runner import load_queries

    qs = _must_be_clear(load_queries, _write(tmp_path / "q.jsonl", rows, tail))
    for q in qs or []:
        assert isinstance(q.id, str) and isinstance(q.text, str) and q.text.strip()
        assert q.label is None or isinstance(q.label, str)
        assert q.answer is None or isinstance(q.answer, str)


@FUZZ
@given(qs=st.lists(st.tuples(st.text(min_size=1, max_size=10), st.text(max_size=60).filter(lambda t: t.strip()),
                             st.sampled_from(["SUPPORTS", "REFUTES", "NOT ENOUGH INFO"])),
                   min_size=1, max_size=6, unique_by=lambda q: q[0]))
def test_queries_round_trip(tmp_path, qs):
    from d2r_edge.runner import load_queries

    path = _write(tmp_path / "q.jsonl", [{"id": i, "claim": c, "label": lab} for i, c, lab in qs])
    assert [(q.id, q.text, q.label) for q in load_queries(path)] == qs


# --- eval answers query sets (the ../shared/data layouts) ----------------------------------

_LAYOUT_KEYS = ["id", "_id", "question", "label", "derived_evidence_sentences", "answer", "context",
                "question_id", "question_text", "contexts", "paragraphs", "answer_aliases", "supporting_facts",
                "answers_objects"]


@FUZZ
@given(rows=st.lists(st.one_of(_keyed(_LAYOUT_KEYS), _broken_line()), max_size=5), tail=_tail)
def test_queryset_reader_never_crashes(tmp_path, rows, tail):
    from d2r_edge.eval.querysets import load_queryset

    _must_be_clear(load_queryset, _write(tmp_path / "set.jsonl", rows, tail))


# --- trajectories (doctor) ---------------------------------------------------------------------

_TRAJ_KEYS = ["trajectory", "claim", "scratchpad", "traj", "steps", "question", "answer", "label", "id",
              "correct", "gold", "prediction"]


@FUZZ
@given(rows=st.lists(st.one_of(_keyed(_TRAJ_KEYS), _broken_line()), max_size=5), tail=_tail)
def test_trajectory_reader_never_crashes(tmp_path, rows, tail):
    from d2r_edge.doctor.parse import parse_file

    _must_be_clear(parse_file, _write(tmp_path / "t.jsonl", rows, tail))


# --- what the search found, each fixed and pinned -------------------------------------------

DEEP = "[" * 5_000 + "]" * 5_000


def test_found_a_line_nested_past_the_recursion_limit_is_one_bad_line(tmp_path):
    """json.loads raises RecursionError, not JSONDecodeError: every reader died on such a line."""
    from d2r_edge.doctor.parse import parse_file
    from d2r_edge.eval.querysets import load_queryset
    from d2r_edge.retrieval.docs import read_documents
    from d2r_edge.runner import load_queries

    assert len(read_documents(_write(tmp_path / "d.jsonl", [DEEP, {"id": "a", "text": "x"}])).documents) == 1
    assert len(load_queries(_write(tmp_path / "q.jsonl", [DEEP, {"id": "a", "claim": "x"}]))) == 1
    fever = {"id": 1, "question": "A claim.", "label": "SUPPORTS", "derived_evidence_sentences": [["P", 0, "Text."]]}
    assert len(load_queryset(_write(tmp_path / "f.jsonl", [DEEP, fever])).queries) == 1
    traj = {"question": "q?", "steps": [{"type": "answer", "text": "a"}], "gold": "a"}
    assert len(parse_file(_write(tmp_path / "t.jsonl", [DEEP, traj])).trajectories) == 1


def test_found_a_trajectory_file_that_is_not_utf8_is_an_input_error(tmp_path):
    from d2r_edge.doctor.parse import parse_file
    from d2r_edge.errors import InputError

    path = _write(tmp_path / "t.jsonl", [], b"\xff\xfe not utf-8\n")
    with pytest.raises(InputError, match="t.jsonl is not UTF-8"):
        parse_file(path)


def test_found_an_unknown_trajectory_layout_names_the_file_and_line(tmp_path):
    from d2r_edge.doctor.parse import parse_file
    from d2r_edge.errors import InputError

    with pytest.raises(InputError, match=r"t.jsonl line 2: cannot tell the trajectory format"):
        parse_file(_write(tmp_path / "t.jsonl", ["", {"x": 1}]))


def test_found_a_query_label_that_is_not_a_string_skips_the_line(tmp_path):
    """A list label used to reach the scorer (fever_label) and crash it mid-run."""
    from d2r_edge.runner import load_queries

    qs = load_queries(_write(tmp_path / "q.jsonl", [{"id": "a", "claim": "x", "label": []},
                                                    {"id": "b", "question": "y?", "answer": 1990},
                                                    {"id": "c", "question": "z?", "answer": {"a": 1}}]))
    assert [(q.id, q.answer) for q in qs] == [("b", "1990")]


def test_found_rows_of_other_shapes_in_query_sets_and_trajectories_are_skipped_lines(tmp_path):
    """A MuSiQue paragraph that is a string, a FireAct chat with no message: AttributeError /
    IndexError escaped the readers."""
    from d2r_edge.doctor.parse import parse_file
    from d2r_edge.eval.querysets import load_queryset

    musique = {"id": "m", "question": "q?", "answer": "a", "paragraphs": [{"title": "T", "paragraph_text": "a"}]}
    bad = {**musique, "id": "n", "paragraphs": ["just a string"]}
    assert [q.id for q in load_queryset(_write(tmp_path / "m.jsonl", [musique, bad])).queries] == ["m"]
    ok = {"traj": [{"content": "Q?"}, {"content": "Thought: t\nAction: Finish[a]"}], "gt": "a"}
    parsed = parse_file(_write(tmp_path / "f.jsonl", [ok, {"traj": [], "gt": "a"}]))
    assert len(parsed.trajectories) == 1 and parsed.issues[0].line == 2


@pytest.mark.slow
def test_readers_with_more_examples(tmp_path):
    """The same properties searched 5x longer (the `slow` step; 20x under `.ci/run --full`)."""
    search_longer(__file__, EXAMPLES * longer(5, 20))
