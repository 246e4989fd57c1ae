"""Targets are the one vocabulary: detect() picks the target of the visible device, `--backend` names and aliases
resolve once, and what the runtime asks of a target is data on it."""

from __future__ import annotations

import pytest
import torch

import backends
from deepinfer.errors import ConfigError


def fake_gpu(monkeypatch, major: int | None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: major is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, 0))


@pytest.mark.parametrize("major, expected", [(9, "sm90"), (10, "sm100"), (None, "reference")])
def test_detect_picks_the_target_of_the_compute_capability(monkeypatch, major, expected):
    fake_gpu(monkeypatch, major)
    assert backends.detect().name == expected


def test_nvidia_alias_runs_the_sm100_kernels_on_an_sm100_gpu(monkeypatch, tmp_path):
    """--backend nvidia on a (faked) compute capability 10.0 GPU selects sm100: its op table builds and loads
    sm100 kernels, and the run uses CUDA graphs and the target's dtype."""
    from deepinfer.runtime.backend import select

    fake_gpu(monkeypatch, 10)
    backend = select("nvidia", tmp_path)
    assert backend.name == "sm100" and backend.kernel_target == "sm100"
    assert backend.device.type == "cuda" and backend.capture is not None
    assert backend.target.default_dtype == "bfloat16"
    launcher = backend.ops.linear.args[0]._launcher  # the op table's launcher compiles for the selected target
    assert launcher.compiler.target.name == "sm100"


def test_a_second_stream_where_the_target_has_one(monkeypatch, tmp_path):
    """NVIDIA targets give the model a second CUDA stream for a decode step's independent halves; the CPU targets
    none (the model runs those halves in place)."""
    from deepinfer.runtime.backend import select

    assert select("cpu", tmp_path).side_stream() is None and select("c", tmp_path).side_stream() is None
    for name in ("sm90", "sm100"):
        assert backends.get(name).side_stream is not None
    assert backends.get("ascend").side_stream is None


def test_aliases_and_errors(monkeypatch):
    from deepinfer.runtime.backend import resolve

    fake_gpu(monkeypatch, None)
    assert resolve("cpu").name == "reference" and not resolve("cpu").kernels
    assert resolve("c").kernels and resolve("c").device_type == "cpu"
    with pytest.raises(ConfigError, match=r"backend 'nvidia' needs an NVIDIA GPU of compute capability 9\.x"):
        resolve("nvidia")
    with pytest.raises(ConfigError, match=r"backend 'sm100' needs an NVIDIA GPU of compute capability 10\.x"):
        resolve("sm100")
    with pytest.raises(ConfigError, match=r"unknown backend 'tpu'; accepted: sm90, sm100, ascend, c, reference, cpu, nvidia"):
        resolve("tpu")
    with pytest.raises(backends.BackendError, match=r"unknown target 'reference'; accepted: sm90, sm100, ascend, c"):
        backends.compile_target("reference")


def test_every_target_carries_the_runtime_facts():
    for name in backends.TARGET_NAMES:
        t = backends.get(name)
        assert t.name == name and t.device_type in ("cuda", "npu", "cpu") and t.default_dtype in ("bfloat16", "float32")
        assert t.kernels == (name in backends.COMPILE_TARGETS)
        if t.kernels:
            assert t.traits is not None and t.runtime is not None and isinstance(t.toolchain(), dict)
            assert t.stages[0].name == "lower"  # one lowering per kernel; later stages compile its outputs
