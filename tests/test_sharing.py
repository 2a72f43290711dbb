"""NLI scores shared between stages (PairCache) and between concurrent requests (MicroBatcher)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from stand_ins import hash_nli_scores

from d2r_edge.errors import ConfigError
from d2r_edge.onnx.sharing import MicroBatcher, PairCache


class Counting:
    """A stand-in NLI that records each call's pairs (optionally slow, optionally failing)."""

    labels = ["entailment", "neutral", "contradiction"]
    session = "the-session"

    def __init__(self, delay_s: float = 0.0, fail_on: str | None = None) -> None:
        self.calls: list[list] = []
        self.delay_s, self.fail_on = delay_s, fail_on
        self._lock = threading.Lock()

    def score(self, pairs):
        pairs = list(pairs)
        with self._lock:
            self.calls.append(pairs)
        time.sleep(self.delay_s)
        if self.fail_on and any(self.fail_on in h for _, h in pairs):
            raise RuntimeError("model failed")
        return hash_nli_scores(pairs) if pairs else np.zeros((0, 3), dtype=np.float32)


def pairs_of(tag: str, n: int) -> list[tuple[str, str]]:
    return [(f"passage {i}", f"{tag} claim") for i in range(n)]


def test_pair_cache_scores_each_distinct_pair_once_and_answers_like_the_model():
    inner = Counting()
    nli = PairCache(inner, max_pairs=100)
    first = nli.score(pairs_of("a", 5))
    asked = pairs_of("a", 5)[::-1] + pairs_of("b", 2) + [("passage 0", "b claim")]    # a repeat inside
    again = nli.score(asked)
    assert np.array_equal(first, hash_nli_scores(pairs_of("a", 5)))
    assert np.array_equal(again, hash_nli_scores(asked))
    assert inner.calls == [pairs_of("a", 5), pairs_of("b", 2)]          # only the new pairs, each once
    assert (nli.hits, nli.misses) == (5, 7)
    assert nli.labels == inner.labels and nli.session == "the-session"   # the rest is the model's
    assert nli.score([]).shape == (0, 3)
    again[0, 0] = 99.0                                                   # the caller's copy, not the cache's
    assert nli.score(pairs_of("a", 1))[0, 0] != 99.0


def test_pair_cache_evicts_the_least_recently_used():
    inner = Counting()
    nli = PairCache(inner, max_pairs=3)
    nli.score(pairs_of("a", 3))
    nli.score(pairs_of("a", 1))                      # passage 0 used again: passage 1 is now the oldest
    nli.score(pairs_of("b", 1))                      # evicts passage 1
    inner.calls.clear()
    nli.score(pairs_of("a", 3))
    assert inner.calls == [[("passage 1", "a claim")]]
    with pytest.raises(ConfigError):
        PairCache(inner, max_pairs=0)


def test_micro_batcher_merges_concurrent_calls_and_returns_each_its_rows():
    inner = Counting(delay_s=0.05)
    nli = MicroBatcher(inner, max_pairs=40, max_wait_ms=20)
    sizes = []
    nli.on_batch = sizes.append
    jobs = [pairs_of(f"q{i}", 5) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(nli.score, jobs))
    for job, got in zip(jobs, results):
        assert np.array_equal(got, hash_nli_scores(job))
    assert sum(map(len, inner.calls)) == 40 and len(inner.calls) < 8        # merged
    assert all(len(c) <= 40 for c in inner.calls) and sizes == [len(c) for c in inner.calls]
    assert nli.calls == len(inner.calls) and nli.pairs == 40
    nli.close()


def test_micro_batcher_gives_every_caller_of_a_failed_call_the_error_and_goes_on():
    inner = Counting(delay_s=0.02, fail_on="bad")
    nli = MicroBatcher(inner, max_pairs=64, max_wait_ms=30)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(nli.score, pairs_of(tag, 2)) for tag in ("ok1", "bad", "ok2")]
        outcomes = [f.exception(10) for f in futures]
    assert any(isinstance(e, RuntimeError) for e in outcomes)
    assert np.array_equal(nli.score(pairs_of("later", 2)), hash_nli_scores(pairs_of("later", 2)))
    nli.close()
    with pytest.raises(RuntimeError, match="closed"):
        nli.score(pairs_of("x", 1))
    with pytest.raises(ConfigError):
        MicroBatcher(inner, max_pairs=0)
    with pytest.raises(ConfigError):
        MicroBatcher(inner, max_wait_ms=-1)


def test_a_single_call_larger_than_max_pairs_runs_whole():
    inner = Counting()
    nli = MicroBatcher(inner, max_pairs=4, max_wait_ms=0)
    assert np.array_equal(nli.score(pairs_of("big", 10)), hash_nli_scores(pairs_of("big", 10)))
    assert [len(c) for c in inner.calls] == [10]
    nli.close()
