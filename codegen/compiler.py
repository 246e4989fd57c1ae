"""Compile (op kernel, variant, target) -> artifact directory, through the cache.

The cache key covers everything that can change the result: the kernel's IR text, the variant, the target
(its TVM target, traits and stage list), the toolchain versions, TileLang's version and native-library
stamp, the pass configs, and deepinfer's own version.

Loading a cached kernel (`Compiler.load`) does not trace its body when it can avoid it: a request whose builder
is plain data and code (`source_key`: the builder's code and closure, the variant, the target, the toolchain, and
the source of the packages the body can read) finds its entry through the cache's index, and the entry's saved
signature (`tl.SIGNATURE_FILE`) stands in for the PrimFunc (the NVIDIA runtime then loads the library through
TVM-FFI alone, without importing TileLang). Any miss (a new source, an entry built before the index, an
unreadable record) traces as before and records the result for the next start.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from backends import Target, tl
from backends.base import BackendError, StageContext
from codegen import cache
from codegen.errors import CompileError, NotBuiltError

log = logging.getLogger("deepinfer.codegen")
# TileLang's lowering changes process-wide state (it captures fd 2, swaps a module's check function): one build at
# a time in a process; parallel builds run in worker processes (`codegen.driver.build_all`)
_BUILDING = threading.Lock()


@functools.lru_cache(maxsize=1)
def deepinfer_version() -> str:
    """The project version: from the installed metadata, else from the checkout's pyproject.toml."""
    try:
        return metadata.version("deepinfer")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return m.group(1) if m else "unknown"


@dataclass(frozen=True)
class Request:
    """One kernel to build: `build(target)` returns its PrimFunc for that target (the op library binds the
    portable body, the facade for the target's traits and the target's tile config)."""

    op: str
    kernel: str
    variant: Any  # frozen dataclass: the compile-time parameters
    build: Callable[[Target], Any] = dataclasses.field(compare=False, hash=False)
    pass_configs: Callable[[Target], dict] = dataclasses.field(default=lambda target: {}, compare=False, hash=False)

    def options(self, target: Target) -> dict[str, Any]:
        return {**target.pass_configs, **self.pass_configs(target)}

    @property
    def label(self) -> str:
        fields = ",".join(f"{k}={v}" for k, v in variant_dict(self.variant).items())
        return f"{self.op}.{self.kernel}[{fields}]"


@dataclass(frozen=True)
class Artifact:
    path: Path
    key: str
    meta: dict
    cached: bool  # True when found in the cache, False when built now

    def file(self, output: str) -> Path | None:
        """A named output of the build (e.g. cuda, cubin, lib, ascend, c), None when it was not made."""
        rel = self.meta["stages"].get(output)
        return None if rel is None else self.path / rel


def variant_dict(variant: Any) -> dict[str, Any]:
    return dataclasses.asdict(variant) if dataclasses.is_dataclass(variant) else {"value": repr(variant)}


def _material(req: Request, target: Target, stamp: dict[str, str] | None = None) -> dict[str, Any]:
    """What a key covers besides the kernel itself (`stamp`: TileLang's, default `tl.version_stamp()`)."""
    return {
        "op": req.op,
        "kernel": req.kernel,
        "variant": variant_dict(req.variant),
        "target": {"name": target.name, "tvm": target.tvm_target, "traits": dataclasses.asdict(target.traits),
                   "stages": [[s.name, *s.outputs] for s in target.stages]},
        "pass_configs": req.options(target),
        "toolchain": target.toolchain(),
        "tilelang": tl.version_stamp() if stamp is None else stamp,
        "deepinfer": deepinfer_version(),
    }


def cache_key(req: Request, target: Target, ir_text: str) -> str:
    material = {"ir": ir_text, **_material(req, target)}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


class _Opaque(Exception):
    """A value `fingerprint` cannot reduce to data: the request is traced on every load."""


def fingerprint(obj: Any, modules: set[str], depth: int = 0) -> Any:
    """`obj` as JSON-able data that changes when it can change what a builder traces: plain values, containers,
    dataclasses, enums, and functions by their compiled code, defaults and closure (the modules of the functions
    and classes met are added to `modules`, whose source `source_key` covers). Anything else raises _Opaque."""
    if depth > 16:
        raise _Opaque("too deep")
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return [type(obj).__name__, repr(obj)]
    if isinstance(obj, enum.Enum):
        modules.add(type(obj).__module__)
        return ["enum", type(obj).__module__, type(obj).__qualname__, obj.name]
    if isinstance(obj, (tuple, list)):
        return [type(obj).__name__, [fingerprint(v, modules, depth + 1) for v in obj]]
    if isinstance(obj, (set, frozenset)):
        return ["set", sorted(json.dumps(fingerprint(v, modules, depth + 1), sort_keys=True) for v in obj)]
    if isinstance(obj, Mapping):
        items = [[fingerprint(k, modules, depth + 1), fingerprint(v, modules, depth + 1)] for k, v in obj.items()]
        return ["map", sorted(items, key=lambda kv: json.dumps(kv[0], sort_keys=True))]
    if isinstance(obj, type):
        modules.add(obj.__module__)
        return ["type", obj.__module__, obj.__qualname__]
    if dataclasses.is_dataclass(obj):
        modules.add(type(obj).__module__)
        return ["dataclass", type(obj).__module__, type(obj).__qualname__,
                [[f.name, fingerprint(getattr(obj, f.name), modules, depth + 1)] for f in dataclasses.fields(obj)]]
    if isinstance(obj, types.FunctionType):
        modules.add(obj.__module__)
        try:
            cells = [c.cell_contents for c in obj.__closure__ or ()]
        except ValueError as exc:  # a cell not filled yet
            raise _Opaque(str(exc)) from exc
        return ["function", obj.__module__, obj.__qualname__, _code_digest(obj.__code__),
                fingerprint(cells, modules, depth + 1), fingerprint(obj.__defaults__, modules, depth + 1),
                fingerprint(obj.__kwdefaults__, modules, depth + 1)]
    if isinstance(obj, types.MethodType):
        return ["method", fingerprint(obj.__func__, modules, depth + 1), fingerprint(obj.__self__, modules, depth + 1)]
    if isinstance(obj, functools.partial):
        return ["partial", fingerprint(obj.func, modules, depth + 1), fingerprint(obj.args, modules, depth + 1),
                fingerprint(obj.keywords, modules, depth + 1)]
    if isinstance(obj, types.BuiltinFunctionType) and (obj.__self__ is None or isinstance(obj.__self__, types.ModuleType)):
        return ["builtin", getattr(obj, "__module__", None), obj.__qualname__]
    if isinstance(obj, types.ModuleType):
        modules.add(obj.__name__)
        return ["module", obj.__name__]
    raise _Opaque(f"a {type(obj).__qualname__}")


def _code_digest(code: types.CodeType) -> str:
    """SHA-256 of a code object's bytecode, constants (nested code included) and names (marshal's bytes are not
    used: they depend on reference counts)."""
    h = hashlib.sha256(code.co_code)
    for const in code.co_consts:
        h.update(_code_digest(const).encode() if isinstance(const, types.CodeType) else repr(const).encode())
        h.update(b"\0")
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_qualname,
                   code.co_firstlineno, code.co_argcount, code.co_kwonlyargcount, code.co_flags)).encode())
    return h.hexdigest()


ALWAYS_HASHED = ("tilekernels", "codegen", "backends")  # the facade, the bodies' helpers, the targets


def _process_start() -> float:
    """This process's start as a wall-clock time (Linux /proc; else when this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK") - 1.0  # a second of slack for tick rounding
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


@functools.cache
def _tree_digest(name: str) -> str | None:
    """SHA-256 of the files of a top-level package (or of a module's source), fixed for the process at its first use
    (None: no source file to hash, or a file changed since this process started, so the code it runs may not be
    the code on disk: its kernels are then traced and not indexed)."""
    module = sys.modules.get(name)
    if module is None:
        import importlib

        try:
            module = importlib.import_module(name)
        except ImportError:
            return None
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = Path(file)
    files = ([f for f in sorted(path.parent.rglob("*")) if f.is_file() and "__pycache__" not in f.parts]
             if path.name == "__init__.py" else [path])  # a package: every file (data a body reads included)
    h, start = hashlib.sha256(), _process_start()
    for f in files:
        if f.stat().st_mtime > start:
            log.info("%s changed since this process started: its kernels are traced on load", f)
            return None
        h.update(str(f.relative_to(path.parent)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def source_key(req: Request, target: Target, fresh: bool = False) -> str | None:
    """A key for `req` computed without tracing its body, or None when its builder cannot be reduced to data
    (e.g. it closes over an object `fingerprint` does not know).
    It covers what `cache_key` covers except the traced IR, which it replaces with the builder (code, closure)
    and the files of every package the builder's functions come from, plus tilekernels, codegen and backends.
    What it cannot see: module-level state a body reads that its source does not fix (a global changed at run
    time, the environment, a file outside those packages); no body does so today, and one that must should make
    that input part of its variant. `fresh` re-reads the files
    (as a record is written: a file edited since this process started then gives None, never a record that maps
    the edited source to what the code this process runs traced)."""
    modules: set[str] = set()
    try:
        builder = [fingerprint(req.build, modules), fingerprint(req.pass_configs, modules),
                   fingerprint(type(req.variant), modules)]
    except _Opaque:
        return None
    tops = sorted({m.split(".")[0] for m in modules} | set(ALWAYS_HASHED))
    if "__main__" in tops:
        return None  # a script's source is not a module this key can name
    digest = getattr(_tree_digest, "__wrapped__", _tree_digest) if fresh else _tree_digest
    sources = {top: digest(top) for top in tops}
    if any(d is None for d in sources.values()):
        return None
    material = {"builder": builder, "sources": sources, "python": sys.version,
                **_material(req, target, tl.native_stamp())}  # TileLang's stamp without importing it
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


class Compiler:
    """Builds and finds artifacts for one target under one cache directory; keeps an in-memory index."""

    def __init__(self, target: Target, cache_dir: Path, jit: bool = True):
        self.target = target
        self.root = Path(cache_dir) / target.name
        self.jit = jit
        self._memory: dict[tuple, Artifact] = {}
        self._lock = threading.Lock()

    def entry_dir(self, req: Request, key: str) -> Path:
        return self.root / f"{req.op}.{req.kernel}" / key[:20]

    def index_path(self, req: Request, skey: str) -> Path:
        return self.root / "index" / f"{req.op}.{req.kernel}" / f"{skey[:40]}.json"

    def get(self, req: Request, func: Any = None) -> Artifact:
        """The artifact for `req`: from memory, from disk, or (when JIT is allowed) built now."""
        mem_key = (req.op, req.kernel, req.variant)
        with self._lock:
            if mem_key in self._memory:
                return self._memory[mem_key]
        traced = func is None
        func = req.build(self.target) if func is None else func
        key = cache_key(req, self.target, func.script())
        entry = self.entry_dir(req, key)
        meta = cache.read_meta(entry)
        if meta is not None:
            art = Artifact(entry, key, meta, cached=True)
        elif not self.jit:
            raise NotBuiltError(
                f"kernel {req.label} for target {self.target.name} is not built (no-JIT mode) under {self.root}; "
                f"build it with: deepinfer compile --target {self.target.name} --ops {req.op}"
            )
        else:
            art = self._build(req, func, key, entry)
        if traced:
            self._record(req, art, func)
        with self._lock:
            self._memory[mem_key] = art
        return art

    def _record(self, req: Request, art: Artifact, func: Any) -> None:
        """Index `req`'s source key -> the entry its trace found; with the signature when the entry has none."""
        try:
            skey = source_key(req, self.target, fresh=True)
            if skey is None:
                return
            record = {"key": art.key}
            if tl.SIGNATURE_FILE not in art.meta.get("files", {}):  # an entry built before signatures were saved
                record["signature"] = tl.signature_json(func)
        except Exception as exc:  # noqa: BLE001 - no record: the next start traces this kernel, nothing else changes
            log.info("kernel %s: not indexed (%s: %s)", req.label, type(exc).__name__, exc)
            return
        cache.write_record(self.index_path(req, skey), record)

    def _load_indexed(self, req: Request) -> Callable[..., Any] | None:
        """The callable for `req` from the entry the index names, without tracing; None on any miss."""
        skey = source_key(req, self.target)
        record = None if skey is None else cache.read_record(self.index_path(req, skey))
        key = record.get("key") if record else None
        if not isinstance(key, str):
            return None
        entry = self.entry_dir(req, key)
        meta = cache.read_meta(entry)
        if meta is None or meta.get("key") != key:
            return None
        try:
            sig = (entry / tl.SIGNATURE_FILE).read_text() if tl.SIGNATURE_FILE in meta.get("files", {}) \
                else record.get("signature")
            if not isinstance(sig, str):
                return None
            fn = self.target.runtime.load(entry, tl.Signature(sig), req.options(self.target))
        except Exception as exc:  # noqa: BLE001 - traced instead; an error that is not the signature's recurs there
            log.info("kernel %s: not loadable from its saved signature (%s: %s): tracing it", req.label,
                     type(exc).__name__, exc)
            return None
        with self._lock:
            self._memory.setdefault((req.op, req.kernel, req.variant), Artifact(entry, key, meta, cached=True))
        return fn

    def _build(self, req: Request, func: Any, key: str, entry: Path) -> Artifact:
        with cache.locked(entry):
            meta = cache.read_meta(entry)  # another process may have built it while we waited
            if meta is not None:
                return Artifact(entry, key, meta, cached=True)
            log.info("compiling kernel %s for %s (not in the cache %s)", req.label, self.target.name, self.root)
            with cache.staging(entry) as tmp:
                (tmp / "kernel.tir").write_text(func.script())
                (tmp / tl.SIGNATURE_FILE).write_text(tl.signature_json(func))
                ctx = StageContext(func=func, out_dir=tmp, pass_configs=req.options(self.target))
                try:
                    with _BUILDING:
                        for stage in self.target.stages:  # the first lowers, the others compile its outputs
                            ctx.files.update(stage.run(ctx))
                except Exception as exc:
                    where = cache.keep_failure(tmp, self.root / "failed")
                    log_path = getattr(exc, "log", None)
                    log_path = where / Path(log_path).name if log_path else where
                    if not isinstance(exc, BackendError):
                        (where / "error.log").write_text(f"{type(exc).__name__}: {exc}\n")
                        log_path = where / "error.log"
                    raise CompileError(req.label, self.target.name, str(exc), log_path) from exc
                meta = {
                    "op": req.op,
                    "kernel": req.kernel,
                    "variant": variant_dict(req.variant),
                    "target": self.target.name,
                    "key": key,
                    "stages": {o: (str(ctx.files[o].relative_to(tmp)) if o in ctx.files else None)
                               for s in self.target.stages for o in s.outputs},
                    "notes": ctx.notes,
                    "toolchain": self.target.toolchain(),
                    "deepinfer": deepinfer_version(),
                }
                cache.publish(tmp, entry, meta)
        return Artifact(entry, key, meta, cached=False)

    def load(self, req: Request) -> Callable[..., Any]:
        """A callable kernel for `req` on this target's device (built or fetched first). A cached kernel the
        index knows loads without tracing its body; otherwise the body is traced, and the index records it."""
        fn = self._load_indexed(req)
        if fn is not None:
            return fn
        func = req.build(self.target)
        art = self.get(req, func)
        self._record(req, art, func)
        return self.target.runtime.load(art.path, func, req.options(self.target))
