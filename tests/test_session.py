"""Provider choice: CPU without a GPU, one log line, typed error when CUDA is demanded."""

from __future__ import annotations

import logging

import pytest

from d2r_edge.errors import ConfigError
from d2r_edge.onnx import session as sess
from d2r_edge.onnx.session import Device, SessionConfig, resolve_device


def test_cpu_when_no_gpu(monkeypatch):
    monkeypatch.setattr(sess, "_cuda_usable", lambda: (False, "no NVIDIA driver/GPU visible"))
    assert resolve_device(Device.AUTO) == (Device.CPU, "no NVIDIA driver/GPU visible")
    assert resolve_device(Device.CPU)[0] is Device.CPU
    with pytest.raises(ConfigError, match="device=auto or cpu"):
        resolve_device(Device.CUDA)


def test_cuda_when_usable(monkeypatch):
    monkeypatch.setattr(sess, "_cuda_usable", lambda: (True, "1 GPU(s) visible"))
    assert resolve_device(Device.AUTO)[0] is Device.CUDA
    providers = sess._providers(Device.CUDA, SessionConfig())
    name, opts = providers[0]
    assert name == "CUDAExecutionProvider"
    assert opts["arena_extend_strategy"] == "kSameAsRequested"
    assert providers[-1] == "CPUExecutionProvider"


class _FakeORT:
    """onnxruntime-gpu as pip installs it: the CUDA provider is listed; preload_dlls prints what it misses."""

    def __init__(self):
        self.preloads = 0

    def get_available_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def preload_dlls(self):
        self.preloads += 1
        print("Failed to load /x/nvidia/cudnn/lib/libcudnn.so.9: cannot open shared object file")


class _FakeNVML:
    def __init__(self, count=None):
        self.count = count

    def nvmlInit(self):
        if self.count is None:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlShutdown(self):
        pass


@pytest.mark.parametrize("gpus, usable, preloads", [(1, True, 1), (0, False, 0), (None, False, 0)])
def test_cuda_libraries_from_wheels_are_preloaded_only_with_a_gpu(monkeypatch, capsys, gpus, usable, preloads):
    """Without preload_dlls the CUDA provider cannot find pip's CUDA/cuDNN (RUNPATH is its own folder) and
    every session quietly runs on the CPU; on a machine without a GPU nothing is loaded."""
    import sys

    ort = _FakeORT()
    monkeypatch.setattr(sess, "_ort", lambda: ort)
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML(gpus))
    sess._cuda_usable.cache_clear()
    try:
        assert sess._cuda_usable()[0] is usable and ort.preloads == preloads
    finally:
        sess._cuda_usable.cache_clear()
    assert capsys.readouterr().out == ""            # ORT's prints do not reach a CLI's stdout


def test_this_machine_choice_is_logged_once(tiny_models, caplog):
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest

    sess._logged_choice.clear()
    with caplog.at_level(logging.INFO, logger="d2r_edge.onnx.session"):
        Embedder(load_manifest(tiny_models))
        Embedder(load_manifest(tiny_models))
    lines = [r for r in caplog.records if "ONNX Runtime on" in r.getMessage()]
    assert len(lines) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_bad_session_config():
    with pytest.raises(ConfigError):
        SessionConfig(device="tpu")
    with pytest.raises(ConfigError):
        SessionConfig(intra_op_threads=-1)
    assert SessionConfig(device="cpu").device is Device.CPU


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "max 100000\n"}, None),                                 # v2, unlimited
    ({"cpu.max": "200000 100000\n"}, 2),                                 # v2, --cpus=2
    ({"cpu.max": "150000 100000\n"}, 2),                                 # 1.5 CPUs -> 2 threads
    ({"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"}, 1),   # v1
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),
])
def test_cgroup_quota_caps_threads(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert sess._cgroup_cpu_quota(tmp_path) == expected


def test_threads_follow_the_quota_not_the_host(monkeypatch):
    monkeypatch.setattr(sess.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(sess, "_cgroup_cpu_quota", lambda: 2)
    assert sess.usable_cores() == 2
    monkeypatch.setattr(sess, "_cgroup_cpu_quota", lambda: None)
    assert sess.usable_cores() == 64
