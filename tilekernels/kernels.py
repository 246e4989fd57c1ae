"""Binding ops to the compile driver: a codegen `Request` for (op, kernel, variant), a launcher that hands
an op's `run` its compiled kernels, and the op table of a kernel target."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Iterable

from backends import tl
from codegen import Compiler, Request
from tilekernels.lang import Facade
from tilekernels.op import OpTable
from tilekernels.ops import DECLARED


def request(op_name: str, kernel_name: str, variant: Any) -> Request:
    """The build request of one kernel variant (module-level and picklable by name for worker processes)."""
    kernel = DECLARED[op_name].kernel(kernel_name)

    def build(target):
        body = kernel.body_for(target.name, variant)
        return launched(body(Facade(target.traits), variant, kernel.config(target.name)), target, plain_launch(body))

    def pass_configs(target) -> dict:
        return dict(getattr(kernel.config(target.name), "pass_configs", None) or {})

    return Request(op_name, kernel_name, variant, build, pass_configs)


def launched(func: Any, target, plain: bool = False) -> Any:
    """A kernel's PrimFunc as `target` launches it: on a target whose kernels wait on their predecessor in-kernel
    (CUDA PDL), with that wait, unless its body asks for a `plain` launch (`plain_launch`)."""
    return tl.dependent_launch(func) if target.traits.dependent_launch and not plain else func


def plain_launch(body: Callable[..., Any]) -> bool:
    """Whether a kernel body is launched without dependent launch wherever the target has it (the body function's
    `plain_launch` attribute, set where it says why)."""
    return bool(getattr(body, "plain_launch", False))


def tune_request(op_name: str, kernel_name: str, variant: Any, body: Callable[..., Any], base: Any,
                 pass_configs: dict | None = None, cfg: Any = None,
                 portable: Callable[..., Any] | None = None) -> Request:
    """The build request of a tune trial: kernel "<name>@<field=value,...>" is `body(P, variant, cfg, tune)` with
    those integer fields of the tile dataclass `base` replaced (`tuned`); "<name>@portable" is `portable(P, variant,
    cfg)` where the override has one to compare with; anything else the op's own `request`. For benchmark sweeps;
    an override module wraps it in a module-level function that build workers import by name."""
    from tilekernels.op import tuned

    if "@" not in kernel_name:
        return request(op_name, kernel_name, variant)
    spec = kernel_name.split("@", 1)[1]
    tune = None if spec == "portable" and portable is not None else tuned(base, spec)

    def build(target):
        P = Facade(target.traits)
        if tune is None:
            return launched(portable(P, variant, cfg), target, plain_launch(portable))
        return launched(body(P, variant, cfg, tune), target, plain_launch(body))

    return Request(op_name, kernel_name, variant, build, lambda target: dict(pass_configs or {}))


class Launcher:
    """`launcher(op, kernel, variant)` -> the compiled callable for the compiler's target (memoized). Thread-safe:
    a key is loaded by one thread; another asking for it meanwhile waits for that load (`preload` fills the memo
    from a thread pool before the first request). `invariant`: the ops pick their batch-invariant variants (one
    reduction order per shape, whatever the row count; docs/batch-invariance.md)."""

    def __init__(self, compiler: Compiler, invariant: bool = False):
        self.compiler = compiler
        self.invariant = invariant
        self._loaded: dict[tuple, Callable[..., Any]] = {}
        self._loading: dict[tuple, Future] = {}  # keys a thread is loading now
        self._lock = threading.Lock()

    def __call__(self, op: str, kernel: str, variant: Any) -> Callable[..., Any]:
        key = (op, kernel, variant)
        fn = self._loaded.get(key)
        return fn if fn is not None else self._load(key)[0]

    def _load(self, key: tuple) -> tuple[Callable[..., Any], bool]:
        """The callable for `key`, and whether this call loaded it (False: memoized, or loaded by another thread)."""
        with self._lock:
            fn = self._loaded.get(key)
            if fn is not None:
                return fn, False
            pending = self._loading.get(key)
            mine = pending is None
            if mine:
                pending = self._loading[key] = Future()
        if not mine:
            return pending.result(), False  # the loading thread's callable, or its exception
        try:
            fn = self.compiler.load(request(*key))
        except BaseException as exc:
            with self._lock:
                del self._loading[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            self._loaded[key] = fn
            del self._loading[key]
        pending.set_result(fn)
        return fn, True

    def preload(self, items: Iterable[tuple], jobs: int = 1, on_loaded: Callable[[], Any] | None = None) -> int:
        """Load every (op, kernel, variant) of `items` not loaded yet, in `jobs` threads; `on_loaded()` after each
        (in the calling thread). Returns how many this call loaded (0 when all were loaded already)."""
        todo = [key for key in dict.fromkeys(items) if key not in self._loaded]
        loaded = 0
        # the first in this thread (it imports TileLang), the rest in the pool
        for key in todo[:1] if jobs > 1 else todo:
            loaded += self._load(key)[1]
            if on_loaded is not None:
                on_loaded()
        if jobs <= 1 or len(todo) <= 1:
            return loaded
        pool = ThreadPoolExecutor(max_workers=min(jobs, len(todo) - 1), thread_name_prefix="kernel-load")
        try:
            for done in as_completed([pool.submit(self._load, key) for key in todo[1:]]):
                loaded += done.result()[1]  # the first failure raises; the loads not started are cancelled
                if on_loaded is not None:
                    on_loaded()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return loaded

    @property
    def loaded(self) -> int:
        """How many kernels are loaded."""
        return len(self._loaded)

    def for_op(self, op: str) -> "OpLauncher":
        return OpLauncher(self, op)


class OpLauncher:
    """What an op's `run` receives: `launch(kernel, variant)` for its own kernels, `launch.op(name)` for another
    op's (e.g. the expert FFN reuses the SwiGLU kernel); `launch.invariant`: pick the batch-invariant variants."""

    def __init__(self, launcher: Launcher, op: str):
        self._launcher, self._op = launcher, op
        self.invariant = getattr(launcher, "invariant", False)

    def __call__(self, kernel: str, variant: Any) -> Callable[..., Any]:
        return self._launcher(self._op, kernel, variant)

    def op(self, name: str) -> "OpLauncher":
        return OpLauncher(self._launcher, name)


class Recorder(Launcher):
    """A launcher that compiles nothing: it records every (op, kernel, variant) an op's `run` asks for and hands
    back a no-op, so that a model run on meta tensors lists the kernels it launches (the compile plan)."""

    def __init__(self, invariant: bool = False):
        self.seen: dict[tuple, None] = {}  # insertion-ordered set
        self.invariant = invariant

    def __call__(self, op: str, kernel: str, variant: Any) -> Callable[..., Any]:
        self.seen.setdefault((op, kernel, variant))
        return _no_op


def _no_op(*args: Any) -> None:
    return None


def kernel_launcher(target_name: str, cache_dir: Path, jit: bool = True, invariant: bool = False) -> Launcher:
    """The launcher of `target_name`'s kernels from the cache under `cache_dir` (built first when missing, with
    `jit`); `table(launcher)` is its op table."""
    import backends

    return Launcher(Compiler(backends.get(target_name), cache_dir, jit=jit), invariant)


def kernel_table(target_name: str, cache_dir: Path, jit: bool = True, invariant: bool = False) -> OpTable:
    """Every op with kernels runs them on `target_name`; the others run their reference (on the same device)."""
    return table(kernel_launcher(target_name, cache_dir, jit, invariant))


def table(launcher: Launcher) -> OpTable:
    """The op table whose kernel ops launch through `launcher`; the others run their reference (with
    `launcher.invariant`, in fixed-shape pieces: `tilekernels.invariant`)."""
    from tilekernels.invariant import reference_impl

    impls = {}
    for name, op in DECLARED.items():
        impls[name] = (functools.partial(op.run, launcher.for_op(name)) if op.run is not None
                       else reference_impl(op, getattr(launcher, "invariant", False)))
    return OpTable(impls, DECLARED)
