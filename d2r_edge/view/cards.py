"""Run and serve records as compact cards and a summary: the data behind `d2r-edge report`.

A card keeps what the page shows of one record and nothing else (no context vector, no raw
request): query, gold, first and final answers, the failure and the signals behind it, each
passage with its title and NLI probabilities, the arms allowed / cost-masked / unavailable with
why, the chosen arm against the budget, and the stage times. Text stays as it came (it is
escaped where it is shown); numbers are rounded to what a person reads.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path

from d2r_edge.errors import InputError
from d2r_edge.eval.metrics import percentiles
from d2r_edge.jsonl import loads as json_line
from d2r_edge.latency import STAGES as PARTS
from d2r_edge.latency import split_s
from d2r_edge.runner import scan_records

STAGES = ("embed_query_s", "retrieve_s", "refresh_s", "generate_s", "diagnose_s")
NLI_KEYS = ("entailment", "neutral", "contradiction")


def read_records(path: Path) -> tuple[list[dict], list[int]]:
    """Records of a JSONL file (run, train or serve --records) and the numbers of lines that are not one
    (a damaged or truncated line is skipped, and the page says which); the file is only read."""
    if not path.is_file():
        raise InputError(f"no records file at {path}: give the --out of `d2r-edge run` or serve's --records")
    rows, bad = scan_records(path, valid=lambda row: isinstance(row.get("id"), (str, int)))
    if bad and not rows:
        raise InputError(f"{path}: no line is a d2r-edge record (first bad line {bad[0]})")
    return rows, bad


def passage_titles(kb_dir: Path | None) -> dict[str, dict]:
    """doc_id -> {title, text} from a KB's chunks (the first chunk's text), for passage cards."""
    if kb_dir is None:
        return {}
    path = Path(kb_dir) / "chunks.jsonl"
    if not path.is_file():
        raise InputError(f"no chunks.jsonl under {kb_dir}: give the --kb the records were answered from")
    out: dict[str, dict] = {}
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json_line(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("doc_id"), str) and row["doc_id"] not in out:
                out[row["doc_id"]] = {"title": str(row.get("title") or ""), "text": str(row.get("text") or "")[:600]}
    return out


def _num(v, digits: int = 4):
    return round(float(v), digits) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        else None


def _list(v) -> list:
    return v if isinstance(v, list) else []


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}


def _probs(p) -> list | None:
    if not isinstance(p, dict):
        return None
    return [_num(p.get(k), 3) for k in NLI_KEYS]


def _attempt(att, titles: dict[str, dict]) -> dict | None:
    if not isinstance(att, dict):
        return None
    ids = [str(x) for x in _list(att.get("passages"))]
    nq, nr = _list(att.get("nli_q")), _list(att.get("nli_r"))
    passages = []
    for i, doc in enumerate(ids):
        meta = titles.get(doc, {})
        passages.append({"id": doc, "title": meta.get("title", ""), "text": meta.get("text", ""),
                         "q": _probs(nq[i]) if i < len(nq) else None, "r": _probs(nr[i]) if i < len(nr) else None})
    times = _dict(att.get("timings_s"))
    return {"label": _text(att.get("label")), "gated": _text(att.get("gated_label")),
            "response": str(att.get("response") or ""), "failure": _text(att.get("failure")),
            "e_q": _text(att.get("e_q")), "e_r": _text(att.get("e_r")), "kg": _text(att.get("kg")),
            "passages": passages, "stages": {k: _num(times.get(k), 5) for k in STAGES if k in times},
            "mem_mib": _num(times.get("mem_growth_mib"), 2)}


def _text(v) -> str | None:
    """A field shown as text: None stays None, anything else its string (a damaged record cannot crash the page)."""
    return None if v is None else v if isinstance(v, str) else str(v)


def _answer(v) -> str:
    if v is None:
        return ""
    return v if isinstance(v, str) else ", ".join(map(str, v)) if isinstance(v, list) else str(v)


def card(rec: dict, titles: dict[str, dict]) -> dict:
    rep = rec.get("repair") if isinstance(rec.get("repair"), dict) else None
    first_c, final_c = rec.get("first_correct"), rec.get("final_correct")
    out = {
        "id": str(rec.get("id")), "task": _text(rec.get("task")), "query": str(rec.get("query") or ""),
        "gold": _answer(rec.get("gold_label") if rec.get("gold_label") is not None else rec.get("gold_answer")),
        "first_answer": _answer(rec.get("first_answer")), "final_answer": _answer(rec.get("final_answer")),
        "first_correct": first_c if isinstance(first_c, bool) else None,
        "final_correct": final_c if isinstance(final_c, bool) else None,
        "failure": _text(rec.get("failure")) or "unknown", "gate": _text(rec.get("gate")),
        "p_wrong": _num(rec.get("p_wrong"), 3),
        "error": None if rec.get("error") is None else str(rec.get("error"))[:300],
        "repair_error": None if rec.get("repair_error") is None else str(rec.get("repair_error"))[:300],
        "total_s": _num(rec.get("total_s"), 4), "first": _attempt(rec.get("first"), titles),
        # a trust certificate's verdict (run/serve --trust): None when the run had none
        "trusted": rec.get("trusted") if isinstance(rec.get("trusted"), bool) else None,
        "abstained": rec.get("abstained") is True, "withheld": _text(rec.get("answer_withheld")),
        "trust_epsilon": _num(_dict(rec.get("trust")).get("epsilon"), 3),
        "final": _attempt(rec.get("final"), titles) if rep else None, "repair": None,
    }
    if rep:
        budget = _dict(rep.get("budget"))
        out["repair"] = {
            "arm": _text(rep.get("arm")), "allowed": [str(a) for a in _list(rep.get("allowed"))],
            "cost_masked": [str(a) for a in _list(rep.get("cost_masked"))],
            "unavailable": {str(k): str(v) for k, v in _dict(rep.get("unavailable")).items()},
            "latency_s": _num(rep.get("latency_s"), 4), "mem_mib": _num(rep.get("mem_growth_mib"), 2),
            "memory_kind": _text(rep.get("memory_kind")), "over_budget": rep.get("over_budget") is True,
            "budget_s": _num(budget.get("latency_s"), 3), "budget_mib": _num(budget.get("device_mem_mib"), 2),
            "reward": _num(rep.get("reward"), 3), "explored": bool(rep.get("explored")),
            "policy_ms": None if _num(rep.get("policy_s")) is None else round(rep["policy_s"] * 1e3, 3),
        }
    out["changed"] = out["first_answer"] != out["final_answer"]
    # the waterfall: the parts of the query's time, which sum to total_s (d2r_edge.latency)
    split = split_s(rec)
    out["waterfall"] = [[k, round(split[k], 5)] for k in PARTS if split[k] > 0]
    out["repair_generate_s"] = round(split["repair_generate"], 5) if rep else None
    return out


def summarize(cards: list[dict]) -> dict:
    """Counts by failure type, repairs and flips, accuracy where gold exists, latency and memory
    percentiles, the over-budget share and the arms picked per failure type."""
    reps = [c for c in cards if c["repair"]]
    graded = [c for c in cards if c["first_correct"] is not None and c["final_correct"] is not None]
    arms: dict[str, Counter] = defaultdict(Counter)
    for c in reps:
        arms[c["failure"]][c["repair"]["arm"] or "none"] += 1
    total_p = percentiles([c["total_s"] for c in cards])
    judged = [c for c in cards if c["trusted"] is not None]
    trusted_graded = [c for c in judged if c["trusted"] and c["final_correct"] is not None]
    rep_s = percentiles([c["repair"]["latency_s"] for c in reps])
    rep_mib = percentiles([c["repair"]["mem_mib"] for c in reps])
    return {
        "records": len(cards), "errors": sum(c["error"] is not None for c in cards),
        "failures": dict(Counter(c["failure"] for c in cards).most_common()),
        "repaired": len(reps), "changed": sum(c["changed"] for c in cards),
        "wrong_to_right": sum(1 for c in graded if not c["first_correct"] and c["final_correct"]),
        "right_to_wrong": sum(1 for c in graded if c["first_correct"] and not c["final_correct"]),
        "graded": len(graded),
        "first_accuracy": sum(c["first_correct"] for c in graded) / len(graded) if graded else None,
        "final_accuracy": sum(c["final_correct"] for c in graded) / len(graded) if graded else None,
        "total_s_p50": total_p[0], "total_s_p95": total_p[1],
        "repair_s_p50": rep_s[0], "repair_s_p95": rep_s[1],
        "repair_mib_p50": rep_mib[0], "repair_mib_p95": rep_mib[1],
        "over_budget": sum(c["repair"]["over_budget"] for c in reps),
        "arms_by_failure": {k: dict(v.most_common()) for k, v in sorted(arms.items())},
        # coverage: the share of judged answers trusted; its error where gold exists
        "trust_judged": len(judged), "trusted": sum(c["trusted"] for c in judged),
        "abstained": sum(c["abstained"] for c in cards),
        "trusted_error": (sum(not c["final_correct"] for c in trusted_graded) / len(trusted_graded)
                          if trusted_graded else None),
        "trust_epsilon": next((c["trust_epsilon"] for c in judged if c["trust_epsilon"] is not None), None),
    }
