"""A layer's independent halves on two streams where the target has a second one (`Target.side_stream`: on NVIDIA
`backends/nvidia/side_stream.py`, which says why and what keeps it safe), in place and in program order elsewhere.
`side` is that target's object (`branch()`, `join()`) or None."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def branch(side: Any | None) -> Iterator[None]:
    """The body's work on `side` (after the current stream's so far), or in place when `side` is None."""
    if side is None:
        yield
    else:
        with side.branch():
            yield


def join(side: Any | None) -> None:
    """The current stream waits for `side`'s branch (nothing when None)."""
    if side is not None:
        side.join()
