"""Compile targets. `get(name)` returns one; nothing above this package branches on a target's name."""

from __future__ import annotations

import importlib

from backends.base import BackendError, Stage, StageContext, Target, Traits

TARGET_NAMES = ("sm90", "sm100", "ascend", "cpu")


_REGISTRY = {  # name -> (module, attribute), imported on first use
    "sm90": ("backends.nvidia", "SM90"),
    "sm100": ("backends.nvidia", "SM100"),
    "ascend": ("backends.ascend", "ASCEND"),
    "cpu": ("backends.cpu", "CPU"),
}


def get(name: str) -> Target:
    if name not in _REGISTRY:
        raise BackendError(f"unknown target {name!r}; accepted: {', '.join(TARGET_NAMES)}")
    module, attr = _REGISTRY[name]
    return getattr(importlib.import_module(module), attr)


__all__ = ["BackendError", "Stage", "StageContext", "Target", "Traits", "TARGET_NAMES", "get"]
