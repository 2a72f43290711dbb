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


def load(out: Path, method: str) -> dict[str, dict]:
    rows = [json.loads(line) for line in (out / "methods" / f"{method}.jsonl").open(encoding="utf-8")]
    return {r["id"]: r for r in rows}


def outcomes(out: Path, method: str, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(first right, final right) per query, in `ids` order."""
    rows = load(out, method)
    first = np.array([rows[i]["first_correct"] for i in ids], dtype=float)
    final = np.array([rows[i]["final_correct"] for i in ids], dtype=float)
    return first, final


def interval(values: np.ndarray, idx: np.ndarray) -> tuple[float, float]:
    boot = values[idx].mean(axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(lo), float(hi)


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

    small_ids = set(load(args.small, "naive"))
    large_ids = set(load(args.large, "naive"))
    ids = sorted(small_ids & large_ids)
    if not ids:
        raise SystemExit("the two runs share no query id: run them on the same claims")
    rng = np.random.default_rng(args.seed)
    idx = rng.integers(0, len(ids), size=(args.bootstrap, len(ids)))

    per = {}
    for name, out in ((args.small_name, args.small), (args.large_name, args.large)):
        first, naive = outcomes(out, "naive", ids)
        _, oracle = outcomes(out, "oracle", ids)
        first_m, method = outcomes(out, args.method, ids)
        assert np.array_equal(first, first_m), f"{out}: the methods disagree on the first answers"
        per[name] = {"naive": naive, "oracle": oracle, "method": method,
                     "room": oracle - naive, "delta": method - naive,
                     "fixed": int(((naive == 0) & (method == 1)).sum()),
                     "broken": int(((naive == 1) & (method == 0)).sum()),
                     "wrong": int((naive == 0).sum())}

    n = len(ids)
    print(f"Claims in both runs: {n} (only {len(small_ids - large_ids)} / {len(large_ids - small_ids)} "
          f"in one of them). Method: `{args.method}`. Intervals: 95% bootstrap over claims "
          f"({args.bootstrap} resamples), paired where a difference is shown.\n")
    print(f"| generator | naive | oracle | room (oracle - naive) [95% CI] | {args.method} - naive [95% CI] "
          f"| share of the room | wrong->right | right->wrong | naive wrong |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, p in per.items():
        room, delta = p["room"].mean(), p["delta"].mean()
        share = f"{delta / room:.0%}" if room > 0 else "-"
        rl, rh = interval(p["room"], idx)
        dl, dh = interval(p["delta"], idx)
        print(f"| {name} | {p['naive'].mean():.3f} | {p['oracle'].mean():.3f} | {100 * room:+.1f} "
              f"[{100 * rl:+.1f}, {100 * rh:+.1f}] | {100 * delta:+.1f} [{100 * dl:+.1f}, {100 * dh:+.1f}] "
              f"| {share} | {p['fixed']} | {p['broken']} | {p['wrong']} |")
    s, g = per[args.small_name], per[args.large_name]
    print(f"\n| {args.large_name} - {args.small_name} | points [95% CI] |")
    print("|---|---|")
    for label, a, b in (("naive accuracy", g["naive"], s["naive"]), ("oracle accuracy", g["oracle"], s["oracle"]),
                        ("room", g["room"], s["room"]), (f"{args.method} - naive", g["delta"], s["delta"])):
        d = a - b
        lo, hi = interval(d, idx)
        print(f"| {label} | {100 * d.mean():+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] |")


if __name__ == "__main__":
    main()
