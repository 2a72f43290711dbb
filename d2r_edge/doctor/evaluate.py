"""`d2r-edge doctor eval`: DR-RAG against rerun, step-wise retry and the two ablations.

Every method repairs the same failed trajectories with the same LLM and the same
knowledge base; records are resumable per method (`<out>/<method>.jsonl`, keyed
by file and line). The knowledge base: the agents searched live Wikipedia,
which we cannot reach, so it holds every observation of the trajectories plus
the paragraphs of `--extra-docs` query files (the report says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from d2r_edge.answers import normalize_answer, token_f1
from d2r_edge.doctor.commands import rule_checks
from d2r_edge.doctor.diagnose import (
    DoctorDiagnosis,
    ErrorType,
    TrajectoryDiagnoser,
    answer_correct,
    is_success,
)
from d2r_edge.doctor.parse import TrajectoryFormat, parse_file
from d2r_edge.doctor.repair import Method, Repairer, RepairSettings
from d2r_edge.doctor.trajectory import StepKind, Trajectory
from d2r_edge.errors import InputError
from d2r_edge.retrieval.docs import Document
from d2r_edge.runner import RecordLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DoctorEvalSettings:
    trajectories: tuple[Path, ...]
    out: Path
    methods: tuple[Method, ...] = tuple(Method)
    limit_per_file: int | None = None       # failed trajectories per file (the first N)
    fmt: TrajectoryFormat = TrajectoryFormat.AUTO
    repair: RepairSettings = field(default_factory=RepairSettings)

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise InputError("doctor eval needs at least one --trajectories FILE")
        if not self.methods:
            raise InputError("doctor eval needs at least one method")


def parse_doctor_methods(text: str | None) -> tuple[Method, ...]:
    if not text:
        return tuple(Method)
    out = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        try:
            out.append(Method(name))
        except ValueError:
            raise InputError(f"unknown doctor method {name!r}; known: {', '.join(m.value for m in Method)}") from None
    return tuple(dict.fromkeys(out))


def observation_docs(trajectories: list[Trajectory]) -> list[Document]:
    """Every evidence block as a document titled by the query that returned it."""
    docs: dict[str, Document] = {}
    for t in trajectories:
        for s in t.of(StepKind.SEARCH):
            ev = t.evidence_for(s)
            if ev is None or len(ev.text) < 40 or ev.text.lower().startswith(("could not find", "no more results")):
                continue
            key = "obs:" + hashlib.sha256(ev.text.encode()).hexdigest()[:16]
            docs.setdefault(key, Document(key, s.text if s.tool and s.tool.value == "search" else "", ev.text))
    return list(docs.values())


def rouge_l(prediction: str | None, gold: tuple[str, ...]) -> float:
    """ROUGE-L F1 on normalized tokens, best over the gold answers."""
    p = normalize_answer(prediction or "").split()
    best = 0.0
    for g in gold:
        r = normalize_answer(g).split()
        if not p or not r:
            continue
        prev = [0] * (len(r) + 1)
        for a in p:
            cur = [0]
            for j, b in enumerate(r):
                cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
            prev = cur
        lcs = prev[-1]
        if lcs:
            prec, rec = lcs / len(p), lcs / len(r)
            best = max(best, 2 * prec * rec / (prec + rec))
    return best


def _f1(t: Trajectory, answer: str | None) -> float:
    return float(answer_correct(t, answer)) if t.task == "fever" else token_f1(answer or "", t.gold)


def diagnosis_correct(rec: dict) -> bool | None:
    """Checkable part of a diagnosis: the Format call vs the rule, else sufficiency vs gold-in-evidence."""
    checks = rec["checks"]
    if (rec["type"] == "format") != checks["format_rule"]:
        return False
    if rec["type"] == "format":
        return True
    g = checks["gold_in_evidence"]
    return None if g is None else rec["sufficient"] == g


def _by_key(records: list[dict]) -> dict:
    return {r["key"]: r for r in records if isinstance(r, dict) and "key" in r}


def method_table(method: str, recs: list[dict], by_key: dict, n_all: int) -> dict:
    fixed = [r["correct"] for r in recs]
    types: dict[str, list[float]] = defaultdict(list)
    diag: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        types[r["type"]].append(r["correct"])
        ok = by_key[r["key"]]["diagnosis_correct"]
        diag["checkable, correct" if ok else "checkable, wrong" if ok is False else "not checkable"].append(
            r["correct"])
    n = max(1, len(recs))
    out = {"failed": len(recs), "repair_rate": sum(fixed) / n,
           "delta_em_points": 100 * sum(fixed) / max(1, n_all),
           "delta_f1_points": 100 * sum(r["f1_after"] - r["f1_before"] for r in recs) / max(1, n_all),
           "rouge_l_before": sum(r["rouge_before"] for r in recs) / n,
           "rouge_l_after": sum(r["rouge_after"] for r in recs) / n,
           "wall_s_mean": sum(r["wall_s"] for r in recs) / n,
           "llm_calls_mean": sum(r["cost"]["llm_calls"] for r in recs) / n,
           "prompt_tokens_mean": sum(r["cost"]["prompt_tokens"] for r in recs) / n,
           "completion_tokens_mean": sum(r["cost"]["completion_tokens"] for r in recs) / n,
           "kept_steps_mean": sum(r["kept_steps"] for r in recs) / n,
           "by_type": {k: {"n": len(v), "repair_rate": sum(v) / len(v)} for k, v in sorted(types.items())},
           "by_diagnosis": {k: {"n": len(v), "repair_rate": sum(v) / len(v)} for k, v in sorted(diag.items())}}
    fmt = [r for r in recs if r["type"] == "format" and r["variants"]]
    if method in (Method.DRRAG.value, Method.NO_LOCALIZATION.value) and fmt:
        out["format_any_variant_rate"] = sum(r["any_variant"] for r in fmt) / len(fmt)
        out["format_variants_mean"] = sum(len(r["variants"]) for r in fmt) / len(fmt)
    return out


def run_doctor_eval(s: DoctorEvalSettings, nli, chat, search) -> dict:
    """Diagnose and repair every failed trajectory of the files with every method; write the report."""
    from d2r_edge.doctor.report import write_report

    s.out.mkdir(parents=True, exist_ok=True)
    diagnoser = TrajectoryDiagnoser(nli)
    failed, n_all, files = [], 0, []
    for i, path in enumerate(s.trajectories):
        parsed = parse_file(path, s.fmt)
        fl = [t for t in parsed.trajectories if not is_success(t)]
        ok = len(parsed.trajectories) - len(fl)
        fl = fl[:s.limit_per_file]
        n_all += ok + len(fl)          # Delta-EM over the successes and the failures evaluated
        failed += [(f"{i}:{t.line}", t) for t in fl]
        files.append({"file": str(path), "format": parsed.format.value, "parsed": len(parsed.trajectories),
                      "succeeded": ok, "failed_used": len(fl), "skipped_malformed": len(parsed.issues)})
    # append-only logs (runner.RecordLog: a torn last line from a kill is cut, finished records stay)
    dlog = RecordLog(s.out / "diagnoses.jsonl")
    diagnoses = _by_key(dlog.records)
    stale = False
    try:
        for key, t in failed:
            checks = rule_checks(t)
            if key in diagnoses:       # the rules are cheap: recomputed, so the tables follow the current ones
                d = diagnoses[key]
                stale |= d.get("checks") != checks
                d["checks"] = checks
                d["diagnosis_correct"] = diagnosis_correct(d)
                continue
            rec = {"key": key, **diagnoser.diagnose(t).record(), "checks": checks}
            rec["diagnosis_correct"] = diagnosis_correct(rec)
            diagnoses[key] = rec
            dlog.append(rec)
        if stale:                      # the file follows the current rules: an atomic rewrite
            dlog.rewrite(list(dlog.records))
    finally:
        dlog.close()
    repairer = Repairer(chat, search, diagnoser, s.repair)
    tables = {}
    for method in s.methods:
        mlog = RecordLog(s.out / f"{method.value}.jsonl")
        done = _by_key(mlog.records)
        try:
            for n, (key, t) in enumerate(failed):
                if key in done:
                    continue
                d = diagnoses[key]
                dd = DoctorDiagnosis(t.line, ErrorType(d["type"]), d["culprit"], d["sufficient"], d["signals"])
                r = repairer.repair(t, dd, method).record()
                r.update({"key": key, "correct": float(answer_correct(t, r["answer"])),
                          "any_variant": (float(any(answer_correct(t, v) for v in r["variants"])) if r["variants"]
                                          else None),
                          "f1_before": _f1(t, t.prediction), "f1_after": _f1(t, r["answer"]),
                          "rouge_before": rouge_l(t.prediction, t.gold), "rouge_after": rouge_l(r["answer"], t.gold)})
                done[key] = r
                mlog.append(r)
                log.info("%s: %d/%d repaired (%s -> %s)", method.value, n + 1, len(failed), t.prediction, r["answer"])
        finally:
            mlog.close()
        tables[method.value] = method_table(method.value, [done[k] for k, _ in failed], diagnoses, n_all)
    summary = {"files": files, "trajectories": n_all, "failed": len(failed),
               "diagnosis_types": dict(Counter(diagnoses[k]["type"] for k, _ in failed)),
               "methods": tables}
    (s.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    write_report(s.out, summary)
    return summary
