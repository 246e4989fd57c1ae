"""The NVIDIA lowering stages (cuda source, cubin, runtime library) and the runtime hook."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from backends import tl
from backends.base import BackendError, Stage, StageContext, run_tool


@functools.lru_cache(maxsize=1)
def nvcc_path() -> str | None:
    from shutil import which

    return which("nvcc")


@functools.lru_cache(maxsize=1)
def toolchain() -> dict[str, str]:
    """{"nvcc": "13.0.88"} (empty version when nvcc is not on PATH)."""
    path = nvcc_path()
    if path is None:
        return {"nvcc": ""}
    import subprocess

    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return {"nvcc": m.group(1) if m else out.strip().splitlines()[-1]}


def nvcc_flags(arch: str) -> list[str]:
    """TileLang's own device flags (tilelang/contrib/nvcc.py) plus its template and CUTLASS include dirs."""
    tl.tilelang()
    import tilelang.env as env

    return ["-ccbin=g++", "--cubin", "-O3", "-lineinfo", f"-arch={arch}", "-std=c++20",
            f"-I{env.TILELANG_TEMPLATE_PATH}", f"-I{env.CUTLASS_INCLUDE_DIR}"]


def cuda_stages(arch: str, tvm_target: dict, library: bool = True) -> tuple[Stage, ...]:
    """lower: the one lowering -> CUDA source (+ the runtime library TileLang builds from it with nvcc);
    cubin: nvcc compiles that same source to a cubin for `arch`. `library=False` skips the runtime library
    (source and cubin only: what a machine without the target's GPU needs to check a kernel)."""

    def lower(ctx: StageContext) -> dict[str, Path]:
        build_lib = library and nvcc_path() is not None
        if library and not build_lib:
            ctx.notes["lib"] = "nvcc not found on PATH: runtime library not built"
        out = tl.lower(ctx.func, tvm_target, ctx.pass_configs, ctx.out_dir, "kernel.cu", library=build_lib)
        return {"cuda": out["source"], **({"lib": out["lib"]} if "lib" in out else {})}

    def cubin(ctx: StageContext) -> dict[str, Path]:
        if nvcc_path() is None:
            ctx.notes["cubin"] = "nvcc not found on PATH: cubin not built"
            return {}
        out = ctx.out_dir / "kernel.cubin"
        run_tool([nvcc_path(), *nvcc_flags(arch), "-o", str(out), str(ctx.files["cuda"])],
                 ctx.out_dir / "nvcc.log", f"nvcc ({arch})")
        return {"cubin": out}

    outputs = ("cuda", "lib") if library else ("cuda",)
    return (Stage("lower", lower, outputs), Stage("cubin", cubin, ("cubin",)))


class NvidiaRuntime:
    """Loads a built library; calls launch on torch's current CUDA stream (graph-capture safe). A kernel loaded
    from its saved signature goes through TVM-FFI alone when it can (`tl.load_ffi_library`: TileLang and TVM are
    then never imported at start); otherwise, and for a traced PrimFunc, through TileLang's JITKernel."""

    def __init__(self, tvm_target: dict):
        self.tvm_target = tvm_target

    def load(self, artifact_dir: Path, func: Any, pass_configs: dict):
        lib = artifact_dir / "lib"
        if not (lib / tl.LIB_FILE).is_file():
            raise BackendError(f"{artifact_dir} has no runtime library (built without nvcc?)")
        if isinstance(func, tl.Signature):
            kernel = tl.load_ffi_library(lib, func)
            if kernel is not None:
                return kernel
        return tl.load_library(lib, artifact_dir / "kernel.cu", func, self.tvm_target, pass_configs)
