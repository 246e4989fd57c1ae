"""NVIDIA targets sm_90a (Hopper) and sm_100a (Blackwell): TileLang IR -> CUDA source -> cubin (nvcc) ->
host+device library; the runtime loads the library and launches on the current torch stream, which also
works inside CUDA graph capture."""

from __future__ import annotations

from backends.base import Target, Traits
from backends.nvidia.stages import NvidiaRuntime, cuda_stages, toolchain

_GRID = dict(dialect="tilelang.cuda.language", launch="grid", cores=0, io_scope="shared.dyn", operand_scope="shared.dyn",
             vec="fragment", reg="fragment", vector_region=False, vector_halves=False)
_PASS_CONFIGS: dict = {}


def _target(name: str, arch: str, acc: str, description: str) -> Target:
    tvm_target = {"kind": "cuda", "arch": arch}
    return Target(
        name=name,
        description=description,
        tvm_target=tvm_target,
        traits=Traits(acc=acc, **_GRID),
        stages=cuda_stages(arch, tvm_target),
        pass_configs=_PASS_CONFIGS,
        toolchain=toolchain,
        runtime=NvidiaRuntime(tvm_target),
        device_type="cuda",
    )


SM90 = _target("sm90", "sm_90a", "fragment", "NVIDIA Hopper (sm_90a: TMA, wgmma)")
SM100 = _target("sm100", "sm_100a", "tmem", "NVIDIA Blackwell (sm_100a: tcgen05 MMA, TMEM) - compile only here")
