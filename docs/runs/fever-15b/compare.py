"""Does the room for repair, and the share a method takes of it, grow with the generator?

Reads two `d2r-edge eval answers --out` folders run on the same claims with the same verifier and
methods (here Qwen 0.5B and Qwen 1.5B), pairs their per-query rows (`methods/<method>.jsonl`) by query
id, and prints a Markdown table: each generator's naive accuracy, the oracle's room (oracle - naive),
a method's delta and its share of the room, wrong->right / right->wrong, and the 1.5B - 0.5B
differences with 95% paired bootstrap intervals (resampling claims).

    python docs/runs/fever-15b/compare.py --small $WORK/fever-05q --large $WORK/fever-15b \
        --method best_fixed --bootstrap 10000 > docs/runs/fever-15b/compare.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from d2r_edge.eval.metrics import flips, paired_bootstrap


def load(out: Path, method: str) -> dict[str, dict]:
    """The method's per-query records of an `eval answers --out` folder, by query id."""
    with (out / "methods" / f"{method}.jsonl").open(encoding="utf-8") as f:
        return {r["id"]: r for r in map(json.loads, f)}


def right(rows: dict[str, dict], ids: list[str], field: str = "final_correct") -> np.ndarray:
    return np.array([rows[i][field] for i in ids], dtype=float)


def ci(a: np.ndarray, b: np.ndarray, args) -> str:
    """b - a in points with its paired 95% bootstrap interval (claims resampled)."""
    iv = paired_bootstrap(a, b, n_resamples=args.bootstrap, seed=args.seed)
    return f"{100 * iv.mean:+.1f} [{100 * iv.lo:+.1f}, {100 * iv.hi:+.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=Path, required=True, help="the smaller generator's --out folder")
    ap.add_argument("--large", type=Path, required=True, help="the larger generator's --out folder")
    ap.add_argument("--small-name", default="Qwen 0.5B")
    ap.add_argument("--large-name", default="Qwen 1.5B")
    ap.add_argument("--method", default="best_fixed", help="the method whose share of the room is measured")
    ap.add_argument("--bootstrap", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    runs = {name: {m: load(out, m) for m in ("naive", "oracle", args.method)}
            for name, out in ((args.small_name, args.small), (args.large_name, args.large))}
    small_ids, large_ids = set(runs[args.small_name]["naive"]), set(runs[args.large_name]["naive"])
    ids = sorted(small_ids & large_ids)
    if not ids:
        raise SystemExit("the two runs share no query id: run them on the same claims")

    per = {}
    for name, rows in runs.items():
        first = right(rows["naive"], ids, "first_correct")
        if not np.array_equal(first, right(rows[args.method], ids, "first_correct")):
            raise SystemExit(f"{name}: naive and {args.method} disagree on the first answers: not one run")
        per[name] = {m: right(rows[m], ids) for m in ("naive", "oracle", args.method)}

    print(f"Claims in both runs: {len(ids)} (only {len(small_ids - large_ids)} / {len(large_ids - small_ids)} "
          f"in one of them). Method: `{args.method}`. Intervals: 95% bootstrap over claims "
          f"({args.bootstrap} resamples), paired.\n")
    print(f"| generator | naive | oracle | room (oracle - naive) [95% CI] | {args.method} - naive [95% CI] "
          f"| share of the room | wrong->right | right->wrong | naive wrong |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, p in per.items():
        naive, oracle, method = p["naive"], p["oracle"], p[args.method]
        room = oracle.mean() - naive.mean()
        share = f"{(method.mean() - naive.mean()) / room:.0%}" if room > 0 else "-"
        fixed, broken = flips(naive, method)
        print(f"| {name} | {naive.mean():.3f} | {oracle.mean():.3f} | {ci(naive, oracle, args)} "
              f"| {ci(naive, method, args)} | {share} | {fixed} | {broken} | {int((naive == 0).sum())} |")
    s, g = per[args.small_name], per[args.large_name]
    print(f"\n| {args.large_name} - {args.small_name} | points [95% CI] |")
    print("|---|---|")
    for label, a, b in (("naive accuracy", s["naive"], g["naive"]), ("oracle accuracy", s["oracle"], g["oracle"]),
                        ("room", s["oracle"] - s["naive"], g["oracle"] - g["naive"]),
                        (f"{args.method} - naive", s[args.method] - s["naive"], g[args.method] - g["naive"])):
        print(f"| {label} | {ci(a, b, args)} |")


if __name__ == "__main__":
    main()
