"""The server's Prometheus metrics (prometheus-client), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from d2r_edge.latency import STAGES as PARTS
from d2r_edge.runtime import Result

# per-stage seconds: the embedder's few ms up to a CPU LLM's tens of seconds
_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# the parts of a request's time (they sum to total), then total, the repair's own generation (inside
# repair) and overhead (total minus both generations: d2r-edge's own cost); d2r_edge.latency
STAGES = (*PARTS, "total", "repair_generate", "overhead")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("d2r_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.stage = Histogram("d2r_stage_seconds", "Per-request time by stage (the parts embed..other sum to total; "
                               "overhead = total - generate - repair_generate)",
                               ["stage"], buckets=_BUCKETS_S, registry=r)
        self.failures = Counter("d2r_failures", "First answers by diagnosed failure type", ["failure_type"],
                                registry=r)
        self.arms = Counter("d2r_arms", "Repair arms chosen", ["arm"], registry=r)
        self.skipped = Counter("d2r_repairs_skipped", "Diagnosed failures left unrepaired, by reason", ["reason"],
                               registry=r)
        self.over_budget = Counter("d2r_budget_violations", "Repair actions over the latency or memory budget",
                                   registry=r)
        self.in_flight = Gauge("d2r_requests_in_flight", "Requests admitted and not finished", registry=r)
        self.policy_updates = Counter("d2r_policy_updates", "Online policy updates (--learn)", registry=r)
        self.batch_pairs = Histogram("d2r_nli_batch_pairs", "NLI pairs per merged model call (--micro-batch-pairs)",
                                     buckets=(1, 2, 5, 10, 15, 20, 30, 40, 60, 80, 120, 160, 256), registry=r)

    def observe(self, res: Result) -> None:
        for stage in STAGES:
            self.stage.labels(stage).observe(res.latency_ms[stage] / 1000.0)
        self.failures.labels(res.failure.value).inc()
        if res.arm:
            self.arms.labels(res.arm).inc()
        if res.skipped:
            self.skipped.labels(res.skipped.get("reason", "unknown")).inc()
        if res.over_budget:
            self.over_budget.inc()
