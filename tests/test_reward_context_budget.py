"""Eq. 2, the context vector of Appendix B, the meters and the cost model."""

from __future__ import annotations

import types

import numpy as np
import pytest

from d2r_edge.budget import CostModel, MemoryKind, MemoryProbe, MemorySource, Meter
from d2r_edge.config import Budget, ContextConfig, RewardConfig
from d2r_edge.errors import ConfigError, PolicyError
from d2r_edge.policy import ContextBuilder, reward
from d2r_edge.signals import Entailment, FailureType, KGStatus

B = Budget(latency_s=3.0, device_mem_mib=6.0)
FULL, UNCONSTRAINED, UNWEIGHTED = RewardConfig(), RewardConfig(gates=False), RewardConfig(cost_weighting=False)


@pytest.mark.parametrize("nf,kg,nli,lat,mem,cfg,want", [
    (True, True, True, 0.0, 0.0, FULL, 1.0),
    (False, False, False, 0.0, 0.0, FULL, 0.0),
    (True, False, False, 0.0, 0.0, FULL, 0.25),
    (False, True, False, 0.0, 0.0, FULL, 0.25),
    (False, False, True, 0.0, 0.0, FULL, 0.5),
    (True, True, True, 1.5, 0.0, FULL, 0.5),             # (1 - 1.5/3)
    (True, True, True, 1.5, 3.0, FULL, 0.25),            # (1 - .5)(1 - .5)
    (False, False, True, 0.75, 1.5, FULL, 0.5 * 0.75 * 0.75),
    (True, True, True, 3.0, 0.0, FULL, 0.0),             # at the budget: gate open, weight 0
    (True, True, True, 3.01, 0.0, FULL, 0.0),            # over: gated
    (True, True, True, 0.0, 6.5, FULL, 0.0),
    (True, True, True, 1.5, 0.0, UNWEIGHTED, 1.0),       # no cost terms
    (True, True, True, 3.5, 0.0, UNWEIGHTED, 0.0),       # gates still apply
    (True, True, True, 1.5, 3.0, UNCONSTRAINED, 0.25),   # no gates, cost terms stay
    (True, True, True, 4.0, 0.0, UNCONSTRAINED, 0.0),    # weight clipped at 0
    (True, True, True, 9.0, 9.0, RewardConfig(False, False), 1.0),
])
def test_reward_eq2(nf, kg, nli, lat, mem, cfg, want):
    got = reward(no_failure=nf, kg_consistent=kg, nli_entailed=nli, latency_s=lat,
                 device_mem_mib=mem, budget=B, cfg=cfg)
    assert got == pytest.approx(want)


def test_reward_rejects_bad_costs():
    with pytest.raises(PolicyError):
        reward(no_failure=True, kg_consistent=True, nli_entailed=True, latency_s=float("nan"),
               device_mem_mib=0.0, budget=B)
    with pytest.raises(PolicyError):
        reward(no_failure=True, kg_consistent=True, nli_entailed=True, latency_s=-1.0,
               device_mem_mib=0.0, budget=B)


def test_budget_config_validation():
    assert Budget().scaled(0.7).latency_s == pytest.approx(2.1)
    for bad in (dict(latency_s=0), dict(latency_s=-1), dict(device_mem_mib=float("nan")),
                dict(latency_s="3")):
        with pytest.raises(ConfigError):
            Budget(**bad)


def test_context_vector_layout():
    cfg = ContextConfig(embedding_dim=384, query_dim=128)
    builder = ContextBuilder(cfg)
    assert builder.dim == 147
    q = np.random.default_rng(0).normal(size=384)
    x = builder.build(q, FailureType.WRONG_RESPONSE, KGStatus.MISSING, Entailment.ENTAILMENT,
                      Entailment.NEUTRAL, remaining_latency_s=1.5, remaining_mem_mib=9.0, budget=B)
    assert x.shape == (147,)
    assert np.allclose(x[:128], q @ builder.projection)
    assert x[128:133].tolist() == [0, 0, 0, 1, 0]          # failure one-hot
    assert x[133:138].tolist() == [0, 0, 1, 0, 0]          # KG one-hot
    assert x[138:141].tolist() == [1, 0, 0]                # e_q
    assert x[141:144].tolist() == [0, 1, 0]                # e_r
    assert x[144] == 0.5 and x[145] == 1.0 and x[146] == 1.0   # budgets clipped to [0, 1], bias
    same = ContextBuilder(cfg).build(q, FailureType.WRONG_RESPONSE, KGStatus.MISSING,
                                     Entailment.ENTAILMENT, Entailment.NEUTRAL, 1.5, 9.0, B)
    assert np.array_equal(x, same)  # seeded projection


def test_context_full_embedding_and_bad_input():
    builder = ContextBuilder(ContextConfig(embedding_dim=8, query_dim=None))
    assert builder.dim == 27
    q = np.arange(8, dtype=float)
    x = builder.build(q, FailureType.NO_FAILURE, KGStatus.CONSISTENT, Entailment.NEUTRAL,
                      Entailment.NEUTRAL, -1.0, 0.0, B)
    assert np.array_equal(x[:8], q) and x[-3] == 0.0
    with pytest.raises(PolicyError, match="embedding_dim"):
        builder.build(np.ones(7), FailureType.NO_FAILURE, KGStatus.CONSISTENT,
                      Entailment.NEUTRAL, Entailment.NEUTRAL, 1, 1, B)
    with pytest.raises(PolicyError):
        builder.build(np.full(8, np.nan), FailureType.NO_FAILURE, KGStatus.CONSISTENT,
                      Entailment.NEUTRAL, Entailment.NEUTRAL, 1, 1, B)


def _fresh_pages(n_bytes: int):
    """Anonymous memory straight from the kernel, every page touched.

    (numpy/malloc may reuse heap pages freed by an earlier test, which are
    already resident and so do not grow RSS: true, but not what we test.)"""
    import mmap

    block = mmap.mmap(-1, n_bytes)
    for off in range(0, n_bytes, mmap.PAGESIZE):
        block[off] = 1
    return block


def test_host_meter_sees_a_64_mib_allocation():
    meter = Meter(MemoryProbe(prefer_device=False))
    with meter.measure() as m:
        block = _fresh_pages(64 * 1024 * 1024)
    block.close()
    r = m.result
    assert r.memory_kind is MemoryKind.HOST and r.memory_source is MemorySource.HOST_RSS
    assert abs(r.mem_growth_mib - 64.0) <= 4.0
    assert r.latency_s > 0 and r.samples >= 2


def test_meter_catches_a_short_peak():
    meter = Meter(MemoryProbe(prefer_device=False))
    import time

    with meter.measure() as m:
        block = _fresh_pages(32 * 1024 * 1024)
        time.sleep(0.02)
        block.close()    # gone before exit: only the sampler can have seen it
        time.sleep(0.02)
    assert m.result.mem_growth_mib >= 28


class _SetProbe:
    """A host-kind probe whose value the test sets."""

    kind, source = MemoryKind.HOST, MemorySource.HOST_RSS

    def __init__(self):
        self.value = 0

    def read(self):
        return self.value


def test_overlapping_measurements_keep_their_own_start_and_peak():
    import time

    probe = _SetProbe()
    meter = Meter(probe)
    outer = meter.measure()
    with outer:
        probe.value = 10 * 2**20          # seen by outer only
        time.sleep(0.03)
        probe.value = 4 * 2**20
        inner = meter.measure()
        with inner:                        # starts at 4 MiB
            probe.value = 7 * 2**20
            time.sleep(0.03)
            probe.value = 4 * 2**20
        time.sleep(0.01)
    assert outer.result.mem_growth_mib == pytest.approx(10.0)
    assert inner.result.mem_growth_mib == pytest.approx(3.0)
    assert inner.result.samples >= 3 and outer.result.samples > inner.result.samples


def test_one_sampler_thread_per_meter_ended_when_idle(monkeypatch):
    import threading
    import time

    monkeypatch.setattr(Meter, "linger_s", 0.02)
    monkeypatch.setattr(Meter, "idle_exit_s", 0.05)
    meter = Meter(_SetProbe())
    before = set(threading.enumerate())      # other meters' threads, if any
    seen = set()
    for _ in range(50):
        with meter.measure():
            seen.update(t for t in threading.enumerate() if t.name == "d2r-meter")
    mine = meter._thread
    assert seen - before == {mine}           # one thread, reused by all 50
    mine.join(timeout=5)
    assert not mine.is_alive() and meter._thread is None       # idle: gone
    with meter.measure() as m:                                 # and back on use, still sampling
        time.sleep(0.02)
    assert m.result.samples >= 3 and meter._thread is not mine


def test_a_parked_sampler_is_woken_not_replaced(monkeypatch):
    import time

    monkeypatch.setattr(Meter, "linger_s", 0.01)
    monkeypatch.setattr(Meter, "idle_exit_s", 30.0)
    meter = Meter(_SetProbe())
    with meter.measure():
        pass
    first = meter._thread
    deadline = time.monotonic() + 5
    while not meter._parked and time.monotonic() < deadline:
        time.sleep(0.005)
    assert meter._parked
    probe = meter.probe
    with meter.measure() as m:
        probe.value = 3 * 2**20
        time.sleep(0.03)
        probe.value = 0
    assert meter._thread is first and m.result.samples >= 3 and m.result.mem_growth_mib == pytest.approx(3.0)


class _FakeNVML(types.SimpleNamespace):
    """A stand-in for pynvml: one GPU, memory set by the test."""

    def __init__(self, pid_visible: bool, pid: int):
        super().__init__()
        self.used = 100 * 2**20
        self.pid_visible, self.pid = pid_visible, pid

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return "gpu0"

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        if not self.pid_visible:
            return [types.SimpleNamespace(pid=1, usedGpuMemory=7 * 2**20)]
        return [types.SimpleNamespace(pid=self.pid, usedGpuMemory=self.used)]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self.used + 500 * 2**20)


@pytest.mark.parametrize("pid_visible,source", [(True, MemorySource.NVML_PROCESS),
                                                (False, MemorySource.NVML_DEVICE)])
def test_nvml_meter_per_process_and_device_fallback(pid_visible, source):
    import os
    import time

    fake = _FakeNVML(pid_visible, os.getpid())
    probe = MemoryProbe(nvml_module=fake)
    assert probe.kind is MemoryKind.DEVICE and probe.source is source
    with Meter(probe).measure() as m:
        fake.used += 5 * 2**20
        time.sleep(0.03)          # the sampler must see the peak...
        fake.used -= 5 * 2**20    # ...before it is gone at exit
    assert m.result.mem_growth_mib == pytest.approx(5.0)


def test_nvml_missing_falls_back_to_host():
    class Broken:
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    probe = MemoryProbe(nvml_module=Broken())
    assert probe.kind is MemoryKind.HOST and probe.read() > 0


def test_cost_model_masks_and_falls_back(tmp_path):
    cm = CostModel(3, window=8, min_observations=2)
    for _ in range(4):
        cm.observe(0, 0.5, 1.0)    # cheap
        cm.observe(1, 2.5, 5.0)    # expensive
    # arm 2 never seen: predicted to fit, so it can be learned
    res = cm.mask(Budget(3.0, 6.0))
    assert res.allowed.tolist() == [True, True, True] and not res.fallback
    res = cm.mask((1.0, 6.0))
    assert res.allowed.tolist() == [True, False, True]
    res = cm.mask((1.0, 6.0), allowed=np.array([False, True, False]))
    assert res.allowed.tolist() == [False, True, False] and res.fallback
    res = cm.mask((0.1, 0.1), allowed=np.array([True, True, False]))
    assert res.allowed.tolist() == [True, False, False] and res.fallback
    assert cm.mean[0].tolist() == [0.5, 1.0] and np.allclose(cm.std()[1], 0.0)
    cm.save(tmp_path / "c.npz")
    back = CostModel.load(tmp_path / "c.npz")
    assert np.array_equal(back.predict(), cm.predict(), equal_nan=True)
    with pytest.raises(PolicyError):
        cm.observe(0, float("inf"), 1.0)
    with pytest.raises(PolicyError):
        cm.observe(5, 1.0, 1.0)
