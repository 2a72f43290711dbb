"""`d2r-edge run --engine ray`: the queries of a run answered by a pool of Ray actors.

Each actor builds the pipeline once (models, KB, frozen policy; ONNX Runtime
threads = its Ray CPUs) and answers batches with the same `answer_query` as a
local run. The driver appends each batch's records to the same JSONL as they
arrive, so a rerun skips what is recorded, and a batch whose worker dies is
redone elsewhere. Record order follows completion, not the input; `summary`
sorts by id.

What a local run shares across queries cannot be shared by parallel workers,
so it is refused rather than silently changed: policy learning (`train`), the
refresh arm ingesting a queue or a refresh pool mid-run (the KB would diverge
between workers; run `d2r-edge index refresh` first). Outcomes (passages,
answers, diagnoses) equal a local run's; an arm can differ where measured time
decides, as between any two runs: the context's remaining budget, and the cost
model behind budget masking, which each worker starts from the policy's saved
costs and updates from its own repairs only.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

from d2r_edge.engine import RayConfig
from d2r_edge.engine.ray_pool import ActorPool, PoolWorker, connect
from d2r_edge.errors import InputError
from d2r_edge.runner import Query, RecordLog, answer_query, is_error, run_record_ok

log = logging.getLogger(__name__)


def run_files(settings) -> dict[str, Path]:
    """What every worker must read: the models, the KB, and the policy when the driver has one."""
    files = {"models manifest": settings.models / "manifest.json", "KB manifest": settings.kb / "manifest.json"}
    if settings.policy_path is not None and settings.policy_path.is_file():
        files["policy"] = settings.policy_path
    if getattr(settings, "detector_path", None) is not None:
        files["detector"] = settings.detector_path
    return files


def check_parallel_safe(settings) -> None:
    """Refuse what would make parallel workers disagree with a local run."""
    if settings.refresh_pool is not None:
        raise InputError("--refresh-pool adds documents to the KB while queries run, which workers "
                         "cannot share; run without --engine ray, or leave the pool out")
    queue = settings.kb / "queue.jsonl"
    if queue.is_file() and queue.read_text(encoding="utf-8").strip():
        raise InputError(f"{settings.kb} has queued documents: the refresh arm would ingest them mid-run on "
                         f"each worker separately; run `d2r-edge index refresh --kb {settings.kb}` first")


class QueryWorker(PoolWorker):
    """A Ray actor: one pipeline, many batches."""

    def __init__(self, settings, files: dict[str, Path], setup: str | None = None) -> None:
        self.settings = settings
        super().__init__(files, setup)

    def load(self, threads: int) -> None:
        from d2r_edge.app import build_pipeline

        self.pipeline = build_pipeline(replace(self.settings, intra_op_threads=threads))

    def work(self, queries: list[Query]) -> list[dict]:
        return [answer_query(self.pipeline, q, learn=False) for q in queries]


def run_queries(settings, queries: list[Query], out: Path, cfg: RayConfig,
                on_batch: Callable[[ActorPool, int], None] | None = None) -> RecordLog:
    """Answer the queries not yet in `out` on a Ray actor pool; records as batches finish."""
    from tqdm import tqdm

    check_parallel_safe(settings)
    rlog = RecordLog(out, drop=is_error, valid=run_record_ok)       # a query that failed before is tried again
    done = {r["id"] for r in rlog.records if r.get("epoch") is None}
    todo = [q for q in queries if q.id not in done]
    if not todo:
        rlog.close()
        return rlog
    batches = [todo[i:i + cfg.batch_queries] for i in range(0, len(todo), cfg.batch_queries)]
    pool = None
    try:
        connect(cfg)
        pool = ActorPool(QueryWorker, (settings, run_files(settings), cfg.worker_setup), cfg)
        with tqdm(total=len(todo), desc=f"queries ({cfg.workers} Ray workers)", disable=None) as bar:
            hook = None if on_batch is None else (lambda b: on_batch(pool, b))
            for _, records in pool.map_unordered(batches, on_result=hook):
                for rec in records:
                    rlog.append(rec)
                bar.update(len(records))
        if pool.replaced:
            log.warning("%d Ray worker(s) died and were replaced; their batches were redone", pool.replaced)
    finally:
        if pool is not None:
            pool.shutdown()
        rlog.close()
    return rlog
