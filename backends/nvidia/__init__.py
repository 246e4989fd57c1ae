"""NVIDIA targets sm_90a (Hopper) and sm_100a (Blackwell): TileLang IR -> CUDA source -> cubin (nvcc) ->
host+device library; the runtime loads the library and launches on the current torch stream, which also
works inside CUDA graph capture."""

from __future__ import annotations

from backends.base import Target, Traits
from backends.nvidia.stages import NvidiaRuntime, cuda_stages, toolchain

_GRID = dict(dialect="tilelang.cuda.language", launch="grid", cores=0, io_scope="shared.dyn", operand_scope="shared.dyn",
             vec="fragment", reg="fragment", vector_region=False, vector_halves=False, dependent_launch=True)
_PASS_CONFIGS: dict = {}


def compute_capability_major() -> int | None:
    """The visible CUDA device's compute capability major (None: no CUDA device torch can use)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()[0]


def _graphs():
    from backends.nvidia.graphs import CudaGraphs

    return CudaGraphs()


def _side_stream(device):
    from backends.nvidia.side_stream import SideStream

    return SideStream(device)


def _memory(device) -> tuple[int, int]:
    import torch

    return torch.cuda.mem_get_info(device)


def _bind(local_rank: int) -> None:
    import torch

    torch.cuda.set_device(local_rank)


def _target(name: str, arch: str, major: int, acc: str, description: str, invariant: str = "tested") -> Target:
    tvm_target = {"kind": "cuda", "arch": arch}
    return Target(
        name=name,
        description=description,
        family="nvidia",
        device_type="cuda",
        default_dtype="bfloat16",
        present=lambda: compute_capability_major() == major,
        tvm_target=tvm_target,
        traits=Traits(acc=acc, **_GRID),
        stages=cuda_stages(arch, tvm_target),
        pass_configs=_PASS_CONFIGS,
        toolchain=toolchain,
        runtime=NvidiaRuntime(tvm_target),
        graphs=_graphs,
        side_stream=_side_stream,
        memory=_memory,
        collectives="nccl",
        bind_device=_bind,
        needs=f"an NVIDIA GPU of compute capability {major}.x that torch can see",
        batch_invariant=invariant,
        batch_invariant_note="" if invariant == "tested" else (
            f"{name}'s kernels were never run: their batch invariance follows from the same fixed splits as sm90's, "
            "but no test has compared their bits"),
    )


SM90 = _target("sm90", "sm_90a", 9, "fragment", "NVIDIA Hopper (sm_90a: TMA, wgmma)")
SM100 = _target("sm100", "sm_100a", 10, "tmem", "NVIDIA Blackwell (sm_100a: tcgen05 MMA, TMEM) - compile only here",
                "untested")


def without_library(target: Target) -> Target:
    """The same target building only the CUDA source and the cubin (no runtime library): what a machine checks
    when it has no GPU to load the library on. A different stage list, so a different cache key."""
    import dataclasses

    return dataclasses.replace(target, stages=cuda_stages(target.tvm_target["arch"], target.tvm_target, library=False))
