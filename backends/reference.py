"""The PyTorch reference path as a pseudo-target: every op runs its reference in PyTorch on the host CPU; nothing
is compiled. It is what `--backend cpu` means and where `detect()` lands when no accelerator is visible."""

from __future__ import annotations

from backends.base import Target

REFERENCE = Target(
    name="reference",
    description="PyTorch reference ops on the host CPU (no kernels)",
    family="cpu",
    device_type="cpu",
    default_dtype="float32",
    present=lambda: True,
)
