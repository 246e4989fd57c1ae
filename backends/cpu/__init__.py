"""TileLang's `c` target on the host CPU: runs portable kernel bodies in fp32 to check them against their
references (kernels.md section 1). Register tiles are `local`, shared tiles static, vectorisation off."""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

from backends import tl
from backends.base import BackendError, Stage, StageContext, Target, Traits

_PASS_CONFIGS: dict[str, Any] = {"tirx.disable_vectorize": True}


@functools.lru_cache(maxsize=1)
def toolchain() -> dict[str, str]:
    import subprocess

    try:
        out = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        out = ""
    return {"g++": out, "host": platform.machine()}


def _source(ctx: StageContext) -> Path:
    path = ctx.out_dir / "kernel.c"
    path.write_text(tl.lower_source(ctx.func, "c", ctx.pass_configs, cpu=True))
    return path


def _library(ctx: StageContext) -> Path:
    try:
        return tl.build_library(ctx.func, "c", ctx.pass_configs, ctx.out_dir / "lib", cpu=True)
    except Exception as exc:
        log = ctx.out_dir / "lib.log"
        log.write_text(str(exc))
        raise BackendError("building the CPU library failed", log) from exc


class CpuRuntime:
    def load(self, artifact_dir: Path, func: Any, pass_configs: dict):
        return tl.load_library(artifact_dir / "lib", artifact_dir / "kernel.c", func, "c", pass_configs)


CPU = Target(
    name="cpu",
    description="host CPU through TileLang's c target (fp32 checks of the portable bodies)",
    tvm_target="c",
    traits=Traits(dialect="tilelang.language", launch="grid", cores=0, io_scope="shared", operand_scope="shared",
                  acc="local", vec="local", reg="local", vector_region=False, vector_halves=False),
    stages=(Stage("c", _source), Stage("lib", _library)),
    pass_configs=_PASS_CONFIGS,
    toolchain=toolchain,
    runtime=CpuRuntime(),
    device_type="cpu",
)
