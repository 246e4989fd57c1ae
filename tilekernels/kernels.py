"""Binding ops to the compile driver: a codegen `Request` for (op, kernel, variant), a launcher that hands
an op's `run` its compiled kernels, and the op table of a kernel target."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any, Callable

from codegen import Compiler, Request
from tilekernels.lang import Facade
from tilekernels.op import OpTable
from tilekernels.ops import DECLARED


def request(op_name: str, kernel_name: str, variant: Any) -> Request:
    """The build request of one kernel variant (module-level and picklable by name for worker processes)."""
    kernel = DECLARED[op_name].kernel(kernel_name)

    def build(target):
        return kernel.body_for(target.name, variant)(Facade(target.traits), variant, kernel.config(target.name))

    def pass_configs(target) -> dict:
        return dict(getattr(kernel.config(target.name), "pass_configs", None) or {})

    return Request(op_name, kernel_name, variant, build, pass_configs)


class Launcher:
    """`launcher(op, kernel, variant)` -> the compiled callable for the compiler's target (memoized)."""

    def __init__(self, compiler: Compiler):
        self.compiler = compiler
        self._loaded: dict[tuple, Callable[..., Any]] = {}
        self._lock = threading.Lock()

    def __call__(self, op: str, kernel: str, variant: Any) -> Callable[..., Any]:
        key = (op, kernel, variant)
        fn = self._loaded.get(key)
        if fn is None:
            fn = self.compiler.load(request(op, kernel, variant))
            with self._lock:
                self._loaded[key] = fn
        return fn

    def for_op(self, op: str) -> "OpLauncher":
        return OpLauncher(self, op)


class OpLauncher:
    """What an op's `run` receives: `launch(kernel, variant)` for its own kernels, `launch.op(name)` for another
    op's (e.g. the expert FFN reuses the SwiGLU kernel)."""

    def __init__(self, launcher: Launcher, op: str):
        self._launcher, self._op = launcher, op

    def __call__(self, kernel: str, variant: Any) -> Callable[..., Any]:
        return self._launcher(self._op, kernel, variant)

    def op(self, name: str) -> "OpLauncher":
        return OpLauncher(self._launcher, name)


class Recorder(Launcher):
    """A launcher that compiles nothing: it records every (op, kernel, variant) an op's `run` asks for and hands
    back a no-op, so that a model run on meta tensors lists the kernels it launches (the compile plan)."""

    def __init__(self):
        self.seen: dict[tuple, None] = {}  # insertion-ordered set

    def __call__(self, op: str, kernel: str, variant: Any) -> Callable[..., Any]:
        self.seen.setdefault((op, kernel, variant))
        return _no_op


def _no_op(*args: Any) -> None:
    return None


def kernel_table(target_name: str, cache_dir: Path, jit: bool = True) -> OpTable:
    """Every op with kernels runs them on `target_name`; the others run their reference (on the same device)."""
    import backends

    return table(Launcher(Compiler(backends.get(target_name), cache_dir, jit=jit)))


def table(launcher: Launcher) -> OpTable:
    """The op table whose kernel ops launch through `launcher`."""
    impls = {}
    for name, op in DECLARED.items():
        impls[name] = functools.partial(op.run, launcher.for_op(name)) if op.run is not None else op.reference
    return OpTable(impls, DECLARED)
