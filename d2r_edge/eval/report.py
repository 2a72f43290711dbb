"""The answer evaluation's report: summary.json, report.md and (with matplotlib) PNG figures."""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from d2r_edge.eval.context import POLICY_METHODS, Context, Method
from d2r_edge.eval.metrics import (
    fever_label,
    flips,
    macro_f1,
    paired_bootstrap,
    percentiles,
)
from d2r_edge.eval.selective import figure as risk_coverage_figure
from d2r_edge.eval.selective import markdown_lines as selective_lines
from d2r_edge.repair import ARM_NAMES, ARMS
from d2r_edge.signals import FailureType

log = logging.getLogger(__name__)

REFRESH_NOTE = ("refresh arms equal their non-refresh twins here (no stream of new documents in an "
                "evaluation): they were computed once and count as the same outcome")
FIGURES_PIP = "pip install 'd2r-edge[report]'"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def method_metrics(ctx: Context, recs: list[dict], naive: list[dict]) -> dict:
    fever = ctx.settings.task.fact_verification
    final = [r["final_correct"] for r in recs]
    m: dict = {}
    if fever:
        m["accuracy"] = float(np.mean(final))
        m["macro_f1"] = macro_f1([fever_label(r["gold"]) for r in recs], [fever_label(r["final_answer"]) for r in recs])
    else:
        m["em"] = float(np.mean(final))
        m["f1"] = float(np.mean([r["final_f1"] for r in recs]))
    ci = paired_bootstrap([r["final_correct"] for r in naive], final,
                          n_resamples=ctx.settings.bootstrap_resamples, seed=ctx.settings.run.seed)
    m["delta_vs_naive"] = ci.mean
    m["ci95"] = [ci.lo, ci.hi]
    m["beyond_noise"] = ci.excludes_zero
    m["faithfulness"] = float(np.mean([r["final_entailed"] for r in recs]))
    rep = [r for r in recs if r["repaired"]]
    m["repaired_share"] = len(rep) / len(recs)
    m["repair_latency_s_p50"], m["repair_latency_s_p95"] = percentiles([r["latency_s"] for r in rep])
    m["mem_growth_mib_p50"], m["mem_growth_mib_p95"] = percentiles([r["mem_growth_mib"] for r in rep])
    kinds = {r["memory_kind"] for r in rep if r["memory_kind"]}
    m["memory_kind"] = kinds.pop() if len(kinds) == 1 else (sorted(kinds) or None)
    m["budget_violations_pct"] = (100 * sum(bool(r["over_budget"]) for r in rep) / len(rep)) if rep else 0.0
    m["wrong_to_right"], m["right_to_wrong"] = flips([r["first_correct"] for r in recs], final)
    m["arms"] = dict(Counter(r["arm"] for r in rep).most_common())
    if any("kept" in r for r in rep):      # accept/revert: repairs whose first answer stood
        m["reverted"] = sum(r.get("kept") == "first" for r in rep)
    off = {k: v for r in recs for k, v in (r.get("arm_unavailable") or {}).items()}
    if off:
        m["arm_unavailable"] = off     # a fixed-arm baseline whose arm the models cannot run
    return m


def diagnosis_table(ctx: Context) -> dict:
    """Table 4: failure types of the first attempts, and how they agree with the gold evidence."""
    by_type: dict = defaultdict(lambda: {"n": 0, "first_correct": 0})
    signal: dict = defaultdict(lambda: [0, 0])
    ie_tp = ie_fp = ie_fn = ie_nogold = 0
    for q in ctx.test:
        a = ctx.first(q)
        d = a.diagnosis
        ok = ctx.score(q, ctx.answer(a))[0] == 1.0
        t = by_type[d.failure.value]
        t["n"] += 1
        t["first_correct"] += ok
        for name, val in (("e_q", d.e_q.value), ("e_r", d.e_r.value), ("kg", d.kg.value)):
            signal[f"{name}={val}"][0 if ok else 1] += 1
        ie = d.failure is FailureType.INSUFFICIENT_EVIDENCE
        ie_nogold += ie and not q.gold_doc_ids
        if q.gold_doc_ids:
            missing = not (q.gold_doc_ids & {p.doc_id for p in a.passages})
            ie_tp += ie and missing
            ie_fp += ie and not missing
            ie_fn += missing and not ie
    n = len(ctx.test)
    types = {k: {"n": v["n"], "share": v["n"] / n, "first_accuracy": v["first_correct"] / v["n"]}
             for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]["n"])}
    return {"failure_types": types,
            "signals": {k: {"correct": v[0], "incorrect": v[1]} for k, v in sorted(signal.items())},
            "insufficient_vs_no_gold_retrieved": {
                "precision": ie_tp / (ie_tp + ie_fp) if ie_tp + ie_fp else None,
                "recall": ie_tp / (ie_tp + ie_fn) if ie_tp + ie_fn else None,
                "n_no_gold_retrieved": ie_tp + ie_fn, "n_diagnosed_insufficient": ie_tp + ie_fp,
                "n_with_gold": sum(1 for q in ctx.test if q.gold_doc_ids),
                "diagnosed_insufficient_with_gold_retrieved": ie_fp,
                "diagnosed_insufficient_without_gold_evidence": ie_nogold}}


def arm_table(ctx: Context) -> dict:
    """Per failure type (Alg. 1's) and arm, over the test queries the gate sends to repair, where the
    arm is allowed: accuracy after the arm, and flips against the first answer (what each arm does).
    The gate's queries, not Alg. 1's: under the calibrated gate they differ (Alg. 1's `no_failure` is then
    a row too), and these are the queries whose every arm the outcome pass computed for the oracle."""
    out: dict = defaultdict(dict)
    eff = {i: ctx.pipeline.effective(a.apply(ctx.pipeline.default)) for i, a in enumerate(ARMS)}
    for q, first, arm, a, cost in ctx.gated_arm_outcomes(ctx.test, training=False):
        c0, c1 = ctx.score(q, ctx.answer(first))[0], ctx.score(q, ctx.answer(a))[0]
        cell = out[first.diagnosis.failure.value].setdefault(
            ARM_NAMES[arm], {"n": 0, "first": 0, "after": 0, "fixed": 0, "broken": 0, "latency_s": []})
        cell["n"] += 1
        cell["first"] += int(c0)
        cell["after"] += int(c1)
        cell["fixed"] += c1 > c0
        cell["broken"] += c1 < c0
        cell["latency_s"].append(cost.latency_s)
    for cells in out.values():
        for name, c in cells.items():
            lat = c.pop("latency_s")
            c["latency_s_p95"] = percentiles(lat, (95,))[0]
            twin = [ARM_NAMES[j] for j in eff if ARM_NAMES[j] != name and eff[j] == eff[ARM_NAMES.index(name)]]
            c["same_outcome_as"] = twin
    return dict(out)


def policy_picks(records: dict[str, list[dict]]) -> dict:
    picks = {}
    for m, recs in records.items():
        if Method(m) in POLICY_METHODS or Method(m) is Method.ORACLE:
            table: dict = defaultdict(Counter)
            for r in recs:
                if r["arm"]:
                    table[r["first_failure"]][r["arm"]] += 1
            picks[m] = {k: dict(v) for k, v in table.items()}
    return picks


def _detection(ctx: Context) -> dict:
    """`detection`: the row of the score the gate uses; `detection_scores`: every score's row."""
    from d2r_edge.detector import Gate
    from d2r_edge.eval.detection import detection, train_cross_validation

    rows = detection(ctx)
    p = ctx.pipeline
    used = "calibrated" if p.gate is Gate.CALIBRATED else "alg1_nli"
    gate = {"name": p.gate.value, "detector_threshold": p.detector.threshold if p.detector else None}
    from d2r_edge.eval.ablation import ablation

    cv = train_cross_validation(ctx)
    if cv is not None and cv["calibrated_auroc"] is not None and cv["alg1_nli_auroc"] is not None:
        # the per-task gate choice the training queries support (never the test slice)
        cv["gate_by_training_cv"] = "calibrated" if cv["calibrated_auroc"] > cv["alg1_nli_auroc"] else "paper"
    return {"gate": gate, "detection": next(r for r in rows if r["score"] == used), "detection_scores": rows,
            "detection_train_cv": cv, "detection_ablation": ablation(ctx)}


def _selective(ctx: Context) -> dict | None:
    """`selective` (d2r_edge.eval.selective); None when the training side cannot be scored."""
    from d2r_edge.eval.selective import selective

    if not ctx.train or not ctx.test:
        return None
    return selective(ctx)


def summarize(ctx: Context, records: dict[str, list[dict]], extra: dict) -> dict:
    naive = records.get(Method.NAIVE.value) or [
        {**r, "final_correct": r["first_correct"]} for r in next(iter(records.values()))]
    return {"task": ctx.settings.task.value, "n_test": len(ctx.test), "n_train": len(ctx.train), **extra,
            "refresh_arms": REFRESH_NOTE,
            "methods": {m: method_metrics(ctx, recs, naive) for m, recs in records.items()},
            "diagnosis": diagnosis_table(ctx),
            **_detection(ctx),
            "selective": _selective(ctx),
            # every arm on every failing test query: computed for the oracle, so only with it
            "arms_by_failure": arm_table(ctx) if Method.ORACLE.value in records else {},
            "policy_picks": policy_picks(records)}


# --- markdown ---------------------------------------------------------------------------

def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _ci(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "[-]"


def file_labels(paths) -> dict[str, str]:
    """Each path's shortest trailing part that no other path ends with (hotpotqa/dev.jsonl and
    hotpotqa_fullwiki/dev.jsonl are both 'dev.jsonl' by name alone)."""
    parts = {p: Path(p).parts for p in set(paths)}
    labels = {}
    for p, mine in parts.items():
        n = 1
        while n < len(mine) and any(o != p and theirs[-n:] == mine[-n:] for o, theirs in parts.items()):
            n += 1
        labels[p] = "/".join(mine[-n:])
    return labels


def _file_cell(row: dict, labels: dict[str, str]) -> str:
    if "file" not in row:
        return "all"
    name = labels[row["file"]]
    return name if row.get("file_in_training") else f"{name} (no training queries from it)"


def _ablation_lines(ab: dict | None) -> list[str]:
    """Markdown of eval.ablation's tables: per label, each signal group alone and left out; the costs."""
    if not ab:
        return []
    title = "## Which signal carries the detection (test queries; detectors fitted on the training queries)"
    if "skipped" in ab:
        return ["", title, "", f"Not computed: {ab['skipped']}."]
    lines = ["", title]
    for label, t in ab["labels"].items():
        lines += ["", f"Label `{label}`: {t['n_test_wrong']} of {t['n_test']} test first answers wrong "
                      f"({t['n_train_wrong']} of {t['n_train']} training).", ""]
        lines += _table(["detector", "features", "AUROC [95% CI]", "AUPRC [95% CI]", "training CV AUROC (+- sd)"],
                        [[r["variant"] + (f" ({', '.join(r['groups_kept'])})" if r.get("groups_kept") else ""),
                          _num(r.get("features"), "d"),
                          f"{_num(r.get('auroc'))} {_ci(r.get('auroc_ci95'))}" if "skipped" not in r else "-",
                          f"{_num(r.get('auprc'))} {_ci(r.get('auprc_ci95'))}" if "skipped" not in r else "-",
                          (r.get("skipped") or "")[:80] if "skipped" in r else
                          (f"{_num(r.get('train_auroc'))} (its AUROC there)" if "train_auroc" in r else
                           f"{_num(r.get('train_cv_auroc'))} +- {_num(r.get('train_cv_auroc_sd'))}")]
                         for r in t["rows"]])
    costs = ab.get("costs_s") or {}
    lines += ["", f"Training CV: stratified 5-fold over {ab.get('cv_fold_seeds')} fold seeds, training queries only. "
                  "Cost per query of what each group needs (seconds over every first attempt):", ""]
    load = ab.get("generator_per_query") or {}
    lines += _table(["signal", "median s", "p90 s", "generator requests", "generated tokens"],
                    [[k, _num((v or {}).get("median")), _num((v or {}).get("p90")),
                      _num((load.get(k) or {}).get("requests"), ".0f") if load.get(k) else "0",
                      _num((load.get(k) or {}).get("generated_tokens"), ".0f") if load.get(k) else "0"]
                     for k, v in costs.items()])
    lines += ["", "Generated tokens: the self-check exactly 1; the answer its own tokens (JSON wrapper aside); a "
                  "sample counted as long as the greedy answer (estimate)."]
    return lines


def train_arm_lines(arms: dict | None, reward_arm: str | None, labeled_arm: str | None) -> list[str]:
    """The training-side table the fixed-arm methods choose from (eval.methods.train_arm_table)."""
    if not arms:
        return []
    lines = ["", "## Arms on the training queries (what best_fixed and best_fixed_labeled choose from)", ""]
    rows = []
    for arm, a in sorted(arms.items(), key=lambda kv: -kv[1]["mean_reward"]):
        chosen = [m for m, pick in (("best_fixed", reward_arm), ("best_fixed_labeled", labeled_arm)) if pick == arm]
        rows.append([f"`{arm}`", str(a["n"]), f"{a['mean_reward']:.3f}", str(a["fixed"]), str(a["broken"]),
                     ", ".join(chosen) or "-"])
    lines += _table(["arm", "gated training queries where allowed", "mean Eq. 2 reward", "fixed", "broken",
                     "chosen by"], rows)
    lines += ["", "best_fixed ranks by the mean reward, best_fixed_labeled by fixed net of broken (gold labels); "
                  "each arm's mean is over the queries where it is allowed, so an arm the UNVERIFIED rule keeps "
                  "off most gated queries is ranked by the few it may act on."]
    return lines


def methods_cv_lines(cv: dict | None) -> list[str]:
    """The methods' training cross-validation (eval.method_cv) and the default it chooses."""
    if not cv:
        return []
    key = cv["metric"]
    lines = ["", f"## Which method should be the default: {cv['folds']}-fold cross-validation on the {cv['n']} "
                 "training queries", ""]
    lines += _table(["method", key, "delta vs naive [95% CI]", "wrong->right", "right->wrong", "repaired"],
                    [[m, f"{r[key]:.3f}", f"{100 * r['delta_vs_naive']:+.1f} [{100 * r['ci95'][0]:+.1f}, "
                      f"{100 * r['ci95'][1]:+.1f}]", str(r["wrong_to_right"]), str(r["right_to_wrong"]),
                      str(r["repaired"])] for m, r in sorted(cv["methods"].items(),
                                                             key=lambda kv: -kv[1]["delta_vs_naive"])])
    lines += ["", f"Rule: {cv['rule']}. Current default `{cv['current_default']}`; the training CV chooses "
                  f"`{cv['default_by_training_cv']}`"
              + (f" (the best of all methods: `{cv['best_method']}`, which needs its flag)"
                 if cv.get("best_method") not in (None, cv["default_by_training_cv"]) else "")
              + f". Caveat: {cv['leak']}."]
    return lines


def _group_choice_lines(rows: list[dict]) -> list[str]:
    """Which signal groups the calibrated detector kept, and whether its training side could choose them."""
    fit = next((r.get("fit") for r in rows if r.get("score") == "calibrated" and "file" not in r), None) or {}
    if "groups_kept" not in fit:
        return []
    named = {k: ", ".join(fit.get(k) or []) or "-" for k in ("groups_kept", "groups_dropped", "groups_missing")}
    lines = ["", f"The calibrated detector's signal groups (chosen on the {fit.get('n')} training queries): kept "
                 f"{named['groups_kept']}; dropped {named['groups_dropped']}; missing on every training query "
                 f"(never kept) {named['groups_missing']}."]
    if fit.get("selection_reliable") is False:
        lines[-1] += (f" **The training side is too small to select on**: its smaller class holds "
                      f"{fit.get('selection_smaller_class')} queries, and which groups were kept is close to fold "
                      f"noise; read the kept groups as a guess, and the ablation below for what each group carries.")
    return lines


def _diff_cell(row: dict) -> str:
    d = row.get("auroc_minus_alg1_nli")
    if not d or d.get("mean") is None:
        return "-"
    return f"{d['mean']:+.3f} {_ci(d['ci95'])}"


def findings(summary: dict) -> list[str]:
    """'What this says', from the numbers: nothing here is written in advance."""
    ms, fever = summary["methods"], summary["task"] == "fever"
    key = "accuracy" if fever else "em"
    out = []
    if "naive" in ms:
        base = ms["naive"][key]
        ranked = sorted((m for m in ms if m != "naive"), key=lambda m: -ms[m][key])
        for m in ranked[:3]:
            d, (lo, hi) = ms[m]["delta_vs_naive"], ms[m]["ci95"]
            verdict = "beyond noise" if ms[m]["beyond_noise"] else "within noise (the interval holds 0)"
            out.append(f"- `{m}`: {key} {ms[m][key]:.3f} vs naive {base:.3f}, {100 * d:+.1f} points "
                       f"[{100 * lo:+.1f}, {100 * hi:+.1f}]: {verdict}; {ms[m]['wrong_to_right']} wrong->right, "
                       f"{ms[m]['right_to_wrong']} right->wrong.")
        if "oracle" in ms:
            out.append(f"- Headroom: the post-hoc oracle over the allowed arms reaches {ms['oracle'][key]:.3f} "
                       f"({100 * (ms['oracle'][key] - base):+.1f} points over naive); the policies chase this bound.")
    det = summary.get("detection")
    if det and det["n_wrong"]:
        gate = (summary.get("gate") or {}).get("name", "paper")
        what = "generator labels (before the UNVERIFIED gate)" if fever else "first answers"
        out.append(f"- Detection: {det['n_wrong']} of {det['n']} {what} were wrong; the `{gate}` gate flagged "
                   f"{det['flagged']}, {det['flagged_wrong']} of them wrong, so "
                   f"{det['n_wrong'] - det['flagged_wrong']} "
                   f"wrong answers were never offered a repair; `{det['score']}` AUROC "
                   f"{_num(det['auroc'], '.3f')} {_ci(det.get('auroc_ci95'))}, AUPRC {_num(det['auprc'], '.3f')} "
                   f"(base rate {det['n_wrong'] / det['n']:.3f}).")
    diag = summary["diagnosis"]
    ie = diag["insufficient_vs_no_gold_retrieved"]
    types = diag["failure_types"]
    n_fail = sum(v["n"] for k, v in types.items() if k != "no_failure")
    first = "gated first answer (UNVERIFIED counts as NOT ENOUGH INFO)" if fever else "first answer"
    out.append(f"- {n_fail} of {summary['n_test']} first answers were diagnosed as failures; by type: "
               + ", ".join(f"{k} {v['n']} ({first} right in {100 * v['first_accuracy']:.0f}%)"
                           for k, v in types.items()) + ".")
    if ie["recall"] is not None or ie["precision"] is not None:
        out.append(f"- Of the {ie['n_with_gold']} queries with gold evidence, the first retrieval missed it for "
                   f"{ie['n_no_gold_retrieved']}; insufficient_evidence was diagnosed for "
                   f"{ie['n_diagnosed_insufficient']} of them (precision {_num(ie['precision'], '.2f')}, recall "
                   f"{_num(ie['recall'], '.2f')} against 'no gold passage retrieved'): "
                   f"{ie['diagnosed_insufficient_with_gold_retrieved']} times the gold evidence was among the "
                   f"passages and the NLI judged all of them neutral, so a retrieval arm had nothing to add.")
    n_nogold = ie.get("diagnosed_insufficient_without_gold_evidence")
    if n_nogold and fever:
        out.append(f"- insufficient_evidence on {n_nogold} claims that have no gold evidence at all (FEVER NOT "
                   f"ENOUGH INFO): there the diagnosis is right and UNVERIFIED is the right answer; a repair "
                   f"can only lose it.")
    elif n_nogold:
        out.append(f"- insufficient_evidence on {n_nogold} questions whose gold paragraphs are not in the "
                   f"knowledge base (no gold evidence to retrieve).")
    same = [m for m in ms if m.startswith("linucb_") and ms[m][key] == ms.get("linucb", {}).get(key)
            and ms[m]["arms"] == ms["linucb"]["arms"]] if "linucb" in ms else []
    for m in same:
        out.append(f"- `{m}` made the same choices as `linucb`: no arm came near the budget "
                   f"(violations {ms['linucb']['budget_violations_pct']:.1f}%), so the ablated term never acted.")
    for ft, cells in summary["arms_by_failure"].items():
        if not cells:
            continue
        best = max(cells.items(), key=lambda kv: (kv[1]["after"] - kv[1]["first"], -kv[1]["broken"]))
        name, c = best
        gain = c["after"] - c["first"]
        if gain > 0:
            out.append(f"- {ft} ({c['n']} failing queries): the best arm is `{name}`, {c['first']} -> {c['after']} "
                       f"right ({c['fixed']} fixed, {c['broken']} broken).")
        else:
            out.append(f"- {ft} ({c['n']} failing queries): no arm gains (best `{name}`: {c['first']} -> "
                       f"{c['after']} right); repairs cannot help this failure type here.")
    return out


def markdown(summary: dict) -> str:
    ms, fever = summary["methods"], summary["task"] == "fever"
    lines = [f"# d2r-edge eval answers: {summary['task']}", "",
             f"Test queries: {summary['n_test']}; policy-training queries: {summary['n_train']}. "
             f"Generator: {summary.get('generator')}. Models: {summary.get('models')}. "
             f"Budget per repair action: {summary.get('budget')}.", ""]
    if fever:
        lines.append("FEVER accuracy is 3-way; UNVERIFIED (D2R's evidence-gated label) counts as NOT ENOUGH INFO.")
    else:
        lines.append("EM and F1 use SQuAD normalization, against the gold answer and its aliases.")
    if "generator_cache_hits" in summary:
        hits, old = summary["generator_cache_hits"], summary.get("generator_cache_hits_old_key") or 0
        served = summary.get("generator_served_model")      # the server's words: quoted as code, one line
        served = "`" + json.dumps(served, ensure_ascii=True).replace("`", "'")[:300] + "`" if served else None
        lines.append(f"Generator answers from the generation cache in this run: {hits} (asked of the server: "
                     f"{summary.get('generator_calls')}); a replayed answer's attempt counts the time the original "
                     f"call took. The cache is keyed by the model the server serves"
                     f"{f' ({served})' if served else ''}, not its URL"
                     + (f"; {old} of the replayed answers were stored under the key before that (URL and model "
                        f"name), used after the server repeated one of them" if old else "") + ".")
    failed = summary.get("generator_failures") or {}
    if failed.get("train") or failed.get("test"):
        lines.append(f"Left out after a generator failure (after the client's retries): {failed['test']} test and "
                     f"{failed['train']} training queries, from every method (ids and errors in summary.json); "
                     f"a rerun with the same --out tries them again.")
    off = summary.get("unavailable_arms") or {}
    if off:
        lines.append("Arms the loaded models cannot run, never chosen or tried by any method here: "
                     + "; ".join(f"`{a}` ({why})" for a, why in off.items()) + ".")
    for m, v in ms.items():
        for a, why in (v.get("arm_unavailable") or {}).items():
            lines.append(f"`{m}` would apply `{a}`, which is unavailable ({why}): it kept every first answer.")
    lines += ["Differences to `naive` are paired over the same queries, with a 95% bootstrap interval.",
              f"{summary['refresh_arms'][0].upper()}{summary['refresh_arms'][1:]}.", "", "## Table 1", ""]
    head = (["method", "ACC", "macro-F1"] if fever else ["method", "EM", "F1"]) + [
        "delta vs naive [95% CI]", "faithful", "repaired", "repair latency p50/p95 s",
        "mem growth p50/p95 MiB", "over budget", "wrong->right", "right->wrong"]
    rows = []
    for m, v in ms.items():
        q = [f"{v['accuracy']:.3f}", f"{v['macro_f1']:.3f}"] if fever else [f"{v['em']:.3f}", f"{v['f1']:.3f}"]
        rows.append([m, *q, f"{100 * v['delta_vs_naive']:+.1f} [{100 * v['ci95'][0]:+.1f}, {100 * v['ci95'][1]:+.1f}]"
                     + (" *" if v["beyond_noise"] else ""),
                     _pct(v["faithfulness"]), _pct(v["repaired_share"]),
                     f"{_num(v['repair_latency_s_p50'], '.2f')}/{_num(v['repair_latency_s_p95'], '.2f')}",
                     f"{_num(v['mem_growth_mib_p50'], '.1f')}/{_num(v['mem_growth_mib_p95'], '.1f')}"
                     + (f" ({v['memory_kind']})" if isinstance(v["memory_kind"], str) else ""),
                     f"{v['budget_violations_pct']:.1f}%", str(v["wrong_to_right"]), str(v["right_to_wrong"])])
    lines += _table(head, rows)
    lines += ["", "`*`: the interval excludes 0. Faithful: share of final responses entailed by their own "
              "passages (the NLI, no LLM judge). Repaired: share of queries given a repair.", ""]
    if summary.get("best_fixed_arm"):
        lines.append(f"best_fixed uses `{summary['best_fixed_arm']}` (best mean reward on the training queries).")
    if summary.get("best_fixed_labeled_arm"):
        flips = ", ".join(f"`{a}` {f['fixed']}/{f['broken']}"
                          for a, f in (summary.get("arm_flips_on_train") or {}).items())
        lines.append(f"best_fixed_labeled uses `{summary['best_fixed_labeled_arm']}` (most training answers fixed "
                     f"net of those broken; fixed/broken per arm on the gated training queries: {flips}).")
    lines += train_arm_lines(summary.get("arms_on_train"), summary.get("best_fixed_arm"),
                             summary.get("best_fixed_labeled_arm"))
    lines += methods_cv_lines(summary.get("methods_train_cv"))
    forms = summary.get("hypothesis_forms_on_train")
    if forms:
        lines += ["", f"## QA: the answer as NLI hypothesis (training queries; this run used "
                      f"`{summary['qa_hypothesis']}`)", ""]
        lines += _table(["form", "right answers", "entailed if right", "wrong answers", "entailed if wrong",
                         "balanced accuracy"],
                        [[f, str(v["right"]), _pct(v["entailed_if_right"]), str(v["wrong"]),
                          _pct(v["entailed_if_wrong"]), _num(v["balanced_accuracy"], ".3f")] for f, v in forms.items()])
    det = summary.get("detection_scores") or []
    if det:
        labels = file_labels(r["file"] for r in det if "file" in r)
        lines += ["", "## Failure detection (test queries' first answers, before the UNVERIFIED gate)", ""]
        lines += _table(["test file", "score", "AUROC [95% CI]", "AUPRC [95% CI]", "vs alg1_nli [95% CI]",
                         "queries", "wrong", "flagged", "flagged and wrong"],
                        [[_file_cell(r, labels), r["score"], f"{_num(r['auroc'], '.3f')} {_ci(r.get('auroc_ci95'))}",
                          f"{_num(r['auprc'], '.3f')} {_ci(r.get('auprc_ci95'))}", _diff_cell(r), str(r["n"]),
                          str(r["n_wrong"]), str(r["flagged"]), str(r["flagged_wrong"])] for r in det])
        lines += ["", "AUROC: how often a wrong first answer scores above a right one (0.5: chance). "
                      "`alg1_nli`: 1 - min(max P(not neutral | passage, query), max P(entailed | passage, "
                      "response)), the probabilities Algorithm 1 thresholds; flagged: Alg. 1 named a failure. "
                      "`calibrated`: the detector's P(wrong) (fitted on the training queries); flagged: P(wrong) "
                      f">= its threshold. This run's gate: `{(summary.get('gate') or {}).get('name', 'paper')}`."]
        cv = summary.get("detection_train_cv")
        if cv:
            spread = f" +- {cv['calibrated_auroc_sd']:.3f}" if cv.get("calibrated_auroc_sd") is not None else ""
            lines += ["", f"On the {cv['n']} training queries ({cv['n_wrong']} wrong first answers; stratified "
                          f"{cv['folds']}-fold cross-validation over {cv.get('fold_seeds', 1)} fold seeds for the "
                          f"detector, never the test slice): AUROC `alg1_nli` {_num(cv['alg1_nli_auroc'], '.3f')}, "
                          f"`calibrated` {_num(cv['calibrated_auroc'], '.3f')}{spread} (mean +- sd over the seeds)."
                          + (f" The gate these training figures choose: `{cv['gate_by_training_cv']}`."
                             if cv.get("gate_by_training_cv") else "")]
        lines += _group_choice_lines(det)
    lines += _ablation_lines(summary.get("detection_ablation"))
    lines += selective_lines(summary.get("selective"))
    d = summary["diagnosis"]
    lines += ["", "## Table 4: diagnosis", ""]
    lines += _table(["first-pass failure", "queries", "share", "first answer right"],
                    [[k, str(v["n"]), _pct(v["share"]), _pct(v["first_accuracy"])]
                     for k, v in d["failure_types"].items()])
    ie = d["insufficient_vs_no_gold_retrieved"]
    lines += ["", f"insufficient_evidence vs 'no gold passage retrieved', over the {ie['n_with_gold']} queries "
              f"with gold evidence: precision {_num(ie['precision'], '.2f')}, recall {_num(ie['recall'], '.2f')} "
              f"({ie['n_no_gold_retrieved']} without gold in the first retrieval, {ie['n_diagnosed_insufficient']} "
              f"diagnosed insufficient).", ""]
    lines += _table(["signal", "first answer right", "wrong"],
                    [[k, str(v["correct"]), str(v["incorrect"])] for k, v in d["signals"].items()])
    lines += ["", "## Arms by failure type (failing test queries, every allowed arm)", ""]
    rows = []
    for ft, cells in summary["arms_by_failure"].items():
        for name, c in cells.items():
            rows.append([ft, name, str(c["n"]), str(c["first"]), str(c["after"]), str(c["fixed"]), str(c["broken"]),
                         _num(c["latency_s_p95"], ".2f"), ", ".join(c["same_outcome_as"]) or "-"])
    lines += _table(["failure", "arm", "n", "right before", "right after", "fixed", "broken", "latency p95 s",
                     "same outcome as"], rows)
    if summary["policy_picks"]:
        lines += ["", "## Arms picked per failure type", ""]
        for m, table in summary["policy_picks"].items():
            cells = "; ".join(f"{ft}: " + ", ".join(f"{a} {n}" for a, n in sorted(arms.items(), key=lambda kv: -kv[1]))
                              for ft, arms in table.items())
            lines.append(f"- `{m}`: {cells or 'no repairs'}")
    phases = summary.get("phases") or {}
    if phases:
        per = summary.get("answers_per_query") or {}
        lines += ["", "## What this run spent (this invocation; a resumed run counts only its own work)", ""]
        lines += _table(["phase", "wall s", "answers generated", "server requests"],
                        [[k, _num(v["wall_s"], ".0f"), str(v["answers_generated"]), str(v["server_requests"])]
                         for k, v in phases.items()])
        lines += ["", f"Stored attempts per query (train + test): {_num(per.get('stored_attempts_per_query'), '.2f')}; "
                      f"self-consistency samples per first answer: "
                      f"{per.get('self_consistency_samples_per_first_answer')}."]
    lines += ["", "## What this says", "", *findings(summary), ""]
    return "\n".join(lines)


# --- figures ------------------------------------------------------------------------------

def figures(summary: dict, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("no matplotlib: tables written, figures skipped (%s)", FIGURES_PIP)
        return []
    paths = []
    picks = summary["policy_picks"].get("linucb") or next(
        (v for k, v in summary["policy_picks"].items() if k != "oracle"), None)
    if picks:
        types = sorted(picks)
        mat = np.array([[picks[t].get(a, 0) for a in ARM_NAMES] for t in types], dtype=float)
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * len(types)))
        im = ax.imshow(mat, cmap="Blues", aspect="auto")
        ax.set_xticks(range(len(ARM_NAMES)), ARM_NAMES, rotation=45, ha="right")
        ax.set_yticks(range(len(types)), types)
        for (i, j), v in np.ndenumerate(mat):
            if v:
                ax.text(j, i, int(v), ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=ax)
        ax.set_title("Arms the policy picks per failure type (test queries)")
        fig.tight_layout()
        paths.append(out / "fig_arm_picks.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    key = "accuracy" if summary["task"] == "fever" else "em"
    presets = [(f, m) for f, m in ((0.7, "linucb_stringent"), (1.0, "linucb"), (1.5, "linucb_relaxed"))
               if m in summary["methods"]]
    if len(presets) >= 2:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([f for f, _ in presets], [summary["methods"][m][key] for _, m in presets], marker="o", label="linucb")
        if "naive" in summary["methods"]:
            ax.axhline(summary["methods"]["naive"][key], color="grey", ls="--", label="naive")
        ax.set_xlabel("budget (x the run's latency / memory budget)")
        ax.set_ylabel(key)
        ax.legend()
        ax.set_title("Accuracy vs budget preset")
        fig.tight_layout()
        paths.append(out / "fig_budget.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    rc = risk_coverage_figure(summary.get("selective"), out, plt)
    return paths + ([rc] if rc else [])


def write_report(ctx: Context, records: dict[str, list[dict]], extra: dict) -> dict:
    out = ctx.settings.out
    summary = summarize(ctx, records, extra)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    tmp.replace(out / "summary.json")
    (out / "report.md").write_text(markdown(summary), encoding="utf-8")
    summary["figures"] = [str(p) for p in figures(summary, out)]
    return summary
