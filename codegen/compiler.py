"""Compile (op kernel, variant, target) -> artifact directory, through the cache.

The cache key covers everything that can change the result: the kernel's IR text, the variant, the target
(its TVM target, traits and stage list), the toolchain versions, TileLang's version and native-library
stamp, the pass configs, and deepinfer's own version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import threading
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


def cache_key(req: Request, target: Target, ir_text: str) -> str:
    material = {
        "ir": ir_text,
        "op": req.op,
        "kernel": req.kernel,
        "variant": variant_dict(req.variant),
        "target": {"name": target.name, "tvm": target.tvm_target, "traits": dataclasses.asdict(target.traits),
                   "stages": [[s.name, *s.outputs] for s in target.stages]},
        "pass_configs": req.options(target),
        "toolchain": target.toolchain(),
        "tilelang": tl.version_stamp(),
        "deepinfer": deepinfer_version(),
    }
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

    def get(self, req: Request, func: Any = None) -> Artifact:
        """The artifact for `req`: from memory, from disk, or (when JIT is allowed) built now."""
        mem_key = (req.op, req.kernel, req.variant)
        with self._lock:
            if mem_key in self._memory:
                return self._memory[mem_key]
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
        with self._lock:
            self._memory[mem_key] = art
        return art

    def _build(self, req: Request, func: Any, key: str, entry: Path) -> Artifact:
        with cache.locked(entry):
            meta = cache.read_meta(entry)  # another process may have built it while we waited
            if meta is not None:
                return Artifact(entry, key, meta, cached=True)
            log.info("compiling kernel %s for %s (not in the cache %s)", req.label, self.target.name, self.root)
            with cache.staging(entry) as tmp:
                (tmp / "kernel.tir").write_text(func.script())
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
        """A callable kernel for `req` on this target's device (built or fetched first)."""
        func = req.build(self.target)
        art = self.get(req, func)
        return self.target.runtime.load(art.path, func, req.options(self.target))
