"""NLI calls shared between stages and between concurrent requests.

`PairCache`: the scores of recent (premise, hypothesis) pairs, kept. The extractive generator
scores every (passage, claim) pair to pick its label, and the diagnosis scores the same pairs
again for e_q (Alg. 1); a repair that retrieves overlapping passages asks for them a third
time. The model is deterministic, so a pair scored once is scored.

`MicroBatcher`: concurrent requests' pairs collected into one call (up to `max_pairs`, or
whatever arrived within `max_wait_ms` of the first), so a GPU sees big batches. Each caller
gets exactly its rows back. On a CPU the encoders already cut every call into small token
batches (`encoders.CPU_PAIR_BATCH_TOKENS`), so there is little to gain there: the benchmark
(`benchmarks/bench_serve.py`) measures it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, Sequence

import numpy as np

from d2r_edge.errors import ConfigError

log = logging.getLogger(__name__)


class _Delegate:
    """Everything but `score` goes to the wrapped model (labels, session, warmup, ...)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    @property
    def labels(self) -> list[str]:
        return self.inner.labels

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class PairCache(_Delegate):
    """An NLI whose scores of the last `max_pairs` distinct pairs are kept (LRU, thread-safe)."""

    def __init__(self, inner, max_pairs: int = 4096) -> None:
        super().__init__(inner)
        if not isinstance(max_pairs, int) or max_pairs < 1:
            raise ConfigError(f"max_pairs must be an int >= 1, got {max_pairs!r}")
        self.max_pairs = max_pairs
        self._rows: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        pairs = [(p, h) for p, h in pairs]
        if not pairs:
            return self.inner.score([])
        rows: list[np.ndarray | None] = [None] * len(pairs)
        todo: dict[tuple[str, str], list[int]] = {}
        with self._lock:
            for i, pair in enumerate(pairs):
                row = self._rows.get(pair)
                if row is None:
                    todo.setdefault(pair, []).append(i)
                else:
                    self._rows.move_to_end(pair)
                    rows[i] = row
            self.hits += len(pairs) - sum(map(len, todo.values()))
            self.misses += len(todo)
        if todo:
            fresh = self.inner.score(list(todo))
            with self._lock:
                for (pair, idx), row in zip(todo.items(), fresh):
                    row = row.copy()
                    row.flags.writeable = False
                    self._rows[pair] = row
                    for i in idx:
                        rows[i] = row
                while len(self._rows) > self.max_pairs:
                    self._rows.popitem(last=False)
        return np.stack(rows).astype(np.float32, copy=False)


class MicroBatcher(_Delegate):
    """An NLI whose concurrent `score` calls are merged: one worker thread runs them together."""

    def __init__(self, inner, max_pairs: int = 64, max_wait_ms: float = 2.0) -> None:
        super().__init__(inner)
        if not isinstance(max_pairs, int) or max_pairs < 1:
            raise ConfigError(f"max_pairs must be an int >= 1, got {max_pairs!r}")
        if not (isinstance(max_wait_ms, (int, float)) and 0 <= max_wait_ms <= 1000):
            raise ConfigError(f"max_wait_ms must be in [0, 1000], got {max_wait_ms!r}")
        self.max_pairs, self.max_wait_s = max_pairs, max_wait_ms / 1000.0
        self._queue: list[tuple[list, Future]] = []
        self._cond = threading.Condition()
        self.calls = self.pairs = 0
        self.on_batch: Callable[[int], None] | None = None     # pairs per model call (the server's histogram)
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="d2r-nli-batcher", daemon=True)
        self._worker.start()

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        pairs = list(pairs)
        if not pairs:
            return self.inner.score([])
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the NLI batcher is closed")
            self._queue.append((pairs, fut))
            self._cond.notify()
        return fut.result()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._worker.join(5)

    def _take(self) -> list[tuple[list, Future]]:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return []
            first_at = time.monotonic()
            while (sum(len(p) for p, _ in self._queue) < self.max_pairs and not self._closed
                   and (left := self.max_wait_s - (time.monotonic() - first_at)) > 0):
                self._cond.wait(left)
            taken, size = [], 0
            while self._queue and (not taken or size + len(self._queue[0][0]) <= self.max_pairs):
                pairs, fut = self._queue.pop(0)
                taken.append((pairs, fut))
                size += len(pairs)
            return taken

    def _loop(self) -> None:
        while True:
            taken = self._take()
            if not taken:
                return
            merged = [pair for pairs, _ in taken for pair in pairs]
            self.calls += 1
            self.pairs += len(merged)
            if self.on_batch is not None:
                self.on_batch(len(merged))
            try:
                probs = self.inner.score(merged)
            except BaseException as exc:      # every waiting caller gets the model's error
                for _, fut in taken:
                    fut.set_exception(exc)
                continue
            start = 0
            for pairs, fut in taken:
                fut.set_result(probs[start:start + len(pairs)])
                start += len(pairs)
