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

from deepinfer.config import CSA, ModelConfig
from deepinfer.errors import ConfigError, RequestError


@dataclass(frozen=True)
class CacheSpec:
    num_blocks: int
    max_seqs: int
    max_blocks_per_seq: int  # block-table width: the longest sequence is max_blocks_per_seq * block_tokens
    block_tokens: int = 128  # a multiple of every compression rate, so block boundaries close every window

    @property
    def max_tokens(self) -> int:
        return self.max_blocks_per_seq * self.block_tokens


@dataclass
class SeqCache:
    """One sequence's share of the cache: its slot, its blocks, and how many positions it holds."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class Compressor:
    """One compressor's tensors (views into the cache's storage)."""

    rate: int
    overlap: bool
    buf_kv: torch.Tensor  # [slots + 1, rate, width]
    buf_gate: torch.Tensor  # [slots + 1, rate, width] (gate without the position bias)
    entries: torch.Tensor  # [blocks + 1, entries_per_block, d] (a view into the layer's pool for the main one)
    ov_kv: torch.Tensor | None = None  # [slots + 1, rate, d]: the last closed window's first series
    ov_gate: torch.Tensor | None = None  # [slots + 1, rate, d] fp32, position bias included

    @property
    def per_block(self) -> int:
        return self.entries.shape[1]


@dataclass
class LayerCache:
    pool: torch.Tensor  # [(slots + 1) * W + (blocks + 1) * per_block, D]: window rings, then entries
    ring: torch.Tensor  # view [slots + 1, W, D]
    compressor: Compressor | None = None
    indexer: Compressor | None = None

    @property
    def entry_base(self) -> int:
        """Pool row of the first entry row."""
        return self.ring.shape[0] * self.ring.shape[1]


def block_bytes(cfg: ModelConfig, block_tokens: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per block, bytes per slot) of the cache for `cfg`."""
    elt = torch.tensor([], dtype=dtype).element_size()
    d, di, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    per_block = per_slot = 0
    for i, kind in enumerate(cfg.layer_types):
        rate = cfg.compress_rate(i)
        per_slot += w * d * elt
        if rate:
            width = 2 * d if kind == CSA else d
            per_block += block_tokens // rate * d * elt
            per_slot += 2 * rate * width * elt + (rate * d * (elt + 4) if kind == CSA else 0)
        if kind == CSA:
            per_block += block_tokens // rate * di * elt
            per_slot += 2 * rate * 2 * di * elt + rate * di * (elt + 4)
    return per_block, per_slot


class PagedCache:
    def __init__(self, cfg: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str):
        for rate in {cfg.compress_rate(i) for i in range(cfg.num_hidden_layers)} - {0}:
            if spec.block_tokens % rate:
                raise ConfigError(f"block_tokens={spec.block_tokens} must be a multiple of the compression rate {rate}")
        self.cfg, self.spec, self.dtype, self.device = cfg, spec, dtype, torch.device(device)
        slots, blocks, w, d = spec.max_seqs + 1, spec.num_blocks + 1, cfg.sliding_window, cfg.head_dim
        self.layers: list[LayerCache] = []
        for i, kind in enumerate(cfg.layer_types):
            rate = cfg.compress_rate(i)
            per_block = spec.block_tokens // rate if rate else 0
            pool = torch.zeros(slots * w + blocks * per_block, d, dtype=dtype, device=device)
            layer = LayerCache(pool=pool, ring=pool[: slots * w].view(slots, w, d))
            if rate:
                width = 2 * d if kind == CSA else d
                layer.compressor = self._compressor(rate, kind == CSA, width, d, pool[slots * w :].view(blocks, per_block, d))
            if kind == CSA:
                di = cfg.index_head_dim
                keys = torch.zeros(blocks, per_block, di, dtype=dtype, device=device)
                layer.indexer = self._compressor(rate, True, 2 * di, di, keys)
            self.layers.append(layer)
        self._free_slots = list(range(spec.max_seqs - 1, -1, -1))
        self._free_blocks = list(range(spec.num_blocks - 1, -1, -1))

    def _compressor(self, rate: int, overlap: bool, width: int, d: int, entries: torch.Tensor) -> Compressor:
        slots = self.spec.max_seqs + 1
        comp = Compressor(
            rate=rate,
            overlap=overlap,
            buf_kv=torch.zeros(slots, rate, width, dtype=self.dtype, device=self.device),
            buf_gate=torch.zeros(slots, rate, width, dtype=self.dtype, device=self.device),
            entries=entries,
        )
        if overlap:
            comp.ov_kv = torch.zeros(slots, rate, d, dtype=self.dtype, device=self.device)
            comp.ov_gate = torch.zeros(slots, rate, d, dtype=torch.float32, device=self.device)
        return comp

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def scratch_slot(self) -> int:
        return self.spec.max_seqs

    @property
    def scratch_block(self) -> int:
        return self.spec.num_blocks

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
        out = []
        for layer in self.layers:
            out.append(layer.pool)
            for c in (layer.compressor, layer.indexer):
                if c is not None:
                    out += [t for t in (c.buf_kv, c.buf_gate, c.ov_kv, c.ov_gate) if t is not None]
            if layer.indexer is not None:
                out.append(layer.indexer.entries)
        return out

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
