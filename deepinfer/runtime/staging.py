"""Host <-> device traffic of a step without stalls: a step's small integer inputs go up through pinned host
memory with one non-blocking copy (`InputStage`), and its sampled tokens come back through pinned memory with
an event to wait on (`TokenReadback`), so the host can prepare the next step while the device runs this one.

On a device that is not an accelerator (the CPU backends) tensors already live in host memory: the copies are
plain and there is nothing to wait for.
"""

from __future__ import annotations

import numpy as np
import torch


def _is_accelerator(device: torch.device) -> bool:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc is not None and device.type == acc.type


def upload(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the work queued there (through pinned memory, a
    non-blocking copy; a plain copy where the device is the host)."""
    device = torch.device(device)
    if not _is_accelerator(device):
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


class InputStage:
    """Rows of step inputs ([rows, width] on the device, e.g. a row of ids and one of positions), written on the
    host and sent with one copy. Two pinned host buffers alternate, each guarded by the event of
    its last copy, so writing step N+1's inputs never races the copy of step N's still queued on the device."""

    def __init__(self, rows: int, width: int, device: torch.device, dtype: torch.dtype = torch.long):
        self.device = torch.device(device)
        self.staged = torch.zeros(rows, width, dtype=dtype, device=self.device)
        self._async = _is_accelerator(self.device)
        count = 2 if self._async else 1
        self._host = [torch.zeros(rows, width, dtype=dtype, pin_memory=self._async) for _ in range(count)]
        self._events: list[torch.Event | None] = [None] * count
        self._turn = 0

    def send(self, values: list[list[float]] | np.ndarray) -> torch.Tensor:
        """Copy `values` (one list per row, each `width` long, or an array of the stage's shape) to the device;
        returns the staged device tensor."""
        turn = self._turn
        self._turn = (turn + 1) % len(self._host)
        host = self._host[turn]
        if self._events[turn] is not None:
            self._events[turn].synchronize()  # the copy that last read this buffer has run
        host.copy_(torch.as_tensor(values, dtype=host.dtype))
        if not self._async:
            self.staged.copy_(host)
            return self.staged
        self.staged.copy_(host, non_blocking=True)
        event = torch.Event(device=self.device)
        event.record()
        self._events[turn] = event
        return self.staged


class TokenReadback:
    """Sampled tokens [n] (a device tensor), and optionally a tensor of the same step's extras (its logprobs),
    copied to pinned host memory without waiting; `tokens()` / `extra()` wait for those copies only (not for later
    work queued on the device) and return them as Python lists."""

    def __init__(self, tokens: torch.Tensor, extra: torch.Tensor | None = None):
        if not _is_accelerator(tokens.device):
            self._host, self._extra, self._event = tokens, extra, None
            return
        self._host = _pinned_copy(tokens)
        self._extra = None if extra is None else _pinned_copy(extra)
        self._event = torch.Event(device=tokens.device)
        self._event.record()

    def tokens(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

    def extra(self) -> list | None:
        if self._event is not None:
            self._event.synchronize()
        return None if self._extra is None else self._extra.tolist()


def _pinned_copy(values: torch.Tensor) -> torch.Tensor:
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


class DeviceIds:
    """A decode step's input ids taken on the device: `tokens[rows]`, where `tokens` are the sampled tokens of the
    step before (a device tensor the host has not read yet) and `rows` each sequence's row in that step."""

    def __init__(self, tokens: torch.Tensor, rows: list[int]):
        self.tokens, self.rows = tokens, rows

    def __len__(self) -> int:
        return len(self.rows)


def ids_tensor(ids: list[int] | DeviceIds, device: torch.device) -> torch.Tensor:
    """Ids as a device tensor [n] (an eager step's input)."""
    if isinstance(ids, DeviceIds):
        return ids.tokens.index_select(0, torch.tensor(ids.rows, device=ids.tokens.device))
    return torch.tensor(ids, device=device)
