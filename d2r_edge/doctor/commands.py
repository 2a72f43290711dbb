"""`d2r-edge doctor diagnose`: failed trajectories in, one diagnosis record per trajectory out.

Resumable like `d2r-edge run`: records already in `--out` (by line) are kept and
not recomputed. A summary (error types, culprit kinds, agreement of the checkable
labels with simple rules) goes to `<out>.summary.json`.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import d2r_edge.runner as runner
from d2r_edge.answers import normalize_answer
from d2r_edge.doctor.diagnose import (
    DoctorSettings,
    TrajectoryDiagnoser,
    answer_in,
    is_success,
)
from d2r_edge.doctor.parse import TrajectoryFormat, parse_file
from d2r_edge.doctor.trajectory import StepKind, Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiagnoseRequest:
    trajectories: Path
    out: Path
    fmt: TrajectoryFormat = TrajectoryFormat.AUTO
    limit: int | None = None
    settings: DoctorSettings = DoctorSettings()


def simple_format_rule(t: Trajectory) -> bool:
    """The checkable Format label: prediction and a gold answer equal after SQuAD normalization,
    or one contains the other (QA); the same label up to case and spacing (FEVER)."""
    if t.prediction is None:
        return False
    if t.task == "fever":
        return " ".join(t.prediction.upper().split()) == t.gold[0].upper()
    p = normalize_answer(t.prediction)
    return bool(p) and any((g := normalize_answer(x)) and (g in p or p in g) for x in t.gold)


def simple_sufficiency_rule(t: Trajectory) -> bool | None:
    """The checkable sufficiency label (QA): a gold answer appears in the evidence. None for FEVER."""
    if t.task == "fever":
        return None
    return answer_in(t.gold, " ".join(s.text for s in t.of(StepKind.EVIDENCE)))


def rule_checks(t: Trajectory) -> dict:
    """The two labels checkable without a teacher LLM, by the two rules above."""
    return {"format_rule": simple_format_rule(t), "gold_in_evidence": simple_sufficiency_rule(t)}


def _rate(hits: int, n: int) -> float | None:
    return hits / n if n else None


def summarize(records: list[dict], n_parsed: int, n_issues: int, fmt: str) -> dict:
    types = Counter(r["type"] for r in records)
    kinds = Counter((r["culprit"] or "none").split("]")[-1].strip() or "none" for r in records)
    # (an NLI record has type format exactly when its format signal says so; an LLM record has only the type)
    fmt_agree = [(r["type"] == "format") == bool(r["checks"]["format_rule"]) for r in records]
    suff = [(r["sufficient"], r["checks"]["gold_in_evidence"]) for r in records
            if r["type"] != "format" and r["checks"]["gold_in_evidence"] is not None]
    rule_yes = [r["type"] == "format" for r in records if r["checks"]["format_rule"]]
    rule_no = [r["type"] != "format" for r in records if not r["checks"]["format_rule"]]
    tpr = _rate(sum(a and b for a, b in suff), sum(b for _, b in suff))
    tnr = _rate(sum(not a and not b for a, b in suff), sum(not b for _, b in suff))
    return {"format": fmt, "parsed": n_parsed, "skipped_malformed": n_issues, "failed": len(records),
            "types": dict(types), "culprit_kinds": dict(kinds),
            "format_agrees_with_rule": _rate(sum(fmt_agree), len(fmt_agree)),
            "format_recall": _rate(sum(rule_yes), len(rule_yes)), "format_rule_positive": len(rule_yes),
            "format_specificity": _rate(sum(rule_no), len(rule_no)),
            "sufficiency_agrees_with_gold_in_evidence": _rate(sum(a == b for a, b in suff), len(suff)),
            "sufficiency_balanced_accuracy": None if tpr is None or tnr is None else (tpr + tnr) / 2,
            "sufficiency_recall": tpr, "sufficiency_specificity": tnr,
            "sufficiency_checked": len(suff), "gold_in_evidence": sum(b for _, b in suff),
            "note": "format and sufficiency are checked against simple rules (equal or containing after "
                    "SQuAD normalization; gold answer in the evidence); the culprit step has no gold label here"}


def run_diagnose(req: DiagnoseRequest, nli, llm=None) -> dict:
    """NLI diagnoses; with `llm` (an LLMDiagnoser) the LLM's, each record keeping the NLI's call."""
    parsed = parse_file(req.trajectories, req.fmt)
    failed = [t for t in parsed.trajectories if not is_success(t)][:req.limit]
    rlog = runner.RecordLog(req.out)          # append-only: a kill loses at most the record being written
    done = {int(r["line"]): r for r in rlog.records if isinstance(r, dict) and "line" in r}
    diagnoser = TrajectoryDiagnoser(nli, req.settings)
    records, stale = [], False
    try:
        for i, t in enumerate(failed):
            rec = done.get(t.line)
            if rec is not None:      # the rules are cheap: recomputed, so a reused record follows them
                checks = rule_checks(t)
                stale |= rec.get("checks") != checks
                rec["checks"] = checks
            else:
                nli_d = diagnoser.diagnose(t)
                if llm is not None:
                    rec = llm.diagnose(t, nli_d).record()
                    rec["nli"] = {"type": nli_d.type.value, "culprit": nli_d.culprit, "sufficient": nli_d.sufficient}
                else:
                    rec = nli_d.record()
                rec["checks"] = rule_checks(t)
                rec.update({"question": t.question, "prediction": t.prediction, "gold": list(t.gold)})
                rlog.append(rec)
            records.append(rec)
            if (i + 1) % 100 == 0:
                log.info("diagnosed %d/%d failed trajectories", i + 1, len(failed))
        # the file in input order with current rule checks (records of other trajectories kept after):
        # an atomic rewrite, only when that changes anything
        lines = {t.line for t in failed}
        ordered = records + [r for r in rlog.records if r.get("line") not in lines]
        if stale or ordered != rlog.records:
            rlog.rewrite(ordered)
    finally:
        rlog.close()
    summary = summarize(records, len(parsed.trajectories), len(parsed.issues), parsed.format.value)
    paired = [r for r in records if "nli" in r]
    if paired:
        usable = [r for r in paired if r["signals"].get("llm", {}).get("llm_usable")]
        summary["llm_vs_nli"] = {
            "diagnosed": len(paired), "llm_reply_usable": len(usable),
            "type_agreement": sum(r["type"] == r["nli"]["type"] for r in usable) / max(1, len(usable)),
            "type_and_culprit_agreement": sum(r["type"] == r["nli"]["type"] and r["culprit"] == r["nli"]["culprit"]
                                              for r in usable) / max(1, len(usable)),
            "note": "over the replies that named a known type and an existing step; the others fell back to the NLI"}
    summary["skipped_lines"] = [{"line": i.line, "reason": i.reason} for i in parsed.issues]
    Path(f"{req.out}.summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary
