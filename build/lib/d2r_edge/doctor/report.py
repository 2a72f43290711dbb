"""The doctor evaluation's report.md (and a PNG with the [report] extra)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def markdown(summary: dict) -> str:
    lines = ["# Trajectory repair (Doctor-RAG): DR-RAG vs baselines", ""]
    for f in summary["files"]:
        lines.append(f"- `{f['file']}` ({f['format']}): {f['parsed']} parsed, {f['succeeded']} succeeded, "
                     f"{f['failed_used']} failed used, {f['skipped_malformed']} malformed lines skipped")
    lines += ["", f"Failed trajectories repaired: {summary['failed']}; diagnosis types: "
              + ", ".join(f"{k} {v}" for k, v in sorted(summary["diagnosis_types"].items())), "",
              "Knowledge base for re-retrieval: every observation of the trajectories plus the paragraphs of the "
              "extra query files (the agents searched live Wikipedia, which is not reachable here).", "",
              "| method | repair rate % | dEM (pts) | dF1 (pts) | ROUGE-L before/after | wall s/traj | LLM calls | "
              "prompt tok | completion tok | steps kept |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in summary["methods"].items():
        lines.append(f"| {name} | {_pct(m['repair_rate'])} | {m['delta_em_points']:+.1f} | "
                     f"{m['delta_f1_points']:+.1f} | "
                     f"{m['rouge_l_before']:.3f}/{m['rouge_l_after']:.3f} | {m['wall_s_mean']:.1f} | "
                     f"{m['llm_calls_mean']:.2f} | {m['prompt_tokens_mean']:.0f} | "
                     f"{m['completion_tokens_mean']:.0f} | "
                     f"{m['kept_steps_mean']:.1f} |")
    lines += ["", "Repair rate: share of failed trajectories (EM 0) whose repaired single answer has EM 1 (strict).",
              "", "## Repair rate by error type and by diagnosis correctness (paper Table 5)", ""]
    types = sorted({t for m in summary["methods"].values() for t in m["by_type"]})
    lines += ["| method | " + " | ".join(types) + " | checkable, correct | checkable, wrong | not checkable |",
              "|---" * (len(types) + 4) + "|"]
    for name, m in summary["methods"].items():
        cells = [f"{_pct(m['by_type'][t]['repair_rate'])} (n={m['by_type'][t]['n']})" if t in m["by_type"] else "-"
                 for t in types]
        cells += [f"{_pct(m['by_diagnosis'][k]['repair_rate'])} (n={m['by_diagnosis'][k]['n']})"
                  if k in m["by_diagnosis"] else "-"
                  for k in ("checkable, correct", "checkable, wrong", "not checkable")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Diagnosis correctness is checkable only for the Format call (containment / token F1 >= 0.8) "
              "and for evidence sufficiency on QA (gold answer in the evidence); the culprit step has no gold "
              "label here."]
    fmt = {k: m for k, m in summary["methods"].items() if "format_any_variant_rate" in m}
    if fmt:
        lines += ["", "## Format errors: the paper's any-of-the-variants metric (not strict EM)", "",
                  "| method | any variant matches % | variants per answer |", "|---|---|---|"]
        for k, m in fmt.items():
            lines.append(f"| {k} | {_pct(m['format_any_variant_rate'])} | {m['format_variants_mean']:.1f} |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, summary: dict) -> None:
    (out / "report.md").write_text(markdown(summary), encoding="utf-8")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: report.md only (pip install 'd2r-edge[report]' for the figure)")
        return
    names = list(summary["methods"])
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(names, [100 * summary["methods"][n]["repair_rate"] for n in names])
    ax.set_ylabel("repair rate (%)")
    ax.set_title("failed trajectories repaired (strict EM)")
    fig.tight_layout()
    fig.savefig(out / "fig_repair_rate.png", dpi=120)
    plt.close(fig)
