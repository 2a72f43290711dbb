"""Policy and cost-model files, damaged in generated ways (hypothesis).

A saved LinUCB / Thompson / cost file with one entry replaced (another shape,
NaN/inf, text, a negative count, gone) must load into a usable object or raise
PolicyFileError naming the file; never another exception, never a policy that
then selects from NaNs.
"""

from __future__ import annotations

import io
import os
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stand_ins import longer, search_longer

from d2r_edge.budget import CostModel
from d2r_edge.errors import D2RError
from d2r_edge.policy import LinUCB, ThompsonSampling

EXAMPLES = int(os.environ.get("D2R_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
ARMS = [f"arm{i}" for i in range(3)]


def _saved(kind: str, path) -> None:
    rng = np.random.default_rng(0)
    if kind == "linucb":
        p = LinUCB(3, 4, 1.0, arm_names=ARMS)
        for _ in range(20):
            p.update(int(rng.integers(3)), rng.normal(size=4), float(rng.random()))
    elif kind == "thompson":
        p = ThompsonSampling(3, arm_names=ARMS)
        for _ in range(20):
            p.update(int(rng.integers(3)), None, float(rng.random()))
    else:
        p = CostModel(3)
        for _ in range(20):
            p.observe(int(rng.integers(3)), float(rng.random()), float(rng.random()))
    p.save(path)


_replacement = st.one_of(
    st.just(None),                                            # the entry is gone
    st.sampled_from([np.nan, np.inf, -np.inf, -5.0, 0.0, 1e308]).map(lambda v: ("fill", v)),
    st.sampled_from([np.zeros((2, 2)), np.zeros(0), np.array("text"), np.array([1, 2, 3]), np.array(-1),
                     np.array(10**6), np.array(["a", "b"])]).map(lambda a: ("array", a)),
)


def _damaged(path, key: str, how) -> None:
    with np.load(path, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    if key not in data:
        return
    if how is None:
        del data[key]
    elif how[0] == "fill":
        a = data[key]
        if a.dtype.kind == "f" or (a.dtype.kind in "iu" and np.isfinite(how[1]) and abs(how[1]) < 2**62):
            data[key] = np.full_like(a, how[1])
        else:
            data[key] = np.full(a.shape, how[1])
    else:
        data[key] = how[1]
    buf = io.BytesIO()
    np.savez(buf, **data)
    path.write_bytes(buf.getvalue())


def _use(kind: str, obj) -> None:
    if kind == "costs":
        from d2r_edge.config import Budget

        obj.mask(Budget(), np.ones(3, dtype=bool))
    else:
        arm = obj.select(np.ones(4) if kind == "linucb" else None)
        assert 0 <= arm < 3


_KEYS = {"linucb": ["n_arms", "dim", "alpha", "reinvert_every", "arm_names", "A", "A_inv", "b", "theta", "counts",
                    "since_reinvert", "rank", "W", "format_version", "kind"],
         "thompson": ["n_arms", "threshold", "seed", "arm_names", "successes", "failures", "xoshiro_state"],
         "costs": ["n_arms", "window", "quantile", "min_observations", "count", "mean", "m2", "recent"]}


@FUZZ
@given(data=st.data())
@pytest.mark.parametrize("kind", list(_KEYS))
def test_a_damaged_policy_file_loads_usable_or_is_refused(tmp_path, kind, data):
    path = tmp_path / f"{kind}.npz"
    _saved(kind, path)
    key = data.draw(st.sampled_from(_KEYS[kind]))
    _damaged(path, key, data.draw(_replacement))
    load = {"linucb": lambda p: LinUCB.load(p, arm_names=ARMS), "thompson": lambda p: ThompsonSampling.load(p),
            "costs": CostModel.load}[kind]
    try:
        obj = load(path)
    except D2RError as exc:
        assert path.name in str(exc), exc
        return
    _use(kind, obj)


def test_a_truncated_policy_file_is_refused(tmp_path):
    from d2r_edge.errors import PolicyFileError

    for kind in _KEYS:
        path = tmp_path / f"{kind}.npz"
        _saved(kind, path)
        raw = path.read_bytes()
        for cut in (0, 10, len(raw) // 2, len(raw) - 1):
            path.write_bytes(raw[:cut])
            with pytest.raises(PolicyFileError, match=path.name):
                {"linucb": LinUCB.load, "thompson": ThompsonSampling.load, "costs": CostModel.load}[kind](path)
    assert zipfile.is_zipfile(io.BytesIO(raw))


@pytest.mark.slow
def test_policy_files_with_more_examples():
    """The same property searched 5x longer (the `slow` step; 20x under `.ci/run --full`)."""
    search_longer(__file__, EXAMPLES * longer(5, 20), "-W", "error::RuntimeWarning")
