"""Huawei Ascend 950 through TileLang's `ascend` target: TileLang IR -> AscendC source -> device binary
(bisheng, when CANN is installed; otherwise the artifact is the source and the build report says so).
The runtime goes through torch_npu, imported only when a kernel is loaded. Nothing here has run on an NPU."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from backends import tl
from backends.base import BackendError, Stage, StageContext, Target, Traits, run_tool

CORES = 32  # AI cores used by the persistent launch (Ascend 950; a tile config may override)
_PASS_CONFIGS: dict[str, Any] = {}


@functools.lru_cache(maxsize=1)
def bisheng_path() -> str | None:
    from shutil import which

    home = os.environ.get("BISHENG_HOME")
    if home and Path(home, "bin", "bisheng").is_file():
        return str(Path(home, "bin", "bisheng"))
    return which("bisheng")


@functools.lru_cache(maxsize=1)
def toolchain() -> dict[str, str]:
    path = bisheng_path()
    if path is None:
        return {"bisheng": ""}
    import subprocess

    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
    return {"bisheng": out.splitlines()[0] if out else "unknown"}


def _lower(ctx: StageContext) -> dict[str, Path]:
    """The one lowering -> AscendC source, and with CANN's bisheng the loadable library TileLang builds from it."""
    build_lib = bisheng_path() is not None
    if not build_lib:
        ctx.notes["lib"] = "bisheng (CANN 9.2) not found: no loadable library; the artifact is the AscendC source"
    out = tl.lower(ctx.func, "ascend", ctx.pass_configs, ctx.out_dir, "kernel.cpp", library=build_lib,
                   execution_backend="cython")
    return {"ascend": out["source"], **({"lib": out["lib"]} if "lib" in out else {})}


def _binary(ctx: StageContext) -> dict[str, Path]:
    """bisheng compiles the same AscendC source to a device object (kept with the artifact)."""
    if bisheng_path() is None:
        ctx.notes["binary"] = "bisheng (CANN 9.2) not found: the artifact is the AscendC source only"
        return {}
    tl.tilelang()
    from tilelang.contrib.bisheng import get_bisheng_compile_options

    out = ctx.out_dir / "kernel.o"
    src = ctx.out_dir / "kernel.asc"
    src.write_text(ctx.files["ascend"].read_text())
    run_tool([bisheng_path(), *get_bisheng_compile_options(), "--cce-aicore-only", str(src), "-o", str(out)],
             ctx.out_dir / "bisheng.log", "bisheng")
    return {"binary": out}


class AscendRuntime:
    """Loads the library the build published (through TileLang's cython adapter; torch_npu imported here); it
    never compiles at load. A kernel built without CANN has no library: the error says to rebuild it on a host
    with bisheng."""

    def load(self, artifact_dir: Path, func: Any, pass_configs: dict):
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise BackendError("the Ascend runtime needs torch_npu (pip install 'deepinfer[ascend]') and an NPU") from exc
        lib = artifact_dir / "lib"
        if not (lib / tl.LIB_FILE).is_file():
            raise BackendError(f"{artifact_dir} has no loadable library (built without CANN's bisheng); rebuild it "
                               f"with `deepinfer compile --target ascend` on a host with CANN 9.2")
        return tl.load_library(lib, artifact_dir / "kernel.cpp", func, "ascend", pass_configs)


def _present() -> bool:
    try:
        import torch
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(torch.npu.is_available())


def _graphs():
    from backends.ascend.graphs import NpuGraphs

    return NpuGraphs()


def _memory(device) -> tuple[int, int]:
    import torch

    return torch.npu.mem_get_info(device)


def _bind(local_rank: int) -> None:
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu and the hccl backend)

    torch.npu.set_device(local_rank)


ASCEND = Target(
    name="ascend",
    description="Huawei Ascend 950 (AscendC via TileLang's ascend target) - compile only here",
    family="ascend",
    device_type="npu",
    default_dtype="bfloat16",
    present=_present,
    tvm_target="ascend",
    traits=Traits(dialect="tilelang.ascend.language", launch="persistent", cores=CORES, io_scope="shared.dyn",
                  operand_scope="shared.l1", acc="l0c", vec="shared", reg="fragment", vector_region=True,
                  vector_halves=True),
    stages=(Stage("lower", _lower, ("ascend", "lib")), Stage("binary", _binary, ("binary",))),
    pass_configs=_PASS_CONFIGS,
    toolchain=toolchain,
    runtime=AscendRuntime(),
    graphs=_graphs,
    memory=_memory,
    collectives="hccl",  # never run here: no NPU and no CANN
    bind_device=_bind,
    needs="torch_npu (pip install 'deepinfer[ascend]') and an Ascend NPU",
    batch_invariant="unsupported",
    batch_invariant_note=("the Ascend kernels were never run, and their persistent cores and split vector units "
                          "(two halves of each tile) reduce in orders nobody has checked; run --batch-invariant on "
                          "sm90, c or reference"),
)
