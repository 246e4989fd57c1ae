"""The paged cache's layout: one frozen object, computed once from (ModelConfig, CacheSpec, dtype), that holds
every cache tensor's shape, dtype and bytes per slot and per block, and the row arithmetic on them (window ring
rows, compressed-entry rows through a block table, compressor ring places). The model asks it for rows;
`PagedCache` allocates from it; cache sizing reads its bytes. A decode step's rows, shared by every layer of one
geometry and made in few kernels, are `deepinfer/model/step_rows.py`'s (from this layout's geometry).

Row methods are pure torch ops with static shapes and no host reads, so that decode can be captured in a graph
and traced on meta tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from deepinfer.config import CSA, SLIDING, ModelConfig
from deepinfer.errors import ConfigError


@dataclass(frozen=True)
class CacheSpec:
    num_blocks: int
    max_seqs: int
    max_blocks_per_seq: int  # block-table width: the longest sequence is max_blocks_per_seq * block_tokens
    block_tokens: int = 128  # a multiple of every compression rate, so block boundaries close every window
    snapshots: int = 0  # sliding-window snapshots kept for exact prefix caching (runtime/prefix.py)
    draft_layers: int = 0  # MTP draft layers with a window ring per slot (speculative decoding)
    lookahead: int = 0  # positions a step may write past those its sequence keeps (speculative verify rows)

    @property
    def max_tokens(self) -> int:
        return self.max_blocks_per_seq * self.block_tokens


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class Region:
    """One cache tensor: `slot_rows` rows per slot (every slot's first), then `block_rows` rows per block; each
    row is `row`-shaped. Slot `slots - 1` and block `blocks - 1` are the scratch ones."""

    name: str
    dtype: torch.dtype
    row: tuple[int, ...]
    slot_rows: int
    block_rows: int
    slots: int  # including the scratch slot
    blocks: int  # including the scratch block

    @property
    def block_start(self) -> int:
        """Row of block 0's first row (after every slot's rows)."""
        return self.slots * self.slot_rows

    @property
    def rows(self) -> int:
        return self.block_start + self.blocks * self.block_rows

    @property
    def shape(self) -> tuple[int, ...]:
        """The allocated (flat) shape: [rows, *row]."""
        return (self.rows, *self.row)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row) * _elt(self.dtype)

    @property
    def slot_bytes(self) -> int:
        return self.slot_rows * self.row_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_rows * self.row_bytes

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def allocate(self, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    def slot_view(self, t: torch.Tensor) -> torch.Tensor:
        """The per-slot part of an allocated tensor as [slots, slot_rows, *row]."""
        return t[: self.block_start].view(self.slots, self.slot_rows, *self.row)


@dataclass(frozen=True)
class CompressorLayout:
    """One compressor's geometry: per slot, a ring of its last positions' kv and gate rows (without the position
    bias; [slots, buffer_rows, width], a position's row at `position % buffer_rows`): the open window's, with
    overlap (CSA and its indexer) also the last closed window's (its first series pools into the next entry), and
    `lookahead` more so that a step's rows past the ones its sequence keeps overwrite nothing it still reads;
    `per_block` entries per block, stored from row `base` of its store (the layer's pool for the main compressor,
    its own key tensor for the indexer)."""

    rate: int
    overlap: bool
    width: int  # buffer width: 2 * dim with overlap (two series per token), else dim
    dim: int  # entry width
    per_block: int
    base: int  # store row of block 0's first entry
    scratch_block: int
    buf_kv: Region
    buf_gate: Region

    @property
    def regions(self) -> tuple[Region, ...]:
        return self.buf_kv, self.buf_gate

    @property
    def buffer_rows(self) -> int:
        return self.buf_kv.slot_rows

    # ---- rows (pure torch ops, static shapes, no host syncs) ----
    def buffer_row(self, slots: torch.Tensor | int, positions: torch.Tensor) -> torch.Tensor:
        """Row of position `positions` in the buffer rings of `slots` (broadcast), the rings [slots + 1, buffer_rows,
        width] seen as one table [(slots + 1) * buffer_rows, width] (what `index_copy_` writes)."""
        return torch.add(positions % self.buffer_rows, slots, alpha=self.buffer_rows)

    def closed(self, positions: torch.Tensor) -> torch.Tensor:
        """How many windows are closed once `positions` is in (the entries a query there may see)."""
        return (positions + 1) // self.rate

    def entry_rows(self, blocks: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Store rows of entry indices `entries` (>= 0) of sequences with block tables `blocks` (same rank)."""
        pb = self.per_block
        return self.base + blocks.gather(-1, entries // pb) * pb + entries % pb

    @property
    def scratch_row(self) -> int:
        return self.base + self.scratch_block * self.per_block


@dataclass(frozen=True)
class LayerLayout:
    """One layer's geometry: the K=V pool (each slot's window ring of `window` rows, then the compressed entries
    of each block), the compressors, and the indexer's key store."""

    index: int
    kind: str
    window: int
    head_dim: int
    ring: int  # window ring rows per slot: the window, and the lookahead (rows a step may write and not keep)
    pool: Region
    compressor: CompressorLayout | None
    indexer: CompressorLayout | None
    keys: Region | None  # the indexer's key store

    @property
    def entry_base(self) -> int:
        """Pool row of the first entry row."""
        return self.pool.block_start

    @property
    def regions(self) -> tuple[Region, ...]:
        out = [self.pool]
        for c in (self.compressor, self.indexer):
            if c is not None:
                out += c.regions
        if self.keys is not None:
            out.append(self.keys)
        return tuple(out)

    @property
    def slot_bytes(self) -> int:
        return sum(r.slot_bytes for r in self.regions)

    @property
    def block_bytes(self) -> int:
        return sum(r.block_bytes for r in self.regions)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    # ---- rows (pure torch ops, static shapes, no host syncs) ----
    def window_rows(self, slots: torch.Tensor | int, positions: torch.Tensor) -> torch.Tensor:
        """Pool rows holding positions `positions` in the window rings of `slots` (broadcast)."""
        return slots * self.ring + positions % self.ring


@dataclass(frozen=True)
class CacheLayout:
    """The whole cache's structure for (config, spec, dtype): per layer, every tensor's shape, dtype and bytes per
    slot and per block, and the row arithmetic on them. `PagedCache` allocates from it."""

    spec: CacheSpec
    dtype: torch.dtype
    layers: tuple[LayerLayout, ...]
    draft: tuple[LayerLayout, ...] = ()  # the MTP draft layers: sliding-window rings only

    @classmethod
    def build(cls, cfg: ModelConfig, spec: CacheSpec, dtype: torch.dtype) -> CacheLayout:
        for rate in sorted({cfg.compress_rate(i) for i in range(cfg.num_hidden_layers)} - {0}):
            if spec.block_tokens % rate:
                raise ConfigError(f"block_tokens={spec.block_tokens} must be a multiple of the compression rate {rate}")
        slots, blocks = spec.max_seqs + 1, spec.num_blocks + 1
        d, di, w, ahead = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window, spec.lookahead
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            rate = cfg.compress_rate(i)
            per_block = spec.block_tokens // rate if rate else 0
            pool = Region(f"layers.{i}.pool", dtype, (d,), w + ahead, per_block, slots, blocks)

            def comp(name: str, overlap: bool, dim: int, base: int) -> CompressorLayout:
                width = 2 * dim if overlap else dim
                region = partial(Region, slot_rows=(2 if overlap else 1) * rate + ahead, block_rows=0, slots=slots,
                                 blocks=blocks)
                return CompressorLayout(
                    rate=rate, overlap=overlap, width=width, dim=dim, per_block=per_block, base=base,
                    scratch_block=blocks - 1, buf_kv=region(f"{name}.buf_kv", dtype, (width,)),
                    buf_gate=region(f"{name}.buf_gate", dtype, (width,)),
                )

            compressor = comp(f"layers.{i}.compressor", kind == CSA, d, pool.block_start) if rate else None
            indexer = keys = None
            if kind == CSA:
                indexer = comp(f"layers.{i}.indexer", True, di, 0)
                keys = Region(f"layers.{i}.indexer.keys", dtype, (di,), 0, per_block, slots, blocks)
            layers.append(LayerLayout(i, kind, w, d, w + ahead, pool, compressor, indexer, keys))
        draft = tuple(LayerLayout(cfg.num_hidden_layers + j, SLIDING, w, d, w + ahead,
                                  Region(f"mtp.{j}.pool", dtype, (d,), w + ahead, 0, slots, blocks), None, None, None)
                      for j in range(spec.draft_layers))
        return cls(spec, dtype, tuple(layers), draft)

    @property
    def scratch_slot(self) -> int:
        return self.spec.max_seqs

    @property
    def scratch_block(self) -> int:
        return self.spec.num_blocks

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (window rings, compressor buffers, overlap state) over every layer."""
        return sum(layer.slot_bytes for layer in self.layers + self.draft)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (compressed entries and indexer keys) over every layer."""
        return sum(layer.block_bytes for layer in self.layers + self.draft)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache, scratch slot and block included (snapshots apart)."""
        return sum(layer.nbytes for layer in self.layers + self.draft)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one sliding-window snapshot: every layer's window KV and the CSA compressors' carried state (the
        kv and gate rows of the window that closes at the boundary)."""
        out = 0
        for layer in self.layers:
            out += layer.window * layer.pool.row_bytes
            for c in (layer.compressor, layer.indexer):
                if c is not None and c.overlap:
                    out += c.rate * (c.buf_kv.row_bytes + c.buf_gate.row_bytes)
        return out
