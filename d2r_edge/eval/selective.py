"""Selective answering in `eval answers`: coverage and error among trusted answers at certified error rates.

For each failure score (Alg. 1's `alg1_nli`, the detector's `calibrated` P(wrong))
and each ε in selective.EPSILONS, a threshold is certified (d2r_edge.selective)
on the training queries and applied to the test queries: the share of test
answers trusted (coverage) and the error among them. The answer judged is the
one the user would get without repair (FEVER: the gated label, as naive's
accuracy counts it), so naive's error is the flat line of the risk-coverage
figure.

The training queries' detector scores are its out-of-fold P(wrong) (the detector
was fitted on them; an in-sample score would flatter it): a calibration of the
same form as the final model, not of the final model itself, so the guarantee
on the test side is approximate there. The guarantee itself is checked where it
is exact: the test queries' scores (fixed: nothing was fitted on them) are split
at random into a calibration and a test half 200 times (`resplit`), and the
share of splits whose realized test error among trusted answers exceeds ε is
reported beside δ.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from d2r_edge.eval.detection import alg1_score
from d2r_edge.selective import (
    DELTA,
    EPSILONS,
    InsufficientCalibration,
    applied,
    aurc,
    certify,
    resplit_check,
    risk_coverage,
)

log = logging.getLogger(__name__)
RESPLITS = 200


def _labeled(ctx, queries, training: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Each score of the queries' first attempts and whether the delivered first answer is wrong."""
    from d2r_edge.detector import feature_matrix

    firsts = [ctx.first(q) for q in queries]
    wrong = np.array([ctx.score(q, ctx.answer(a))[0] < 1.0 for q, a in zip(queries, firsts)], dtype=bool)
    scores = {"alg1_nli": np.array([alg1_score(a.diagnosis) for a in firsts])}
    det = ctx.pipeline.detector
    if det is not None:
        if training:
            oof = [det.out_of_fold.get(q.text) for q in queries]
            if all(v is not None for v in oof):
                scores["calibrated"] = np.array(oof, dtype=np.float64)
        else:
            scores["calibrated"] = det.p_wrong_many(feature_matrix(firsts, ctx.settings.task.fact_verification))
    return scores, wrong


def selective(ctx, epsilons=EPSILONS, delta: float = DELTA, resplits: int = RESPLITS) -> dict:
    """`selective` of summary.json: one row per (score, ε), each score's AURC on the test queries,
    naive's error, the re-split check, and the curves for the figure."""
    train_scores, train_wrong = _labeled(ctx, ctx.train, training=True)
    test_scores, test_wrong = _labeled(ctx, ctx.test, training=False)
    rows, curves, check = [], {}, []
    for name, test_s in test_scores.items():
        cal_s = train_scores.get(name)
        for eps in epsilons:
            row = {"score": name, "epsilon": eps, "delta": delta, "n_calibration": len(train_wrong),
                   "n_test": len(test_wrong)}
            if cal_s is None:
                rows.append({**row, "threshold": None, "coverage": 0.0, "error": None,
                             "refused": "no out-of-fold scores for the training queries"})
                continue
            try:
                cert = certify(cal_s, train_wrong, eps, delta, name)
            except InsufficientCalibration as exc:
                rows.append({**row, "threshold": None, "coverage": 0.0, "error": None, "trusted": 0,
                             "refused": str(exc)})
                continue
            got = applied(cert, test_s, test_wrong)
            rows.append({**row, "threshold": cert.threshold, "coverage": got["coverage"], "error": got["error"],
                         "trusted": got["trusted"], "errors": got["errors"],
                         "coverage_calibration": cert.coverage_calibration,
                         "error_calibration": cert.errors_trusted / cert.n_trusted, "refused": None})
        cov, risk = risk_coverage(test_s, test_wrong)
        curves[name] = {"coverage": cov.tolist(), "error": risk.tolist()}
        check += resplit_check(test_s, test_wrong, epsilons, delta, resplits, score=name)
    return {"rows": rows, "aurc": {k: aurc(v, test_wrong) for k, v in test_scores.items()},
            "naive_error": float(test_wrong.mean()) if len(test_wrong) else None,
            "n_calibration": int(len(train_wrong)), "n_test": int(len(test_wrong)), "delta": delta,
            "resplit": check, "curves": curves,
            "calibration": "training queries (detector: out-of-fold P(wrong)); re-splits: the test queries"}


def figure(sel: dict, out: Path, plt) -> Path | None:
    """Risk-coverage curves of each score on the test queries, naive's error flat, certified points marked."""
    if not sel or not sel.get("curves"):
        return None
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, c in sel["curves"].items():
        ax.plot(c["coverage"], c["error"], label=f"{name} (AURC {sel['aurc'][name]:.3f})")
        pts = [(r["coverage"], r["error"]) for r in sel["rows"] if r["score"] == name and r.get("error") is not None]
        if pts:
            ax.scatter(*zip(*pts), marker="o", s=18)
    if sel.get("naive_error") is not None:
        ax.axhline(sel["naive_error"], color="grey", ls="--", label="naive (answer everything)")
    ax.set_xlabel("coverage (share of test answers trusted)")
    ax.set_ylabel("error among trusted answers")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Risk-coverage (dots: certified thresholds)")
    fig.tight_layout()
    path = out / "fig_risk_coverage.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_lines(sel: dict | None) -> list[str]:
    if not sel:
        return []
    lines = ["", f"## Selective answering (trusted answers at a certified error; delta {sel['delta']:g})", "",
             "| score | epsilon | threshold | test coverage | test error | trusted | calibration coverage | "
             "re-split violations | re-split coverage |", "|---|---|---|---|---|---|---|---|---|"]
    check = {(r["score"], r["epsilon"]): r for r in sel["resplit"]}
    for r in sel["rows"]:
        c = check.get((r["score"], r["epsilon"])) or {}
        lines.append(
            f"| {r['score']} | {r['epsilon']:g} | {'-' if r['threshold'] is None else format(r['threshold'], '.2f')} | "
            f"{r['coverage']:.1%} | {'-' if r.get('error') is None else format(r['error'], '.3f')} | "
            f"{r.get('trusted', 0)} | {'-' if r.get('coverage_calibration') is None else format(r['coverage_calibration'], '.1%')} | "
            f"{c.get('violation_rate', float('nan')):.3f} | "
            f"{c.get('coverage_mean', float('nan')):.1%} +- {c.get('coverage_sd', float('nan')):.1%} |")
    for name in dict.fromkeys(r["score"] for r in sel["rows"]):
        refused = [r for r in sel["rows"] if r["score"] == name and r.get("refused")]
        if refused:         # the loosest epsilon refused says most about what is missing
            eps = ", ".join(format(r["epsilon"], "g") for r in refused)
            lines += ["", f"- `{name}`, nothing certified at epsilon {eps}: {refused[-1]['refused']}"]
    aurc_s = ", ".join(f"`{k}` {v:.3f}" for k, v in sel["aurc"].items() if v is not None)
    lines += ["", f"Calibrated on the {sel['n_calibration']} training queries (the detector's out-of-fold P(wrong)), "
                  f"applied to the {sel['n_test']} test queries; naive's error {sel['naive_error']:.3f}. AURC (lower "
                  f"is better; naive's error is a random ranking's): {aurc_s}. Re-splits: the test queries halved "
                  f"at random {sel['resplit'][0]['splits'] if sel['resplit'] else 0} times, calibrated on one half, "
                  f"error among trusted answers of the other half above epsilon in that share of the splits (the "
                  f"guarantee: <= delta); a threshold not certified counts as coverage 0."]
    return lines
