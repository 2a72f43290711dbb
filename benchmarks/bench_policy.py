"""LinUCB select/update vs the reference formulation and the memory floor (11 arms)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.conftest import RESULTS, ratio_or_skip
from d2r_edge.policy import LinUCB

N_ARMS = 11
DIMS = [19, 147, 402, 786]   # 147 = the default context (128 + 19); 786 = the reference's


def _trained(dim: int) -> tuple[LinUCB, np.ndarray]:
    rng = np.random.default_rng(dim)
    pol = LinUCB(N_ARMS, dim, alpha=2.0)
    for _ in range(3 * N_ARMS):
        pol.update(int(rng.integers(N_ARMS)), rng.normal(size=dim), float(rng.random()))
    return pol, rng.normal(size=dim)


def reference_select(A: list[np.ndarray], b: list[np.ndarray], x: np.ndarray, alpha: float) -> int:
    """CyberScienceLab/D2R-RAG's formulation: invert every arm's A on every select."""
    p = np.full(len(A), -np.inf)
    for arm in range(len(A)):
        a_inv = np.linalg.inv(A[arm])
        theta = a_inv @ b[arm]
        p[arm] = theta @ x + alpha * np.sqrt(x @ a_inv @ x)
    return int(np.argmax(p))


@pytest.mark.benchmark(group="policy-select")
@pytest.mark.parametrize("dim", DIMS)
def test_select(benchmark, record, dim):
    pol, x = _trained(dim)
    pol.select(x)  # JIT warm-up (cached on disk after the first run)
    benchmark(pol.select, x)
    record(f"select-{dim}")


@pytest.mark.benchmark(group="policy-update")
@pytest.mark.parametrize("dim", DIMS)
def test_update(benchmark, record, dim):
    pol, x = _trained(dim)
    pol.update(0, x, 0.5)
    benchmark(pol.update, 3, x, 0.5)
    record(f"update-{dim}")


@pytest.mark.benchmark(group="policy-reference")
@pytest.mark.parametrize("dim", DIMS)
def test_reference_select(benchmark, record, dim):
    pol, x = _trained(dim)
    A, b = list(pol.A), list(pol.b)
    rounds = 3 if dim >= 402 else 10
    chosen = benchmark.pedantic(reference_select, args=(A, b, x, 2.0), rounds=rounds, iterations=1)
    assert chosen == pol.select(x)
    record(f"reference-{dim}")


@pytest.mark.benchmark(group="policy-floor")
@pytest.mark.parametrize("dim", DIMS)
def test_memory_floor(benchmark, record, dim):
    """Reading the stacked A_inv once (11*d*d*8 bytes) with a numpy reduction."""
    pol, _ = _trained(dim)
    benchmark(np.sum, pol.A_inv)
    record(f"floor-{dim}")


def test_targets():
    """>= 150x the reference at d=786; p50 <= 100 us at d=147; <= 2x the floor at d >= 147."""
    speedup = ratio_or_skip("reference-786", "select-786")
    assert speedup >= 150, f"select at d=786 is only {speedup:.0f}x the reference"
    assert RESULTS["select-147"] <= 100e-6, RESULTS["select-147"]
    for dim in (147, 402, 786):
        over = ratio_or_skip(f"select-{dim}", f"floor-{dim}")
        assert over <= 2.0, f"select at d={dim} is {over:.2f}x the memory floor"
