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


def _source(ctx: StageContext) -> Path:
    path = ctx.out_dir / "kernel.cpp"
    path.write_text(tl.lower_source(ctx.func, "ascend", ctx.pass_configs))
    return path


def _binary(ctx: StageContext) -> Path | None:
    if bisheng_path() is None:
        ctx.notes["binary"] = "bisheng (CANN 9.2) not found: the artifact is the AscendC source only"
        return None
    tl.tilelang()
    from tilelang.contrib.bisheng import get_bisheng_compile_options

    out = ctx.out_dir / "kernel.o"
    src = ctx.out_dir / "kernel.asc"
    src.write_text(ctx.files["ascend"].read_text())
    run_tool([bisheng_path(), *get_bisheng_compile_options(), "--cce-aicore-only", str(src), "-o", str(out)],
             ctx.out_dir / "bisheng.log", "bisheng")
    return out


class AscendRuntime:
    """JIT-compiles through TileLang's Ascend execution backend on an NPU host (torch_npu imported here)."""

    def load(self, artifact_dir: Path, func: Any, pass_configs: dict):
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise BackendError("the Ascend runtime needs torch_npu (pip install 'deepinfer[ascend]') and an NPU") from exc
        tilelang = tl.tilelang()
        return tilelang.compile(func, target="ascend", pass_configs=pass_configs)


ASCEND = Target(
    name="ascend",
    description="Huawei Ascend 950 (AscendC via TileLang's ascend target) - compile only here",
    tvm_target="ascend",
    traits=Traits(dialect="tilelang.ascend.language", launch="persistent", cores=CORES, io_scope="shared.dyn",
                  operand_scope="shared.l1", acc="l0c", vec="shared", reg="fragment", vector_region=True,
                  vector_halves=True),
    stages=(Stage("ascend", _source), Stage("binary", _binary)),
    pass_configs=_PASS_CONFIGS,
    toolchain=toolchain,
    runtime=AscendRuntime(),
    device_type="npu",
)
