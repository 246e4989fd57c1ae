"""Targets: the one vocabulary of where kernels are built and where a run happens.

`get(name)` returns a target, `resolve(name)` also takes the `--backend` aliases (`cpu` = the reference path,
`nvidia` = the SM of the visible GPU), `detect()` picks the target of the visible device. Everything the layers
above need to know about a target is a field of `Target`; nothing above this package branches on a name.
"""

from __future__ import annotations

import importlib

from backends.base import BackendError, Stage, StageContext, Target, Traits

_REGISTRY = {  # name -> (module, attribute), imported on first use; the order is detect()'s
    "sm90": ("backends.nvidia", "SM90"),
    "sm100": ("backends.nvidia", "SM100"),
    "ascend": ("backends.ascend", "ASCEND"),
    "c": ("backends.cpu", "C"),
    "reference": ("backends.reference", "REFERENCE"),
}
TARGET_NAMES = tuple(_REGISTRY)
COMPILE_TARGETS = ("sm90", "sm100", "ascend", "c")  # the targets with kernels (asserted in tests)
ALIASES = {"cpu": ("reference",), "nvidia": ("sm90", "sm100")}  # --backend spellings: candidates, first present wins
BACKEND_NAMES = TARGET_NAMES + tuple(ALIASES)  # what --backend accepts


def get(name: str) -> Target:
    if name not in _REGISTRY:
        raise BackendError(f"unknown target {name!r}; accepted: {', '.join(TARGET_NAMES)}")
    module, attr = _REGISTRY[name]
    return getattr(importlib.import_module(module), attr)


def compile_target(name: str) -> Target:
    """A target kernels can be built for; any other name is an error naming the accepted ones."""
    if name not in COMPILE_TARGETS:
        hint = f" ({name!r} is a --backend alias of {', '.join(ALIASES[name])})" if name in ALIASES else ""
        raise BackendError(f"unknown target {name!r}; accepted: {', '.join(COMPILE_TARGETS)}{hint}")
    return get(name)


def resolve(name: str | None) -> Target:
    """The run target for a `--backend`/`--target` name or alias; None detects it. An accelerator target whose
    device is not visible is an error saying what it needs."""
    if name is None:
        return detect()
    if name in ALIASES:
        candidates = [get(n) for n in ALIASES[name]]
        for target in candidates:
            if target.present():
                return target
        raise BackendError(f"backend {name!r} needs {' or '.join(t.needs for t in candidates)}, and none is visible; "
                           f"use --backend cpu")
    if name not in _REGISTRY:
        raise BackendError(f"unknown backend {name!r}; accepted: {', '.join(BACKEND_NAMES)}")
    target = get(name)
    if not target.present():
        raise BackendError(f"backend {name!r} needs {target.needs}, and none is visible; use --backend cpu")
    return target


def detect() -> Target:
    """The target of the visible device: compute capability 9.x -> sm90, 10.x -> sm100, an Ascend NPU -> ascend;
    otherwise the PyTorch reference path."""
    for name in TARGET_NAMES:
        target = get(name)
        if target.family != "cpu" and target.present():
            return target
    return get("reference")


__all__ = ["ALIASES", "BACKEND_NAMES", "BackendError", "COMPILE_TARGETS", "Stage", "StageContext", "Target", "Traits", "TARGET_NAMES",
           "compile_target", "detect", "get", "resolve"]
