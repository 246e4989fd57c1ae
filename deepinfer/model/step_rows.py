"""The cache rows of one decode step, made once per step for every layer of the same geometry and in few kernels.

At one token a decode step's row arithmetic (which ring row a token writes, which window rows and compressed entries
a query reads, where a closing window's entry goes) is dozens of tiny integer kernels; the layers of one geometry
share the results, so each is made once per step (`get`), with formulas that need the fewest kernels
(tests/test_step_rows.py checks each against the plain per-use formula), from the `CacheLayout`'s geometry. All
are pure torch ops with static shapes and no host reads (captured in the decode graphs)."""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, TypeVar

import torch

from deepinfer.runtime.cache_layout import CompressorLayout, LayerLayout

T = TypeVar("T")


class StepRows:
    """One decode step's shared rows for positions [B], slots [B] and block tables [B, max_blocks] (int64). A new
    object per step (the inputs' tensors are reused between steps). `given`: rows already made, by key (those the
    host made for the step, `host_rows.py`); the others are made here on first use. `kept`: tensors the steps keep
    between them (`HostRows.buffers`: the entry tables' buffers, offsets and entry indices), else made per step."""

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
                 given: Mapping[Hashable, object] | None = None,
                 kept: Mapping[Hashable, torch.Tensor] | None = None) -> None:
        self.positions, self.slots, self.blocks = positions, slots, blocks
        self._made: dict = dict(given or {})
        self._kept = kept or {}

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    # ---- positions ----
    def ends(self) -> torch.Tensor:
        """[B] each row's position + 1 (the tokens its sequence holds once the row is in)."""
        return self.get(("ends",), lambda: self.positions + 1)

    def closed(self, rate: int) -> torch.Tensor:
        """[B] windows closed once each row's position is in (`CompressorLayout.closed`)."""
        return self.get(("closed", rate), lambda: torch.div(self.ends(), rate, rounding_mode="floor"))

    def closing(self, rate: int) -> torch.Tensor:
        """[B] where the row's token closes a window."""
        return self.get(("closing", rate), lambda: self.ends() % rate == 0)

    def closing_entry(self, rate: int) -> torch.Tensor:
        """[B] the entry that closes at the row's position, 0 before the first."""
        return self.get(("closing entry", rate), lambda: (self.closed(rate) - 1).clamp_(min=0))

    # ---- the sliding window ----
    def attend(self, lay: LayerLayout) -> torch.Tensor:
        """[B, window] pool rows of each query's window, -1 before position 0."""
        def make() -> torch.Tensor:
            win = self.positions.view(-1, 1) + torch.arange(-lay.window + 1, 1, device=self.positions.device)
            rows = torch.add(win % lay.ring, self.slots.view(-1, 1), alpha=lay.ring)
            return torch.where(win >= 0, rows, -1)
        return self.get(("attend", lay.window, lay.ring), make)

    def window(self, lay: LayerLayout) -> torch.Tensor:
        """[B] pool rows the rows' tokens write (`LayerLayout.window_rows`): the windows' last column."""
        return self.get(("window", lay.window, lay.ring), lambda: self.attend(lay)[:, -1])

    # ---- compressed entries through the block table ----
    def entry_table(self, lay: CompressorLayout) -> torch.Tensor:
        """[B, 1 + E]: column 0 is -1, column 1 + e the store row of entry e of each row's block table
        (`CompressorLayout.entry_rows`); so a gather at `entry + 1` reads -1 for entry -1. One
        table per layout and step, in one kernel where the step is given its buffer and offsets, else three."""
        def make() -> torch.Tensor:
            b, nb, pb = *self.blocks.shape, lay.per_block
            device = self.blocks.device
            # a kept buffer (column 0 already -1) and offsets: made once for every step (`HostRows.buffers`)
            offsets = self._kept.get(("entry offsets", lay))
            if offsets is None:
                offsets = torch.arange(lay.base, lay.base + pb, device=device)
            out = self._kept.get(("entry table buffer", lay))
            if out is None:
                out = torch.full((b, 1 + nb * pb), -1, dtype=self.blocks.dtype, device=device)
            torch.add(offsets, self.blocks.view(b, nb, 1), alpha=pb, out=out[:, 1:].view(b, nb, pb))
            return out
        return self.get(("entry table", lay), make)

    def picked(self, lay: CompressorLayout, picks: torch.Tensor) -> torch.Tensor:
        """[B, K] store rows of entries `picks` [B, K], -1 kept as -1."""
        return self.entry_table(lay).gather(1, picks + 1)

    def close_rows(self, lay: CompressorLayout) -> torch.Tensor:
        """[B] store rows the rows' pooled entries go to: the closing entry's where a window closes, the scratch
        block's elsewhere; the closing entry + 1 is max(closed, 1)."""
        def make() -> torch.Tensor:
            at = self.get(("closing entry + 1", lay.rate), lambda: self.closed(lay.rate).clamp(min=1).view(-1, 1))
            return torch.where(self.closing(lay.rate), self.entry_table(lay).gather(1, at).view(-1), lay.scratch_row)
        return self.get(("close rows", lay), make)

    def keys(self, lay: CompressorLayout) -> torch.Tensor:
        """[B, E] store rows of every entry each row's block table spans (the indexer's key rows)."""
        return self.entry_table(lay)[:, 1:]

    def visible(self, lay: CompressorLayout) -> torch.Tensor:
        """[B, E] store rows of every closed entry each row may see, -1 for the others (HCA's whole list)."""
        def make() -> torch.Tensor:
            table = self.keys(lay)
            entry = self._kept.get(("entries", lay))  # made once for every step (`HostRows.buffers`)
            if entry is None:
                entry = torch.arange(table.shape[1], device=table.device)
            return torch.where(entry < self.closed(lay.rate).view(-1, 1), table, -1)
        return self.get(("visible", lay), make)
