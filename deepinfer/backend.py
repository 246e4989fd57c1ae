"""Which device, op table and graph capture a run uses: `cpu` (PyTorch references, eager decode), `nvidia`
(TileLang kernels for sm_90a, CUDA graphs), `ascend` (TileLang kernels for Ascend 950 through torch_npu, NPU
graphs; never run on hardware here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from deepinfer.env import Env
from deepinfer.errors import ConfigError
from tilekernels import OpTable

BACKENDS = ("cpu", "nvidia", "ascend")


@dataclass(frozen=True)
class Backend:
    name: str
    device: torch.device
    ops: OpTable
    capture: Callable[[Callable[[], Any]], tuple[Any, Callable[[], Any]]] | None  # None: decode runs eagerly
    kernel_target: str | None  # the compile target whose kernels run (None: PyTorch references)


def default_backend(env: Env) -> str:
    """DEEPINFER_ACCELERATOR when set, else nvidia when a CUDA device is visible, else cpu."""
    if env.accelerator is not None:
        return env.accelerator
    return "nvidia" if torch.cuda.is_available() else "cpu"


def select(name: str | None, cache_dir: Path, env: Env | None = None, kernel_target: str | None = None) -> Backend:
    env = env or Env.read()
    name = name or default_backend(env)
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r} is not known; accepted: {', '.join(BACKENDS)}")
    if name == "cpu":
        from tilekernels import reference_table

        return Backend("cpu", torch.device("cpu"), reference_table(), None, None)
    from tilekernels.kernels import kernel_table

    if name == "nvidia":
        if not torch.cuda.is_available():
            raise ConfigError("backend 'nvidia' needs a CUDA device, and torch sees none; use --backend cpu")
        from backends.nvidia.graphs import CudaGraphs

        target = kernel_target or "sm90"
        return Backend("nvidia", torch.device("cuda"), kernel_table(target, cache_dir), CudaGraphs(), target)
    from backends.ascend.graphs import NpuGraphs

    try:
        capture = NpuGraphs()
    except ImportError as exc:
        raise ConfigError("backend 'ascend' needs torch_npu and an Ascend NPU (pip install 'deepinfer[ascend]')") from exc
    return Backend("ascend", torch.device("npu"), kernel_table("ascend", cache_dir), capture, "ascend")
