"""The op declaration and the op table the model calls through.

Every op the model runs is declared once here in `tilekernels.ops` (one file per op) with its PyTorch
reference, the ground truth every backend is checked against. A backend builds an `OpTable` that maps each op
name to its implementation; the CPU reference backend maps every op to its reference, so kernels can replace
ops one by one without the model changing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class OpDecl:
    """One op: its name, a one-line summary and the PyTorch reference implementation."""

    name: str
    summary: str
    reference: Callable[..., Any]


class OpTable:
    """The implementation of every declared op for one backend; the model calls `ops.<name>(...)`."""

    def __init__(self, impls: Mapping[str, Callable[..., Any]], declared: Mapping[str, OpDecl]):
        missing = sorted(set(declared) - set(impls))
        unknown = sorted(set(impls) - set(declared))
        if missing or unknown:
            raise ValueError(f"op table mismatch: missing implementations {missing}, undeclared ops {unknown}")
        self._impls = dict(impls)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            return self.__dict__["_impls"][name]
        except KeyError:
            raise AttributeError(f"no op named {name!r}; declared ops: {sorted(self.__dict__['_impls'])}") from None

    def names(self) -> list[str]:
        return sorted(self._impls)
