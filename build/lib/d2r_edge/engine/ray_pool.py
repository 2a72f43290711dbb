"""A pool of Ray actors that each build the models once and take batches of work.

The driver keeps one batch in flight per actor and yields results as they
finish. A batch whose actor dies (killed, node lost, out of memory) is handed
to a fresh actor, so a finished batch is reported once and an unfinished one
is redone: callers write a batch's records only when it is reported, which is
what makes `--engine ray` lose and duplicate nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

from d2r_edge.engine import RayConfig
from d2r_edge.errors import ConfigError, D2RError, EngineError, InputError

log = logging.getLogger(__name__)

SHARED_PATH_HINT = ("on a cluster every node needs the same files at the same path: a shared filesystem "
                    "(NFS, a bucket mount) or a copy on each node")


def require_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--engine ray needs Ray: pip install 'd2r-edge[ray]' (or run with --engine local)") from None
    return ray


def connect(cfg: RayConfig):
    """Join `cfg.address` ("auto", "HOST:PORT") or start a Ray instance here (None)."""
    ray = require_ray()
    if not ray.is_initialized():
        t0 = time.perf_counter()
        try:
            ray.init(address=cfg.address, include_dashboard=False, logging_level=logging.WARNING,
                     configure_logging=False)
        except ConnectionError as exc:
            raise EngineError(f"cannot reach the Ray cluster at {cfg.address!r} ({exc}); start one with "
                              f"`ray start --head` or leave --ray-address out to run Ray inside this "
                              f"process") from None
        log.info("Ray %s ready in %.1f s (%s)", ray.__version__, time.perf_counter() - t0,
                 cfg.address or "local instance")
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < cfg.workers * cfg.cpus_per_worker:
        log.warning("the Ray cluster has %g CPUs; %d workers x %d CPUs will not all start at once",
                    cpus, cfg.workers, cfg.cpus_per_worker)
    return ray


def unreadable(files: dict[str, Path]) -> str | None:
    """The first of `files` (what -> file) this node cannot read, as a sentence naming the node."""
    for what, path in files.items():
        if not os.access(path, os.R_OK):
            why = "missing" if not Path(path).exists() else "not readable"
            return f"node {socket.gethostname()} cannot read the {what} at {path} ({why}); {SHARED_PATH_HINT}"
    return None


def check_every_node(ray, files: dict[str, Path]) -> None:
    """Run `unreadable(files)` on every live node of the cluster; the first problem is raised."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(unreadable)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(files)
            for n in ray.nodes() if n.get("Alive")]
    for problem in ray.get(refs):
        if problem:
            raise InputError(problem)


def run_setup(spec: str | None) -> None:
    """Call `RayConfig.worker_setup` ("package.module:function") in this worker, if given."""
    if not spec:
        return
    import importlib

    module, func = spec.split(":")
    try:
        getattr(importlib.import_module(module), func)()
    except (ImportError, AttributeError) as exc:
        raise InputError(f"node {socket.gethostname()}: worker setup {spec!r} failed ({exc}); the module must "
                         f"be importable on every node") from None


def assigned_threads() -> int:
    """ONNX Runtime threads for this actor: its Ray CPU allotment, not the host's core count."""
    import ray

    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))


class PoolWorker:
    """Base of the pool's actors: checks the files this node must read, runs the setup hook,
    then `load(threads)`. A problem is kept for `problem()` instead of killing the actor, so
    the driver can fail with one message."""

    def __init__(self, files: dict[str, Path], setup: str | None = None) -> None:
        self._problem = unreadable(files)
        if self._problem is None:
            try:
                run_setup(setup)
                self.load(assigned_threads())
            except D2RError as exc:
                self._problem = f"a Ray worker could not load the pipeline: {exc}"

    def load(self, threads: int) -> None:
        raise NotImplementedError

    def problem(self) -> str | None:
        return self._problem


class ActorPool:
    """`cfg.workers` actors of `worker_cls(*args)`; each must offer `problem()` and `work(batch)`."""

    def __init__(self, worker_cls: type, args: tuple, cfg: RayConfig) -> None:
        self.ray = require_ray()
        self.cfg = cfg
        self._remote = self.ray.remote(num_cpus=cfg.cpus_per_worker, max_restarts=0)(worker_cls)
        self._args = args
        self.replaced = 0
        t0 = time.perf_counter()
        self.actors = [self._remote.remote(*args) for _ in range(cfg.workers)]
        self._check(self.actors)
        self.startup_s = time.perf_counter() - t0
        log.info("%d Ray workers ready in %.1f s", cfg.workers, self.startup_s)

    def _check(self, actors: list) -> None:
        try:
            problems = self.ray.get([a.problem.remote() for a in actors])
        except self.ray.exceptions.RayActorError as exc:
            raise EngineError(f"a Ray worker died while loading the models: {exc}") from None
        for problem in problems:
            if problem:
                self.shutdown()
                raise InputError(problem)

    def _replace(self, i: int) -> None:
        self.replaced += 1
        actor = self._remote.remote(*self._args)
        self._check([actor])
        self.actors[i] = actor

    def map_unordered(self, batches: list, on_result: Callable[[int], None] | None = None) -> Iterator[tuple]:
        """Yield (batch index, result) as batches finish; dead workers are replaced and their batch redone."""
        ray = self.ray
        queue = deque((b, 0) for b in range(len(batches)))
        idle = deque(range(len(self.actors)))
        pending: dict = {}
        while queue or pending:
            while idle and queue:
                i = idle.popleft()
                b, tries = queue.popleft()
                pending[self.actors[i].work.remote(batches[b])] = (i, b, tries)
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            i, b, tries = pending.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                if tries >= self.cfg.max_batch_retries:
                    raise EngineError(f"batch {b} lost its worker {tries + 1} times (last: {exc}); "
                                      f"see the Ray logs (/tmp/ray/session_latest/logs)") from None
                log.warning("worker %d died (%s); batch %d goes to a new worker", i, type(exc).__name__, b)
                self._replace(i)
                queue.appendleft((b, tries + 1))
                idle.append(i)
                continue
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, D2RError):
                    raise cause from None
                raise
            idle.append(i)
            yield b, result
            if on_result is not None:
                on_result(b)

    def shutdown(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
