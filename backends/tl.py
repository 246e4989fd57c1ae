"""TileLang calls shared by the backends: lower to device source, build the host+device library, load it.

tilelang is imported here, lazily, and nowhere at package import time."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

LIB_FILE = "executable.so"
PARAMS_FILE = "params.json"
HOST_FILE = "host_kernel.c"
BACKEND_FILE = "execution_backend"


def tilelang():
    os.environ.setdefault("TILELANG_DISABLE_CACHE", "1")  # deepinfer's codegen cache is the one cache
    import tilelang as tl

    logging.getLogger("tilelang").setLevel(logging.WARNING)  # its per-kernel INFO lines drown progress bars
    return tl


def version_stamp() -> dict[str, str]:
    """TileLang's version and a content stamp of its native libraries (stale-hit protection)."""
    tl = tilelang()
    from tilelang.cache.kernel_cache import KernelCache

    return {"tilelang": tl.__version__, "tilelang_libs": KernelCache._get_tilelang_lib_stamp() or ""}


@contextlib.contextmanager
def semantic_check_disabled(disabled: bool) -> Iterator[None]:
    """The CPU `c` target runs register tiles in `local` scope inside T.Parallel, which TileLang's
    thread-oriented pre-lowering check rejects; the check cannot be switched off by a pass config in
    0.1.15, so it is bypassed for the duration of a CPU build only."""
    if not disabled:
        yield
        return
    tilelang()
    module = sys.modules["tilelang.engine.lower"]
    saved = module.PreLowerSemanticCheck
    module.PreLowerSemanticCheck = lambda mod: None
    try:
        yield
    finally:
        module.PreLowerSemanticCheck = saved


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Capture what native code writes to fd 2 (TileLang's C++ warnings) into the yielded list."""
    import tempfile

    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def check_warnings(text: str) -> None:
    """kernels.md trap 1: an op emitted outside the builder vanishes and its buffer is then read before being
    written; TileLang only warns. That warning is an error here."""
    if "read before initialization" in text or "is read before anything writes it" in text:
        raise RuntimeError("TileLang reports a buffer read before it is written (an op was dropped?):\n" + text.strip())


def lower(func: Any, tvm_target: Any, pass_configs: dict[str, Any], out_dir: Path, source_name: str,
          library: bool, execution_backend: str = "tvm_ffi", cpu: bool = False) -> dict[str, Path]:
    """The one lowering of a kernel, and everything made from that one result: its device source (CUDA, AscendC
    or C) as `source_name`, and with `library` its host glue + loadable library under lib/ (TileLang compiles the
    device code of the same lowering with the target's toolchain). TileLang's warnings that flag wrong code raise.
    Returns {"source": path} or {"source": path, "lib": path}."""
    tl = tilelang()
    from tilelang.transform import PassContext
    from tvm.target import Target

    out_dir.mkdir(parents=True, exist_ok=True)
    target_name = tvm_target if isinstance(tvm_target, str) else None
    with captured_stderr() as err:
        with semantic_check_disabled(cpu), PassContext(config=pass_configs), Target(tvm_target):
            if library:
                kernel = tl.compile(func, target=tvm_target, execution_backend=execution_backend,
                                    pass_configs=pass_configs)
            else:
                artifact = tl.lower(func, target=target_name or tvm_target)
    check_warnings(err[0])
    source = out_dir / source_name
    if not library:
        source.write_text(artifact.kernel_source)
        return {"source": source}
    source.write_text(kernel.artifact.kernel_source)
    lib_dir = out_dir / "lib"
    lib_dir.mkdir()
    if execution_backend == "tvm_ffi":
        kernel.export_library(str(lib_dir / LIB_FILE))
        host = kernel.get_host_source()
    else:
        shutil.copyfile(kernel.adapter.libpath, lib_dir / LIB_FILE)
        host = kernel.adapter.get_kernel_source()
    from tilelang.engine.param import dump_kernel_params

    (lib_dir / PARAMS_FILE).write_text(dump_kernel_params(kernel.params))
    (lib_dir / HOST_FILE).write_text(host)
    (lib_dir / BACKEND_FILE).write_text(execution_backend)
    return {"source": source, "lib": lib_dir / LIB_FILE}


def lower_source(func: Any, target: Any) -> str:
    """Device source of one PrimFunc for `target` (a `backends.Target`), without building anything: for quick
    checks by kernel authors and tests (builds go through `lower`, once per kernel)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return lower(func, target.tvm_target, target.pass_configs, Path(tmp), "kernel", library=False,
                     cpu=target.tvm_target == "c")["source"].read_text()


def load_library(lib_dir: Path, device_source: Path, func: Any, tvm_target: Any, pass_configs: dict[str, Any]) -> Any:
    """A callable JITKernel from a library `build_library` wrote (no recompilation)."""
    tilelang()
    from tilelang.engine.param import load_kernel_params
    from tilelang.jit import JITKernel

    params = load_kernel_params((lib_dir / PARAMS_FILE).read_text())
    return JITKernel.from_database(
        func=func,
        host_kernel_source=_text_source(lib_dir / HOST_FILE),
        device_kernel_source=_text_source(device_source),
        kernel_lib_path=str(lib_dir / LIB_FILE),
        params=params,
        target=tvm_target,
        target_host=None,
        out_idx=None,
        execution_backend=(lib_dir / BACKEND_FILE).read_text().strip(),
        pass_configs=pass_configs,
    )


def _text_source(path: Path):
    from tilelang.jit.adapter.base import CachedTextSource

    return CachedTextSource(path=str(path))
