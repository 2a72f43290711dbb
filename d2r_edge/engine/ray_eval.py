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

from d2r_edge.engine.ray_pool import ActorPool, PoolWorker, connect
from d2r_edge.engine.ray_run import run_files

log = logging.getLogger(__name__)


class OutcomeWorker(PoolWorker):
    """A Ray actor holding a read-only copy of the evaluation's shared pipeline."""

    def __init__(self, run, task, out: Path, generation_cache: Path | None, files: dict[str, Path],
                 setup: str | None = None) -> None:
        self.run, self.task, self.out, self.generation_cache = run, task, out, generation_cache
        super().__init__(files, setup)

    def load(self, threads: int) -> None:
        from d2r_edge.eval.answers import shared_pipeline

        self.pipeline, self.store, self.gen = shared_pipeline(
            replace(self.run, intra_op_threads=threads), self.out, self.generation_cache, read_only=True)

    def work(self, items: list[tuple[str, bool]]) -> dict:
        from d2r_edge.eval.answers import compute_outcomes

        failed = {}
        for text, every_arm in items:
            error = compute_outcomes(self.pipeline, text, every_arm)
            if error is not None:         # the driver leaves the query out (eval.context.Context.failed)
                failed[text] = error
        rows = {"attempts": self.store.log.take_new(), "generations": self.gen.log.take_new(),
                "generator_calls": self.gen.calls, "failed": failed}
        self.gen.calls = 0
        return rows


class RayAttempts:
    """An `eval.answers.AttemptComputer` on a Ray actor pool; the CLI hands it to `evaluate`."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg        # engine.RayConfig

    def __call__(self, run, s, todo: list[tuple[str, bool]], ctx) -> None:
        """Compute `todo` (query text, every arm?) on the pool; store what comes back as it arrives."""
        from tqdm import tqdm

        cfg = self.cfg
        stored = len(ctx.store)
        # what the store already answers is not sent: a resumed evaluation only ships the rest
        todo = [(t, a) for t, a in todo if t not in ctx.failed
                and (a or not ctx.store.has(t, ctx.pipeline.default, metered=False))]
        batches = [todo[i:i + cfg.batch_queries] for i in range(0, len(todo), cfg.batch_queries)]
        if not batches:
            return
        connect(cfg)
        pool = ActorPool(OutcomeWorker, (run, s.task, s.out, s.generation_cache, run_files(run), cfg.worker_setup),
                         cfg)
        try:  # (a pool that fails to start has shut its actors down itself)
            with tqdm(total=len(todo), desc=f"attempts ({cfg.workers} Ray workers)", disable=None) as bar:
                for b, rows in pool.map_unordered(batches):
                    for row in rows["generations"]:
                        ctx.generator.add(row)
                    for row in rows["attempts"]:
                        ctx.store.add(row)
                    ctx.generator.calls += rows["generator_calls"]
                    for text, error in rows.get("failed", {}).items():
                        ctx.failed.setdefault(text, error)
                    bar.update(len(batches[b]))
        finally:
            pool.shutdown()
        log.info("Ray pool: %d new stored attempts from %d batches (%d workers replaced)",
                 len(ctx.store) - stored, len(batches), pool.replaced)
