"""A decode step's row arithmetic made on the host: the `StepRows` values that depend only on the step's positions,
slots and the blocks its sequences hold, computed with numpy while the device runs the step before, packed into
the bytes that go up with the step's other inputs (one copy), and read on the device as views of them.

On the device the same arithmetic is ~50 tiny integer kernels a step at one token (the window ring rows, the
compressors' ring places and closing entries, the rows a closing entry goes to, the int32 copies the kernels take):
serial launches on the critical path of the first layers that use them. The rows that span a sequence's whole
block table (the compressed entries' store rows, `StepRows.entry_table`) and those that depend on the step's own
results (the indexer's picks) stay on the device.

Each value here equals what `StepRows` makes for the same key (`tests/test_host_rows.py`); a key this plan lacks
is made on the device as before, so the plan only decides how fast, never what a step computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch

from deepinfer.model.compressor import ring_kernel
from deepinfer.runtime.cache_layout import CompressorLayout, LayerLayout

_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool}


@dataclass(frozen=True)
class _Part:
    key: Hashable
    part: int | None  # the item of a tuple-valued key (`("ring", rate, ring)` is (buffer rows, ring rows)); None
    dtype: np.dtype
    width: int  # values a row ([B] when 0, else [B, width])
    offset: int  # byte offset in the packed rows


class HostRows:
    """The packed layout of one step's host-made rows for `size` rows of a cache with these layer layouts."""

    def __init__(self, layouts: Sequence[LayerLayout], size: int):
        self.size = size
        self.windows = sorted({(lay.window, lay.ring) for lay in layouts})
        comps = {c for lay in layouts for c in (lay.compressor, lay.indexer) if c is not None}
        self.compressors = sorted(comps, key=lambda c: (c.rate, c.overlap, c.base, c.per_block, c.buffer_rows))
        self.rates = sorted({c.rate for c in self.compressors})
        specs: list[tuple[Hashable, int | None, np.dtype, int]] = [(("rotated",), None, np.int32, 0)]
        specs += [(("owner",), None, np.int32, 0)] if any(map(ring_kernel, self.compressors)) else []
        for r in self.rates:
            specs += [(("closed", r), None, np.int64, 0), (("closing", r), None, np.bool_, 0),
                      (("closing entry", r), None, np.int64, 0), (("closing at", r), None, np.int32, 0)]
        for w, ring in self.windows:
            specs += [(("attend", w, ring), None, np.int64, w), (("window", w, ring), None, np.int64, 0)]
        for c in self.compressors:
            ring = c.buffer_rows
            specs += [(("ring", c.rate, ring), 0, np.int64, 0), (("ring", c.rate, ring), 1, np.int64, c.rate),
                      (("close rows", c), None, np.int64, 0)]
            if ring_kernel(c):
                specs += [(("overlap rows", c.rate, ring), None, np.int32, 2 * c.rate) if c.overlap
                          else (("window rows", c.rate, ring), None, np.int32, c.rate)]
        parts, offset = {}, 0
        for key, part, dtype, width in specs:
            if (key, part) not in parts:  # compressors of one geometry share their ring keys
                parts[(key, part)] = _Part(key, part, np.dtype(dtype), width, offset)
                offset += -(-self._nbytes(parts[(key, part)]) // 8) * 8
        self.parts: tuple[_Part, ...] = tuple(parts.values())
        self.nbytes = offset
        self._keys = {p.key for p in self.parts}
        self._viewed: tuple = (None, [])  # (the buffer filled last, its parts' views)

    def _nbytes(self, p: _Part) -> int:
        return self.size * max(p.width, 1) * p.dtype.itemsize

    def _shape(self, p: _Part) -> tuple[int, ...]:
        return (self.size, p.width) if p.width else (self.size,)

    def device(self, packed: torch.Tensor) -> dict[Hashable, torch.Tensor | tuple[torch.Tensor, ...]]:
        """The rows by `StepRows` key as views of `packed` (uint8 [>= nbytes] on the device, 8-byte aligned)."""
        out: dict = {}
        for p in self.parts:
            t = packed[p.offset: p.offset + self._nbytes(p)].view(_TORCH[p.dtype]).view(self._shape(p))
            if p.part is None:
                out[p.key] = t
            else:
                out[p.key] = out.get(p.key, ()) + (t,)
        return out

    def buffers(self, rows: int, max_blocks: int, device: torch.device | str) -> dict[Hashable, torch.Tensor]:
        """Device tensors steps of up to `rows` rows keep between them: each compressor's entry offsets, its entry
        indices and its entry table's buffer [rows, 1 + max_blocks * per_block] with column 0 -1
        (`StepRows.entry_table` fills the rest every step). `sized` views them for a smaller step (buckets run one
        at a time: one set serves them all)."""
        out: dict = {}
        for c in self.compressors:
            out[("entry offsets", c)] = torch.arange(c.base, c.base + c.per_block, device=device)
            out[("entries", c)] = torch.arange(max_blocks * c.per_block, device=device)
            out[("entry table buffer", c)] = torch.full((rows, 1 + max_blocks * c.per_block), -1,
                                                        dtype=torch.long, device=device)
        return out

    @staticmethod
    def sized(buffers: dict[Hashable, torch.Tensor], size: int) -> dict[Hashable, torch.Tensor]:
        return {k: v[:size] if k[0] == "entry table buffer" else v for k, v in buffers.items()}

    def fill(self, packed: np.ndarray, positions: Sequence[int], slots: Sequence[int], blocks: Sequence[Sequence[int]],
             scratch_slot: int) -> None:
        """Write the rows of a step into `packed` (uint8 [>= nbytes]): `positions`, `slots` and each row's blocks
        (its sequence's block list) for the first rows, the rest padding (position 0, `scratch_slot`, scratch
        blocks). A caller that fills the same buffer every step saves the views' making (~1 us a part)."""
        n, size = len(positions), self.size
        pos = np.zeros(size, np.int64)
        pos[:n] = positions
        slot = np.full(size, scratch_slot, np.int64)
        slot[:n] = slots
        values = {("rotated",): pos, ("owner",): slot}
        ends = pos + 1
        for r in self.rates:
            closed = ends // r
            entry = np.maximum(closed - 1, 0)
            values.update({("closed", r): closed, ("closing", r): ends % r == 0, ("closing entry", r): entry,
                           ("closing at", r): entry * r})
        for w, ring in self.windows:
            win = pos[:, None] + np.arange(-w + 1, 1)
            attend = np.where(win >= 0, win % ring + slot[:, None] * ring, -1)
            values[("attend", w, ring)], values[("window", w, ring)] = attend, attend[:, -1]
        for c in self.compressors:
            ring, r = c.buffer_rows, c.rate
            if ("ring", r, ring) not in values:  # compressors of one geometry share these
                ring_rows = ((pos // r * r)[:, None] + np.arange(r)) % ring
                values[("ring", r, ring)] = (pos % ring + slot * ring, ring_rows)
                values[("window rows", r, ring)] = ring_rows
                if ("overlap rows", r, ring) in self._keys:
                    first = (values[("closing entry", r)] == 0)[:, None]
                    values[("overlap rows", r, ring)] = np.concatenate(
                        [np.where(first, -1, (ring_rows - r) % ring), ring_rows], axis=1)
            values[("close rows", c)] = self._close_rows(c, values[("closed", r)], values[("closing", r)], blocks)
        for p, view in zip(self.parts, self._views(packed)):
            view[...] = values[p.key] if p.part is None else values[p.key][p.part]

    def _views(self, packed: np.ndarray) -> list[np.ndarray]:
        """Each part's typed view of `packed` (kept for the buffer filled last)."""
        at = (packed.__array_interface__["data"][0], packed.nbytes)
        if self._viewed[0] != at:
            self._viewed = (at, [packed[p.offset: p.offset + self._nbytes(p)].view(p.dtype).reshape(self._shape(p))
                                 for p in self.parts])
        return self._viewed[1]

    @staticmethod
    def _close_rows(c: CompressorLayout, closed: np.ndarray, closing: np.ndarray,
                    blocks: Sequence[Sequence[int]]) -> np.ndarray:
        """[B] the store row each row's closing entry goes to (the scratch row where none closes)."""
        out = np.full(closed.shape[0], c.scratch_row, np.int64)
        for i in np.nonzero(closing[: len(blocks)])[0]:
            entry = int(closed[i]) - 1
            held = blocks[i]
            block = held[entry // c.per_block] if entry // c.per_block < len(held) else c.scratch_block
            out[i] = c.base + block * c.per_block + entry % c.per_block
        return out
