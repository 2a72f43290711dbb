"""`d2r-edge eval answers --engine ray`: the evaluation's attempts computed by a Ray actor pool.

What costs time in an evaluation is the attempts: each query's first attempt
and, on the test queries (and the training queries for best_fixed), every
allowed arm of a failing one. The pool computes them with the same shared
pipeline as a local evaluation, reading the driver's stored attempts and
generator answers (so a rerun redoes nothing) and returning only what is new;
the driver writes it to the same files. Every method then reads its test
outcomes from the store. Policy training (Alg. 2) stays on the driver: each
update depends on the ones before it; the arms it asks for on training queries
are computed there on demand, as in a local evaluation.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from d2r_edge.engine.ray_pool import ActorPool, assigned_threads, connect, run_setup, unreadable
from d2r_edge.errors import D2RError

log = logging.getLogger(__name__)


class OutcomeWorker:
    """A Ray actor holding a read-only copy of the evaluation's shared pipeline."""

    def __init__(self, run, task, out: Path, generation_cache: Path | None, files: dict[str, Path],
                 setup: str | None = None) -> None:
        self.task, self.pipeline, self._problem = task, None, unreadable(files)
        if self._problem is None:
            from d2r_edge.eval.answers import shared_pipeline

            try:
                run_setup(setup)
                self.pipeline, self.store, self.gen = shared_pipeline(
                    replace(run, intra_op_threads=assigned_threads()), out, generation_cache, read_only=True)
            except D2RError as exc:
                self._problem = f"a Ray worker could not load the evaluation pipeline: {exc}"

    def problem(self) -> str | None:
        return self._problem

    def work(self, items: list[tuple[str, bool]]) -> dict:
        from d2r_edge.eval.answers import compute_outcomes

        for text, every_arm in items:
            compute_outcomes(self.pipeline, self.task, text, every_arm)
        rows = {"attempts": self.store.new_rows, "generations": self.gen.new_rows,
                "generator_calls": self.gen.calls}
        self.store.new_rows, self.gen.new_rows, self.gen.calls = [], [], 0
        return rows


def compute_on_pool(run, s, todo: list[tuple[str, bool]], ctx) -> None:
    """Compute `todo` (query text, every arm?) on the pool; store what comes back as it arrives."""
    from tqdm import tqdm

    cfg = s.ray
    stored = len(ctx.store)
    # what the store already answers is not sent: a resumed evaluation only ships the rest
    first_key = ctx.pipeline.default
    todo = [(t, a) for t, a in todo if a or ctx.store.get(t, first_key, metered=False) is None]
    batches = [todo[i:i + cfg.batch_queries] for i in range(0, len(todo), cfg.batch_queries)]
    if not batches:
        return
    files = {"models manifest": run.models / "manifest.json", "KB manifest": run.kb / "manifest.json"}
    connect(cfg)
    pool = ActorPool(OutcomeWorker, (run, s.task, s.out, s.generation_cache, files, cfg.worker_setup), cfg)
    try:  # (a pool that fails to start has shut its actors down itself)
        with tqdm(total=len(todo), desc=f"attempts ({cfg.workers} Ray workers)", disable=None) as bar:
            for b, rows in pool.map_unordered(batches):
                for row in rows["generations"]:
                    ctx.generator.add(row)
                for row in rows["attempts"]:
                    ctx.store.add(row)
                ctx.generator.calls += rows["generator_calls"]
                bar.update(len(batches[b]))
    finally:
        pool.shutdown()
    log.info("Ray pool: %d new stored attempts from %d batches (%d workers replaced)",
             len(ctx.store) - stored, len(batches), pool.replaced)
