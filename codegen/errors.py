"""Errors of the compile driver."""

from __future__ import annotations

from pathlib import Path


class CompileError(RuntimeError):
    """A kernel failed to build; `log` is the tool log (or error file) kept under the cache's failed/ dir."""

    def __init__(self, label: str, target: str, message: str, log: Path):
        super().__init__(f"building {label} for {target} failed: {message.strip().splitlines()[0] if message.strip() else ''} "
                         f"(log: {log})")
        self.label, self.target, self.log = label, target, log


class NotBuiltError(LookupError):
    """No-JIT mode and the kernel is not in the cache: the message names the command that builds it."""
