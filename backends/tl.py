"""TileLang calls shared by the backends: lower to device source, build the host+device library, load it.

tilelang is imported here, lazily, and nowhere at package import time."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

LIB_FILE = "executable.so"
PARAMS_FILE = "params.json"
HOST_FILE = "host_kernel.c"
BACKEND_FILE = "execution_backend"
SIGNATURE_FILE = "signature.json"  # the kernel's PrimFunc without its body: what loading a built library needs
# The one call a kernel body may make ahead of its dependency wait (`dependent_launch`): bytes of global memory
# warmed into L2 (`tilekernels.l2_prefetch`), nothing read into the kernel.
PREFETCH_L2 = "deepinfer_prefetch_l2"
PREFETCH_L2_SOURCE = r"""
#ifndef DEEPINFER_PREFETCH_L2
#define DEEPINFER_PREFETCH_L2
static __device__ __forceinline__ void deepinfer_prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
#endif
"""


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


def dependent_launch(func: Any) -> Any:
    """`func` with CUDA's programmatic dependent launch: the kernel's first statements wait for the kernels before
    it in the stream to finish (`griddepcontrol.wait`), then let the next kernel's CTAs start (`launch_dependents`).
    TileLang marks such a kernel, and its runtime launches it with programmatic stream serialization, so in a chain
    of kernels (a decode step's graph) each one's launch and set-up overlap the end of the one before, while no
    memory access moves ahead of the wait: the order of reads and writes between kernels is the stream's, as
    without it. The one exception: the body's leading statements that only call PREFETCH_L2 (weights warmed into
    L2, nothing read into the kernel) stay ahead of the wait. A kernel launched without the attribute (PyTorch's)
    waits for the whole kernel before it as usual."""
    tilelang()
    from tilelang.cuda.language.pdl import pdl_sync, pdl_trigger
    from tvm import tirx

    frames = []

    def post(stmt):
        if stmt.name_hint != "tilelang_root":
            return None
        frames.append(stmt)
        seq = list(stmt.body.seq) if isinstance(stmt.body, tirx.SeqStmt) else [stmt.body]
        ahead = 0  # leading L2 prefetches of weights (tilekernels.l2_prefetch) stay ahead of the wait
        while ahead < len(seq) and _prefetch_only(seq[ahead]):
            ahead += 1
        body = tirx.SeqStmt([*seq[:ahead], tirx.Evaluate(pdl_sync()), tirx.Evaluate(pdl_trigger()), *seq[ahead:]])
        return tirx.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, body, stmt.init,
                           stmt.alloc_buffers, stmt.match_buffers, stmt.annotations)

    body = tirx.stmt_functor.ir_transform(func.body, None, post, ["tirx.SBlock"])
    if len(frames) != 1:
        raise ValueError(f"dependent_launch: expected one kernel frame (`tilelang_root`), found {len(frames)}")
    return func.with_body(body)


def _prefetch_only(stmt: Any) -> bool:
    """Whether `stmt` is nothing but PREFETCH_L2 calls, under conditions: every condition, index and byte count free
    of loads and calls (so nothing is read from memory), each call's address one buffer element's (address_of a load
    whose indices are such expressions). Anything else is not hoisted."""
    from tvm import tirx

    def pure(expr) -> bool:  # arithmetic on variables and constants only
        found = []
        tirx.stmt_functor.post_order_visit(expr, lambda n: found.append(n)
                                           if isinstance(n, (tirx.BufferLoad, tirx.Call)) else None)
        return not found

    def call_ok(call) -> bool:
        if not (isinstance(call, tirx.Call) and getattr(call.op, "name", "").endswith("call_extern")
                and len(call.args) == 3 and getattr(call.args[0], "value", None) == PREFETCH_L2):
            return False
        addr, nbytes = call.args[1], call.args[2]
        return (isinstance(addr, tirx.Call) and getattr(addr.op, "name", "").endswith("address_of")
                and len(addr.args) == 1 and isinstance(addr.args[0], tirx.BufferLoad)
                and all(pure(i) for i in addr.args[0].indices) and pure(nbytes))

    if isinstance(stmt, tirx.SeqStmt):
        return len(stmt.seq) > 0 and all(_prefetch_only(s) for s in stmt.seq)
    if isinstance(stmt, tirx.IfThenElse):
        return pure(stmt.condition) and _prefetch_only(stmt.then_case) and stmt.else_case is None
    return isinstance(stmt, tirx.Evaluate) and call_ok(stmt.value)


def lower(func: Any, tvm_target: Any, pass_configs: dict[str, Any], out_dir: Path, source_name: str,
          library: bool, execution_backend: str = "tvm_ffi", cpu: bool = False,
          compile_flags: tuple[str, ...] = ()) -> dict[str, Path]:
    """The one lowering of a kernel, and everything made from that one result: its device source (CUDA, AscendC
    or C) as `source_name`, and with `library` its host glue + loadable library under lib/ (TileLang compiles the
    device code of the same lowering with the target's toolchain, given `compile_flags` too). TileLang's warnings
    that flag wrong code raise. Returns {"source": path} or {"source": path, "lib": path}."""
    tl = tilelang()
    from tilelang.transform import PassContext
    from tvm.target import Target

    out_dir.mkdir(parents=True, exist_ok=True)
    target_name = tvm_target if isinstance(tvm_target, str) else None
    with captured_stderr() as err:
        with semantic_check_disabled(cpu), PassContext(config=pass_configs), Target(tvm_target):
            if library:
                kernel = tl.compile(func, target=tvm_target, execution_backend=execution_backend,
                                    pass_configs=pass_configs, compile_flags=list(compile_flags) or None)
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


def signature_json(func: Any) -> str:
    """The PrimFunc's signature (params, buffer map with its symbolic shapes and strides, attrs; the body replaced
    by a no-op) as TVM JSON: all TileLang's library adapters read of the PrimFunc when they load a built library
    (`JITKernel.from_database`), so a cached kernel loads without re-tracing its body."""
    tilelang()
    import tvm
    from tvm import tirx

    return tvm.ir.save_json(func.with_body(tirx.Evaluate(0)))


class Signature:
    """A saved signature (`signature_json`'s text), parsed into the PrimFunc only when a loader needs it (`func`,
    which imports TileLang); `load_ffi_library` reads the text alone."""

    def __init__(self, text: str):
        json.loads(text)  # ValueError now, not in the middle of a load
        self.text = text

    @functools.cached_property
    def func(self) -> Any:
        tilelang()
        import tvm
        from tvm import tirx

        func = tvm.ir.load_json(self.text)
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None or "global_symbol" not in func.attrs:
            raise ValueError(f"not a kernel signature: {type(func).__name__}")
        return func


def _package_lib_dir() -> Path | None:
    """TileLang's native library directory, found without importing it."""
    spec = importlib.util.find_spec("tilelang")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return Path(roots[0]) / "lib" if roots and (Path(roots[0]) / "lib").is_dir() else None


@functools.lru_cache(maxsize=1)
def native_stamp() -> dict[str, str]:
    """TileLang's installed version and a content hash of its native libraries, read without importing it (what
    `codegen.compiler.source_key` covers of TileLang, so that a warm start need not import it)."""
    from importlib import metadata

    h = hashlib.sha256()
    lib = _package_lib_dir()
    for f in sorted(lib.glob("*.so")) if lib else ():
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return {"tilelang": metadata.version("tilelang"), "tilelang_libs": h.hexdigest() if lib else ""}


@functools.lru_cache(maxsize=1)
def _native_runtime() -> None:
    """TileLang's native libraries loaded as its import loads them (lazily bound; z3 and the TVM runtime global,
    libtilelang local), without its Python packages: the TVM runtime registers the CUDA module loader and
    `__tvm_set_device`, libtilelang `__tvm_tensormap_create_tiled`, which a library's host code looks up."""
    if "tilelang" in sys.modules:
        return
    import ctypes

    lib = _package_lib_dir()
    if lib is None:
        raise OSError("TileLang's native libraries were not found")
    z3 = importlib.util.find_spec("z3")
    z3_lib = Path(next(iter(z3.submodule_search_locations))) / "lib" / "libz3.so" if z3 and z3.submodule_search_locations else None
    if z3_lib is not None and z3_lib.is_file():
        ctypes.CDLL(str(z3_lib), mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)
    ctypes.CDLL(str(lib / "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)
    ctypes.CDLL(str(lib / "libtilelang.so"), mode=ctypes.RTLD_LOCAL | os.RTLD_LAZY)


class FfiKernel:
    """A TileLang `tvm_ffi` library called as TileLang's adapter calls a kernel that returns no outputs (every
    deepinfer kernel: `lower` gives no out_idx): the module's entry with the caller's arguments; TVM-FFI reads
    torch's current stream, as under TileLang. Returns [] as that adapter does."""

    def __init__(self, module: Any):
        self.module = module
        self._main = module.main

    def __call__(self, *args: Any) -> list:
        self._main(*args)
        return []


def load_ffi_library(lib_dir: Path, signature: Signature) -> FfiKernel | None:
    """The library through TVM-FFI alone (no TileLang or TVM Python import: seconds off a cold start), or None when
    it needs TileLang's adapter: another execution backend, outputs the adapter allocates, a runtime function its
    host code looks up that the native libraries do not register."""
    if (lib_dir / BACKEND_FILE).read_text().strip() != "tvm_ffi":
        return None
    if any(attr in signature.text for attr in ("tilelang_out_idx", "tilelang_callee_allocated_outputs")):
        return None
    _native_runtime()
    import tvm_ffi

    needed = set(re.findall(r'"(__tvm_[A-Za-z0-9_]+)"', (lib_dir / HOST_FILE).read_text()))
    if any(tvm_ffi.get_global_func(name, allow_missing=True) is None for name in needed):
        return None
    return FfiKernel(tvm_ffi.load_module(str((lib_dir / LIB_FILE).resolve())))


def load_library(lib_dir: Path, device_source: Path, func: Any, tvm_target: Any, pass_configs: dict[str, Any]) -> Any:
    """A callable JITKernel from a library `build_library` wrote (no recompilation); `func` is the PrimFunc or
    its saved `Signature`."""
    tilelang()
    if isinstance(func, Signature):
        func = func.func
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
