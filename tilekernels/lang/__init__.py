"""The portable facade: what a kernel author writes instead of target-specific TileLang."""

from tilekernels.lang.facade import Facade

__all__ = ["Facade"]
