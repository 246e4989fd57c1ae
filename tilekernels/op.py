"""The op declaration and the op table the model calls through.

An op is declared once (one file in `tilekernels/ops/`): its PyTorch reference (the ground truth for every
backend), the kernels that implement it (each a portable TileLang body written once against the facade,
with per-target tile configs and optional whole-kernel overrides keyed by target and shape), the variant
type (compile-time parameters: the cache key of a compiled kernel) as opposed to runtime sizes (`T.dynamic`),
the tolerances per dtype, and `run`: the wrapper that validates the inputs, allocates outputs on the inputs'
device and launches the compiled kernels.

A backend builds an `OpTable` mapping every op name to an implementation; the CPU reference table maps
every op to its reference, so kernels replace ops one by one without the model changing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tilekernels.errors import ShapeError


@dataclass(frozen=True)
class Override:
    """A whole-kernel replacement of a portable body for one target and the variants `when` accepts."""

    target: str
    when: Callable[[Any], bool]
    body: Callable[..., Any]


@dataclass(frozen=True)
class Kernel:
    """One TileLang kernel of an op. `body(P, variant, config)` returns a PrimFunc."""

    name: str
    body: Callable[..., Any]
    configs: Mapping[str, Any] = field(default_factory=dict)  # target name -> tile config; "default" fallback
    overrides: tuple[Override, ...] = ()

    def config(self, target: str) -> Any:
        return self.configs.get(target, self.configs.get("default"))

    def body_for(self, target: str, variant: Any) -> Callable[..., Any]:
        for o in self.overrides:
            if o.target == target and o.when(variant):
                return o.body
        return self.body


@dataclass(frozen=True)
class OpDecl:
    name: str
    summary: str
    reference: Callable[..., Any]
    kernels: tuple[Kernel, ...] = ()
    tolerance: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # dtype -> (atol, rtol)
    run: Callable[..., Any] | None = None  # run(launch, *reference_args) with launch(kernel_name, variant)
    example: Callable[..., tuple[Any, ...]] | None = None  # example(variant, rows, device) -> reference args
    uses: tuple[str, ...] = ()  # other ops whose kernels `run` launches
    row_samples: tuple[int, ...] = ()  # row counts at which `run` picks each of its variants (the plan traces them)

    def kernel(self, name: str) -> Kernel:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(f"op {self.name} has no kernel {name!r}; it has {[k.name for k in self.kernels]}")


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


def require(ok: bool, op: str, message: str) -> None:
    """Raise ShapeError('<op>: <message>') when a kernel cannot take its inputs."""
    if not ok:
        raise ShapeError(f"{op}: {message}")


def tuned(base: Any, spec: str) -> Any:
    """`base` (a frozen tile dataclass) with the integer fields of a tune trial's `spec` ("field=value,...", as in
    a benchmark sweep's kernel name "<kernel>@<spec>") replaced; an unknown field or a non-integer value raises
    ValueError naming it and the fields accepted."""
    from dataclasses import fields, replace

    names = [f.name for f in fields(base)]
    changes = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in names or not value.lstrip("-").isdigit():
            raise ValueError(f"tune trial {item!r} of {spec!r}: expected field=integer with a field of {names}")
        changes[key] = int(value)
    return replace(base, **changes)
