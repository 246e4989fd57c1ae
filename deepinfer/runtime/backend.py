"""Which target a run uses, and what that gives the runtime: the device, the op table (TileLang kernels of the
target, or the PyTorch references), and the decode-graph capture. Every fact comes from the target's data
(`backends`); the `--backend` name is resolved once, here."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

import backends
from deepinfer.env import Env
from deepinfer.errors import ConfigError
from tilekernels import OpTable

log = logging.getLogger("deepinfer")

if TYPE_CHECKING:
    from tilekernels.kernels import Launcher


@dataclass(frozen=True)
class Backend:
    target: backends.Target
    device: torch.device
    ops: OpTable
    capture: Callable[[Callable[[], Any]], tuple[Any, Callable[[], Any]]] | None  # None: decode runs eagerly
    launcher: Launcher | None = None  # what `ops` launches kernels through (None: PyTorch references)

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def kernel_target(self) -> str | None:
        """The compile target whose kernels run (None: PyTorch references)."""
        return self.target.name if self.target.kernels else None

    def side_stream(self) -> Any | None:
        """A second stream on the device for the model's decode steps (None where the target has none)."""
        return None if self.target.side_stream is None else self.target.side_stream(self.device)

    def memory(self) -> tuple[int, int] | None:
        """(free, total) bytes of the device, when the target can tell."""
        return None if self.target.memory is None else self.target.memory(self.device)


def resolve(name: str | None, env: Env | None = None) -> backends.Target:
    """`name` (a target or an alias), else DEEPINFER_ACCELERATOR, else the detected target."""
    env = env or Env.read()
    try:
        return backends.resolve(name if name is not None else env.accelerator)
    except backends.BackendError as exc:
        raise ConfigError(str(exc)) from exc


def select(name: str | None, cache_dir: Path, env: Env | None = None, invariant: bool = False) -> Backend:
    """`invariant`: the batch-invariant op table (each op's kernels in their one configuration per shape, the
    references in fixed-shape pieces; docs/batch-invariance.md)."""
    target = resolve(name, env)
    if invariant:
        check_invariance(target)
    launcher = None
    if target.kernels:
        from tilekernels.kernels import kernel_launcher, table

        launcher = kernel_launcher(target.name, cache_dir, invariant=invariant)
        ops = table(launcher)
    else:
        from tilekernels import reference_table

        ops = reference_table(invariant)
    try:
        capture = target.graphs() if target.graphs is not None else None
    except ImportError as exc:
        raise ConfigError(f"backend {target.name!r} needs {target.needs}: {exc}") from exc
    return Backend(target, torch.device(target.device_type), ops, capture, launcher)


def check_invariance(target: backends.Target) -> None:
    """ConfigError where `--batch-invariant` cannot be promised on `target`; a warning where it was never tested."""
    if target.batch_invariant == "unsupported":
        raise ConfigError(f"--batch-invariant is not available on backend {target.name!r}: "
                          f"{target.batch_invariant_note}")
    if target.batch_invariant != "tested":
        log.warning("deepinfer: --batch-invariant on %s: %s", target.name, target.batch_invariant_note)
