"""`d2r-edge report`: the page's data, summary and safety (untrusted text stays text, nothing loads)."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from d2r_edge.cli import main
from d2r_edge.errors import InputError
from d2r_edge.view import read_records, write_report
from d2r_edge.view.cards import card, summarize

EVIL_QUERY = '<script>alert("q")</script> Was the bridge </script><!-- built & opened?'
EVIL_TITLE = '<img src=x onerror=alert("t")>'
EVIL_TEXT = '<a href="javascript:alert(1)">click</a> \u2028 ]]> {{x}}'


def _attempt(passages, label="SUPPORTS", failure="no_failure"):
    return {"passages": passages, "label": label, "gated_label": label, "response": f"answer with {EVIL_TITLE}",
            "failure": failure, "e_q": "entailment", "e_r": "neutral", "kg": "no_triplets",
            "nli_q": [{"entailment": 0.7, "neutral": 0.2, "contradiction": 0.1}] + [None] * (len(passages) - 1),
            "nli_r": [None] * len(passages),
            "timings_s": {"embed_query_s": 0.004, "retrieve_s": 0.001, "generate_s": 0.06, "diagnose_s": 0.01,
                          "mem_growth_mib": 1.5}}


def _record(i, *, repaired=False, first_ok=True, final_ok=True, over=False, failure="no_failure", query=None):
    rec = {"id": f"q{i}", "query": query or f"claim number {i}", "task": "fever", "gold_label": "SUPPORTS",
           "gold_answer": None, "first": _attempt(["evil", "d2"]), "failure": failure, "repair": None, "gate": "paper",
           "final": None, "first_answer": "SUPPORTS" if first_ok else "REFUTES",
           "final_answer": "SUPPORTS" if final_ok else "REFUTES", "total_s": 0.08 + i * 1e-3,
           "first_correct": first_ok, "final_correct": final_ok, "error": None}
    if repaired:
        rec["repair"] = {"allowed": ["dense_k10", "bm25_k20"], "cost_masked": ["dense_k20"], "mask_fallback": False,
                         "arm": "dense_k10", "arm_index": 0, "propensity": None, "explored": False,
                         "latency_s": 4.0 if over else 0.05, "mem_growth_mib": 0.2, "memory_kind": "host",
                         "over_budget": over, "reward": 0.6, "x": [0.1] * 147, "policy_s": 2e-5,
                         "unavailable": {"rerank": "no reranker model"}, "policy_updates": None,
                         "budget": {"latency_s": 3.0, "device_mem_mib": 6.0}}
        rec["final"] = _attempt(["d2", "d3"], failure="no_failure")
    rec["final"] = rec["final"] or rec["first"]
    return rec


def _write(tmp_path: Path, records, extra_lines=()) -> Path:
    path = tmp_path / "records.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
        for line in extra_lines:
            fh.write(line + "\n")
    return path


def _kb(tmp_path: Path) -> Path:
    kb = tmp_path / "kb"
    kb.mkdir()
    rows = [{"chunk_id": 0, "doc_id": "evil", "index": 0, "title": EVIL_TITLE, "text": EVIL_TEXT},
            {"chunk_id": 1, "doc_id": "d2", "index": 0, "title": "Harbour", "text": "The harbour opened in 1871."}]
    (kb / "chunks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return kb


class _Doc(HTMLParser):
    """Every element with its attributes, and the text of each <script>."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.scripts, self._in = [], [], None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._in = dict(attrs)
            self.scripts.append([dict(attrs), ""])

    def handle_endtag(self, tag):
        if tag == "script":
            self._in = None

    def handle_data(self, data):
        if self._in is not None:
            self.scripts[-1][1] += data


def test_untrusted_text_is_data_never_markup(tmp_path):
    recs = [_record(0, query=EVIL_QUERY), _record(1, repaired=True, first_ok=False)]
    out = tmp_path / "r.html"
    write_report(_write(tmp_path, recs), out, kb=_kb(tmp_path))
    page = out.read_text(encoding="utf-8")
    # none of the hostile strings appear as markup anywhere in the file
    for raw in ("<script>alert", "</script> Was", "<img src=x", "<a href=", "<!-- built"):
        assert raw not in page, raw
    doc = _Doc()
    doc.feed(page)
    assert [t for t, _ in doc.tags].count("script") == 2            # the data and the page's own script
    assert not [a for _, attrs in doc.tags for a in attrs if a.startswith("on") or a in ("src", "href")]
    (data_attrs, data_text), (_, code) = doc.scripts
    assert data_attrs == {"type": "application/json", "id": "d2r-data"}
    data = json.loads(data_text)
    # the text survives exactly, as text: the page shows what the document said
    assert data["cards"][0]["query"] == EVIL_QUERY
    assert data["cards"][0]["first"]["passages"][0] == {
        "id": "evil", "title": EVIL_TITLE, "text": EVIL_TEXT, "q": [0.7, 0.2, 0.1], "r": None}
    assert "x" not in data["cards"][1]["repair"]                      # no context vector on the page
    # the page's script builds cards from text nodes only, and only it may run (CSP by its hash)
    assert "innerHTML" not in code and "insertAdjacentHTML" not in code and "eval(" not in code
    csp = next(a["content"] for t, a in doc.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    digest = base64.b64encode(hashlib.sha256(code.encode("utf-8")).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp and "default-src 'none'" in csp
    assert "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page


def test_summary_counts_flips_budget_and_arms(tmp_path):
    recs = [_record(0), _record(1, repaired=True, first_ok=False, final_ok=True, failure="insufficient_evidence"),
            _record(2, repaired=True, first_ok=True, final_ok=False, over=True, failure="wrong_response"),
            _record(3, first_ok=False, final_ok=False, failure="wrong_response")]
    cards = [card(r, {}) for r in recs]
    s = summarize(cards)
    assert (s["records"], s["repaired"], s["wrong_to_right"], s["right_to_wrong"], s["over_budget"]) == (4, 2, 1, 1, 1)
    assert s["first_accuracy"] == 0.5 and s["final_accuracy"] == 0.5 and s["graded"] == 4
    assert s["failures"] == {"wrong_response": 2, "no_failure": 1, "insufficient_evidence": 1}
    assert s["arms_by_failure"] == {"insufficient_evidence": {"dense_k10": 1}, "wrong_response": {"dense_k10": 1}}
    assert s["repair_s_p95"] == pytest.approx(0.05 + 0.95 * 3.95) and s["total_s_p50"] == pytest.approx(0.0815)
    c = cards[2]
    assert c["repair"]["budget_s"] == 3.0 and c["repair"]["over_budget"] and c["changed"]
    assert c["final"]["passages"][0]["id"] == "d2" and cards[0]["final"] is None


def test_damaged_lines_are_skipped_and_said(tmp_path, caplog):
    path = _write(tmp_path, [_record(0), _record(1)], extra_lines=['{"id": "q9", "query": "trunc', "[1, 2]"])
    rows, bad = read_records(path)
    assert [r["id"] for r in rows] == ["q0", "q1"] and bad == [3, 4]
    out = tmp_path / "r.html"
    write_report(path, out)
    assert "2 lines skipped" in out.read_text(encoding="utf-8") and "not records" in caplog.text
    (tmp_path / "junk.jsonl").write_text("not json\n")
    with pytest.raises(InputError, match="no line is a d2r-edge record"):
        read_records(tmp_path / "junk.jsonl")
    with pytest.raises(InputError, match="no records file"):
        read_records(tmp_path / "missing.jsonl")


def test_cli_report_writes_next_to_the_records(tmp_path, capsys):
    rec = copy.deepcopy(_record(1, repaired=True, first_ok=False))
    rec["total_s"] = float("nan")                              # a NaN in a record does not break the page's JSON
    path = _write(tmp_path, [rec])
    assert main(["report", str(path)]) == 0
    assert (tmp_path / "records.html").is_file()
    assert "1 records, 1 repaired, 1 wrong -> right" in capsys.readouterr().out


def test_a_record_with_odd_types_still_renders(tmp_path):
    """Records are our own output, but a hand-edited or damaged one must not take the page down."""
    odd = _record(1, repaired=True)
    odd.update(failure=["wrong_response"], task=7, gate={"x": 1}, first_correct="yes")
    odd["repair"].update(allowed="dense_k10", unavailable=["rerank"], budget=None, arm=3, over_budget="no")
    odd["first"].update(passages=None, nli_q="high", timings_s=[1, 2])
    c = card(odd, {})
    assert c["failure"] == "['wrong_response']" and c["task"] == "7" and c["first_correct"] is None
    assert c["repair"]["allowed"] == [] and c["repair"]["unavailable"] == {} and c["repair"]["arm"] == "3"
    assert c["repair"]["over_budget"] is False and c["first"]["passages"] == [] and c["first"]["stages"] == {}
    out = tmp_path / "r.html"
    write_report(_write(tmp_path, [odd, _record(2)]), out)
    assert summarize([c])["failures"] == {"['wrong_response']": 1} and out.stat().st_size > 1000


def test_the_waterfall_partitions_the_query_time_and_names_the_repairs_generation():
    """Issue 54: the waterfall drew the first attempt's stages and the repair's metered cost, which
    left out the gate and counted nothing of what the repair did besides its attempt."""
    rec = _record(1, repaired=True)
    rec["final"]["timings_s"] = {**rec["final"]["timings_s"], "generate_s": 0.5}
    rec.update(gate_s=0.003, repair_s=0.6, total_s=0.7)
    c = card(rec, {})
    parts = dict(c["waterfall"])
    assert list(parts) == ["embed", "retrieve", "generate", "diagnose", "gate", "repair", "other"]
    assert sum(parts.values()) == pytest.approx(0.7, abs=1e-4) and parts["repair"] == 0.6
    assert parts["generate"] == 0.06 and c["repair_generate_s"] == 0.5     # the repair's own, inside repair
    old = card(_record(2, repaired=True), {})     # a record from before gate_s / repair_s: the metered parts
    assert dict(old["waterfall"])["repair"] == pytest.approx(0.05 + 2e-5)
    assert card(_record(3), {})["repair_generate_s"] is None
