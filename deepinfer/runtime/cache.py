"""The paged cache of DeepSeek-V4's per-sequence state, for many sequences at once.

Bounded state lives in per-sequence *slots*: each layer's sliding-window K=V ring (W rows), and each
compressor's open-window buffer (kv, gate without bias) and CSA overlap (the previous window's first series,
gate with bias). State that grows with the sequence — compressed entries (CSA, HCA) and lightning-indexer
keys — lives in *blocks*: a block covers `block_tokens` positions and holds every entry those positions produce
in every layer (block_tokens / rate entries per compressed layer). A sequence holds one slot and a block table.

Per layer, the window ring and the entries share one K=V pool tensor, so that attention gathers its rows from
one tensor by row index. Slot `max_seqs` and block `num_blocks` are scratch: padded batch rows and entries that
are not being written this step go there. Decode steps find a sequence's blocks in the device-resident block
table `tables` (a row per slot, kept by `SlotBlocks` as sequences grow and are released).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from deepinfer.config import ModelConfig
from deepinfer.runtime.blocks import SeqCache, SlotBlocks
from deepinfer.runtime.cache_layout import CacheLayout, CacheSpec, CompressorLayout, LayerLayout, Region
from deepinfer.runtime.staging import upload

__all__ = ["CacheLayout", "CacheSpec", "Compressor", "CompressorLayout", "LayerCache", "LayerLayout", "PagedCache",
           "Region", "SeqCache"]


@dataclass
class Compressor:
    """One compressor's tensors, allocated from (and indexed through) its layout."""

    layout: CompressorLayout
    store: torch.Tensor  # [rows, dim]: the entries (the layer's pool for the main compressor, its keys for the indexer)
    buf_kv: torch.Tensor  # [slots + 1, buffer_rows, width]: a ring of the last positions' rows (layout)
    buf_gate: torch.Tensor  # [slots + 1, buffer_rows, width] (gate without the position bias)
    snap_kv: torch.Tensor | None = None  # [snapshots, rate, width]: the window closing at a snapshot's boundary
    snap_gate: torch.Tensor | None = None  # [snapshots, rate, width] (exact prefix cache; CSA's overlap carries it)

    @property
    def rate(self) -> int:
        return self.layout.rate

    @property
    def overlap(self) -> bool:
        return self.layout.overlap

    @classmethod
    def allocate(cls, layout: CompressorLayout, store: torch.Tensor, device: torch.device | str) -> Compressor:
        def alloc(r: Region | None) -> torch.Tensor | None:
            return None if r is None else r.slot_view(r.allocate(device))

        return cls(layout, store, alloc(layout.buf_kv), alloc(layout.buf_gate))

    def tensors(self) -> list[torch.Tensor]:
        return [self.buf_kv, self.buf_gate]

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Buffer ring rows of `positions` (any shape)."""
        return positions % self.layout.buffer_rows


@dataclass
class LayerCache:
    layout: LayerLayout
    pool: torch.Tensor  # [(slots + 1) * W + (blocks + 1) * per_block, D]: window rings, then entries
    ring: torch.Tensor  # view [slots + 1, W, D]
    compressor: Compressor | None = None
    indexer: Compressor | None = None
    snap_ring: torch.Tensor | None = None  # [snapshots, W, D]: the window KV at a snapshot's boundary, by position

    def carried(self) -> list[Compressor]:
        """The compressors whose state outlives a closed window (CSA's overlap)."""
        return [c for c in (self.compressor, self.indexer) if c is not None and c.overlap]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding state (the main entries live inside the pool)."""
        out = [self.pool]
        for c in (self.compressor, self.indexer):
            if c is not None:
                out += c.tensors()
        if self.indexer is not None:
            out.append(self.indexer.store)
        return out


class PagedCache(SlotBlocks):
    def __init__(self, cfg: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str):
        super().__init__(spec)
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.layout = CacheLayout.build(cfg, spec, dtype)
        self.tables = torch.full((spec.max_seqs + 1, spec.max_blocks_per_seq), self.scratch_block, dtype=torch.long,
                                 device=device)
        self.layers: list[LayerCache] = []
        for lay in self.layout.layers:
            pool = lay.pool.allocate(device)
            layer = LayerCache(lay, pool, lay.pool.slot_view(pool))
            if lay.compressor is not None:
                layer.compressor = Compressor.allocate(lay.compressor, pool, device)
            if lay.indexer is not None:
                layer.indexer = Compressor.allocate(lay.indexer, lay.keys.allocate(device), device)
            self.layers.append(layer)
        self.draft_layers = [LayerCache(lay, pool := lay.pool.allocate(device), lay.pool.slot_view(pool))
                             for lay in self.layout.draft]  # MTP layers' window rings (speculative decoding)
        self.window = cfg.sliding_window
        if spec.snapshots:
            self._allocate_snapshots(spec.snapshots)

    def _allocate_snapshots(self, n: int) -> None:
        for layer in self.layers:
            layer.snap_ring = torch.zeros((n, layer.layout.window, layer.layout.head_dim), dtype=self.dtype,
                                          device=self.device)
            for c in layer.carried():
                c.snap_kv = torch.zeros((n, c.rate, c.buf_kv.shape[-1]), dtype=c.buf_kv.dtype, device=self.device)
                c.snap_gate = torch.zeros((n, c.rate, c.buf_gate.shape[-1]), dtype=c.buf_gate.dtype, device=self.device)

    def salt(self) -> bytes:
        """What a prefix cache's block names are seeded with: the model's geometry and the cache dtype."""
        return hashlib.blake2b(f"{self.cfg!r}|{self.dtype}".encode(), digest_size=16).digest()

    def restore_snapshot(self, slot: int, snapshot: int, boundary: int) -> None:
        """Exact prefix hit: the slot's window rings and carried compressor state as they were at `boundary`."""
        pos = torch.arange(boundary - self.window, boundary, device=self.device)
        for layer in self.layers:
            layer.pool[layer.layout.window_rows(slot, pos)] = layer.snap_ring[snapshot]
            for c in layer.carried():
                rows = c.rows(pos[-c.rate:])
                c.buf_kv[slot, rows] = c.snap_kv[snapshot]
                c.buf_gate[slot, rows] = c.snap_gate[snapshot]

    def take_snapshots(self, slots: list[int], snapshots: list[int], boundaries: list[int]) -> None:
        """Snapshot slots whose sequences have just written the position before `boundaries` (decode)."""
        slot, snap, boundary = upload(torch.tensor([slots, snapshots, boundaries]), self.device)  # no wait on the step
        pos = boundary.view(-1, 1) - self.window + torch.arange(self.window, device=self.device).view(1, -1)
        for layer in self.layers:
            layer.snap_ring[snap] = layer.pool[layer.layout.window_rows(slot.view(-1, 1), pos)]
            for c in layer.carried():
                rows = c.rows(pos[:, -c.rate:])
                c.snap_kv[snap] = c.buf_kv[slot.view(-1, 1), rows]
                c.snap_gate[snap] = c.buf_gate[slot.view(-1, 1), rows]

    def snapshot_bytes(self) -> int:
        """Bytes of every window snapshot kept (exact prefix caching)."""
        return self.spec.snapshots * self.layout.snapshot_bytes

    def block_table(self, seqs: list[SeqCache], rows: int | None = None) -> torch.Tensor:
        """[rows, max_blocks_per_seq] int64, scratch-padded (missing blocks and padding rows)."""
        rows = len(seqs) if rows is None else rows
        table = torch.full((rows, self.spec.max_blocks_per_seq), self.scratch_block, dtype=torch.long)
        for i, s in enumerate(seqs):
            if s.blocks:
                table[i, : len(s.blocks)] = torch.tensor(s.blocks)
        return table.to(self.device)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding state (views excluded: the main entries live inside each layer's pool)."""
        return [t for layer in self.layers + self.draft_layers for t in layer.tensors()]

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
