"""Where a query's time went: stages that partition its total.

One split for every place that shows it (records' readers, `serve` responses and
`/metrics`, the report's waterfall), from what a record holds:

- `embed`, `retrieve` (refresh included), `generate`, `diagnose`: the first attempt's stages;
- `gate`: deciding whether to repair (the detector, when one is loaded);
- `repair`: the whole repair action, wall clock: select, the second attempt with its own
  generation, its diagnosis, the reward and the policy update; `repair_generate` names the
  generation inside it (a part of `repair`, not a stage of its own);
- `other`: what the stages leave of the total (assembling the record): total - the stages.

The stages sum to `total`. `overhead` = total - the generator's time in both attempts
(generate + repair_generate): what d2r-edge itself costs.
"""

from __future__ import annotations

STAGES = ("embed", "retrieve", "generate", "diagnose", "gate", "repair", "other")


def _f(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _timings(rec: dict, attempt: str) -> dict:
    a = rec.get(attempt)
    t = a.get("timings_s") if isinstance(a, dict) else None
    return t if isinstance(t, dict) else {}


def repair_seconds(rec: dict) -> float:
    """The repair action's wall time; records written before `repair_s` existed: its metered parts."""
    if "repair_s" in rec:
        return _f(rec["repair_s"])
    rep = rec.get("repair")
    return _f(rep.get("latency_s")) + _f(rep.get("policy_s")) if isinstance(rep, dict) else 0.0


def split_s(rec: dict) -> dict[str, float]:
    """STAGES in seconds (they sum to the record's `total_s`), then total, repair_generate, overhead."""
    t = _timings(rec, "first")
    out = {"embed": _f(t.get("embed_query_s")), "retrieve": _f(t.get("refresh_s")) + _f(t.get("retrieve_s")),
           "generate": _f(t.get("generate_s")), "diagnose": _f(t.get("diagnose_s")),
           "gate": _f(rec.get("gate_s")), "repair": repair_seconds(rec)}
    total = _f(rec.get("total_s"))
    out["other"] = max(0.0, total - sum(out.values()))
    repaired = isinstance(rec.get("repair"), dict)
    out["total"] = total
    rep = rec.get("repair") if repaired else {}
    # the repair's own generation: recorded with it (a reverted repair's final attempt is the first one)
    out["repair_generate"] = (_f(rep["generate_s"]) if "generate_s" in rep
                              else _f(_timings(rec, "final").get("generate_s")) if repaired else 0.0)
    out["overhead"] = max(0.0, total - out["generate"] - out["repair_generate"])
    return out


def split_ms(rec: dict) -> dict[str, float]:
    return {k: round(1000.0 * v, 3) for k, v in split_s(rec).items()}
