"""TileLang's `c` target on the host CPU: runs portable kernel bodies in fp32 to check them against their
references (kernels.md section 1). Register tiles are `local`, shared tiles static, vectorisation off."""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

from backends import tl
from backends.base import Stage, StageContext, Target, Traits
from backends.cpu.pch import include_flags

_PASS_CONFIGS: dict[str, Any] = {"tirx.disable_vectorize": True}


@functools.lru_cache(maxsize=1)
def toolchain() -> dict[str, str]:
    import subprocess

    try:
        out = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        out = ""
    return {"g++": out, "host": platform.machine()}


def _lower(ctx: StageContext) -> dict[str, Path]:
    """The one lowering -> C source and the library TileLang builds from it (cython wrapper, g++; TileLang's header
    precompiled, `pch.py`)."""
    out = tl.lower(ctx.func, "c", ctx.pass_configs, ctx.out_dir, "kernel.c", library=True, execution_backend="cython",
                   cpu=True, compile_flags=include_flags())
    return {"c": out["source"], "lib": out["lib"]}


class CpuRuntime:
    def load(self, artifact_dir: Path, func: Any, pass_configs: dict):
        return tl.load_library(artifact_dir / "lib", artifact_dir / "kernel.c", func, "c", pass_configs)


C = Target(
    name="c",
    description="host CPU through TileLang's c target (fp32 runs of the portable bodies, for checking them)",
    family="cpu",
    device_type="cpu",
    default_dtype="float32",
    present=lambda: True,
    tvm_target="c",
    traits=Traits(dialect="tilelang.language", launch="grid", cores=0, io_scope="shared", operand_scope="shared",
                  acc="local", vec="local", reg="local", vector_region=False, vector_halves=False),
    stages=(Stage("lower", _lower, ("c", "lib")),),
    pass_configs=_PASS_CONFIGS,
    toolchain=toolchain,
    runtime=CpuRuntime(),
)
