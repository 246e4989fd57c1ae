"""The paged cache of DeepSeek-V4's per-sequence state, for many sequences at once.

Bounded state lives in per-sequence *slots*: each layer's sliding-window K=V ring (W rows), and each
compressor's open-window buffer (kv, gate without bias) and CSA overlap (the previous window's first series,
gate with bias). State that grows with the sequence — compressed entries (CSA, HCA) and lightning-indexer
keys — lives in *blocks*: a block covers `block_tokens` positions and holds every entry those positions produce
in every layer (block_tokens / rate entries per compressed layer). A sequence holds one slot and a block table.

Per layer, the window ring and the entries share one K=V pool tensor, so that attention gathers its rows from
one tensor by row index. Slot `max_seqs` and block `num_blocks` are scratch: padded batch rows and entries that
are not being written this step go there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.config import ModelConfig
from deepinfer.errors import RequestError
from deepinfer.runtime.cache_layout import CacheLayout, CacheSpec, CompressorLayout, LayerLayout, Region

__all__ = ["CacheLayout", "CacheSpec", "Compressor", "CompressorLayout", "LayerCache", "LayerLayout", "PagedCache",
           "Region", "SeqCache"]


@dataclass
class SeqCache:
    """One sequence's share of the cache: its slot, its blocks, and how many positions it holds."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class Compressor:
    """One compressor's tensors, allocated from (and indexed through) its layout."""

    layout: CompressorLayout
    store: torch.Tensor  # [rows, dim]: the entries (the layer's pool for the main compressor, its keys for the indexer)
    buf_kv: torch.Tensor  # [slots + 1, rate, width]
    buf_gate: torch.Tensor  # [slots + 1, rate, width] (gate without the position bias)
    ov_kv: torch.Tensor | None = None  # [slots + 1, rate, dim]: the last closed window's first series
    ov_gate: torch.Tensor | None = None  # [slots + 1, rate, dim] fp32, position bias included

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

        return cls(layout, store, alloc(layout.buf_kv), alloc(layout.buf_gate), alloc(layout.ov_kv),
                   alloc(layout.ov_gate))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.buf_kv, self.buf_gate, self.ov_kv, self.ov_gate) if t is not None]


@dataclass
class LayerCache:
    layout: LayerLayout
    pool: torch.Tensor  # [(slots + 1) * W + (blocks + 1) * per_block, D]: window rings, then entries
    ring: torch.Tensor  # view [slots + 1, W, D]
    compressor: Compressor | None = None
    indexer: Compressor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding state (the main entries live inside the pool)."""
        out = [self.pool]
        for c in (self.compressor, self.indexer):
            if c is not None:
                out += c.tensors()
        if self.indexer is not None:
            out.append(self.indexer.store)
        return out


class PagedCache:
    def __init__(self, cfg: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str):
        self.cfg, self.spec, self.dtype, self.device = cfg, spec, dtype, torch.device(device)
        self.layout = CacheLayout.build(cfg, spec, dtype)
        self.layers: list[LayerCache] = []
        for lay in self.layout.layers:
            pool = lay.pool.allocate(device)
            layer = LayerCache(lay, pool, lay.pool.slot_view(pool))
            if lay.compressor is not None:
                layer.compressor = Compressor.allocate(lay.compressor, pool, device)
            if lay.indexer is not None:
                layer.indexer = Compressor.allocate(lay.indexer, lay.keys.allocate(device), device)
            self.layers.append(layer)
        self._free_slots = list(range(spec.max_seqs - 1, -1, -1))
        self._free_blocks = list(range(spec.num_blocks - 1, -1, -1))

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def scratch_slot(self) -> int:
        return self.layout.scratch_slot

    @property
    def scratch_block(self) -> int:
        return self.layout.scratch_block

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def used_blocks(self) -> int:
        return self.spec.num_blocks - len(self._free_blocks)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.spec.block_tokens)

    def check_fits(self, tokens: int, what: str) -> None:
        """Raise RequestError for a request that could never be served, whatever else runs."""
        need = self.blocks_for(tokens)
        if tokens > self.spec.max_tokens or need > self.spec.num_blocks:
            limit = min(self.spec.max_tokens, self.spec.num_blocks * self.spec.block_tokens)
            raise RequestError(f"{what} needs {tokens} positions, more than this cache can ever hold ({limit}: "
                               f"{self.spec.num_blocks} blocks of {self.spec.block_tokens} positions, at most "
                               f"{self.spec.max_blocks_per_seq} per sequence); raise the cache size or shorten it")

    def admit(self) -> SeqCache | None:
        """A slot for a new sequence, or None when every slot is taken."""
        if not self._free_slots:
            return None
        return SeqCache(slot=self._free_slots.pop())

    def grow(self, seq: SeqCache, tokens: int) -> bool:
        """Give `seq` the blocks to hold `tokens` positions; False (and nothing taken) if they are not free."""
        need = self.blocks_for(tokens) - len(seq.blocks)
        if need <= 0:
            return True
        if need > len(self._free_blocks) or self.blocks_for(tokens) > self.spec.max_blocks_per_seq:
            return False
        seq.blocks.extend(self._free_blocks.pop() for _ in range(need))
        return True

    def release(self, seq: SeqCache) -> None:
        """Return a sequence's slot and blocks (its slot state is reset on its next admission)."""
        self._free_blocks.extend(reversed(seq.blocks))
        seq.blocks = []
        self._free_slots.append(seq.slot)
        seq.slot = -1

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
        return [t for layer in self.layers for t in layer.tensors()]

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
