"""The per-sequence state of DeepSeek-V4.1, for many sequences at once: bounded state in per-sequence *slots*,
state that grows with the sequence in *blocks* of `block_tokens` positions, found through one block table.

Per slot (each ring indexed by `pos % rows`, with `lookahead` rows more than a step reads so that a speculative
verify step's rows past the positions its sequence keeps overwrite nothing it still reads: `model/rollback.py`):
- every layer's sliding-window ring of K=V rows (post-RoPE, FP8-rounded): the window and the lookahead;
- each ratio > 1 kv source's projected kv and gate score (fp32) of its last positions, from which a group pools:
  the group's ratio rows and the lookahead, rounded up to whole groups;
- the Engram token classes of the last positions (the n-gram history: max_ngram - 1, the step's own row and the
  lookahead);
- with DSpark draft blocks, each block's window ring of the kept positions' K=V (`model/v41_dspark.py`; only kept
  rows are written, so no lookahead).

Per block, for every kv source (each block's entries of every source, as V4's paged cache): its compressed
latents (post-RoPE, FP4: groups of 16 with e4m3 scales) read by every layer sharing them, and for key owners
(kv and index sources) their index keys (post-RoPE, FP4: groups of 32 with ue8m0 scales); stored as packed
e2m1 codes and scale bytes (`fp4_pack`), read back by `fp4_gather`. A block holds block_tokens / ratio entries
of a source; entry e of the sequence in slot s lives in block tables[s, e // per_block].

`tables` is a device tensor that row lookups read with tensor ops only (a captured decode step replays them):
the runtime writes a sequence's blocks into its slot's row (`V41SlotCache`); `empty` without `num_blocks`
gives each slot its own blocks for `max_len` positions (a dense cache, as tests and benchmarks use it). Block
`num_blocks` is scratch: table entries a sequence does not hold point there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.config_v41 import V41Config
from deepinfer.errors import ConfigError
from tilekernels import OpTable

LATENT_FP4 = (16, "e4m3")
INDEX_FP4 = (32, "ue8m0")
BLOCK_TOKENS = 128


@dataclass
class EntryStore:
    """Entries of one kind (a source's latents or its index keys), rounded through FP4 (`fmt`: group, scale
    format) and stored packed (codes and scale bytes per storage row) or, unpacked, as the rounded values in the
    model dtype (a debugging form for the reference ops: with the rounding ops off it stores the values exactly;
    the kernel plan does not trace it, so kernel backends use the packed form)."""

    fmt: tuple[int, str]
    codes: torch.Tensor | None = None  # packed: [rows, dim / 2] uint8
    scales: torch.Tensor | None = None  # packed: [rows, dim / group] uint8
    values: torch.Tensor | None = None  # unpacked: [rows, dim]

    @classmethod
    def empty(cls, rows: int, dim: int, fmt: tuple[int, str], packed: bool, dtype: torch.dtype,
              device) -> EntryStore:
        if not packed:
            return cls(fmt, values=torch.zeros(rows, dim, dtype=dtype, device=device))
        return cls(fmt, torch.zeros(rows, dim // 2, dtype=torch.uint8, device=device),
                   torch.zeros(rows, dim // fmt[0], dtype=torch.uint8, device=device))

    def write(self, ops: OpTable, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Round values [n, dim] through FP4 into storage rows [n]."""
        if self.values is not None:
            self.values[rows] = ops.fp4_act_qdq(values, *self.fmt).to(self.values.dtype)
        else:
            self.codes[rows], self.scales[rows] = ops.fp4_pack(values, *self.fmt)

    def read(self, ops: OpTable, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Storage rows [...] -> their values [..., dim] in `dtype`."""
        if self.values is not None:
            return self.values[rows].to(dtype)
        return ops.fp4_gather(self.codes, self.scales, rows, self.fmt[1], dtype)

    def scores(self, ops: OpTable, q: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Index keys at storage rows [S, E] (one set per query) or [E] (shared) scored by index queries
        q [S, nI, dI] with head weights [S, nI] (`indexer_scores`) -> [S, E] fp32; packed keys are read as
        stored (`indexer_scores_fp4`)."""
        if self.values is not None:
            return ops.indexer_scores(q, self.values[rows], weights, scale)
        return ops.indexer_scores_fp4(q, self.codes, self.scales, rows, weights, scale)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.values) if t is not None]


@dataclass
class CompressState:
    ratio: int
    per_block: int  # entries per block: block_tokens / ratio
    dtype: torch.dtype  # the values' dtype as the model reads them
    tables: torch.Tensor  # the cache's block table [slots, max_blocks] (shared by every source)
    latents: EntryStore
    keys: EntryStore | None  # key owners only
    partial_kv: torch.Tensor | None  # [slots, ring, head_dim] fp32 (ratio > 1): row pos % ring
    partial_score: torch.Tensor | None

    def group_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The ring rows of the group holding positions t [...] -> [..., ratio] (its first position first)."""
        first = t // self.ratio * self.ratio
        return (first.unsqueeze(-1) + torch.arange(self.ratio, device=t.device)) % self.partial_kv.shape[1]

    def rows(self, slot: int | torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Storage rows of entries (broadcast against a tensor of slots; each entry within the table's reach)."""
        per = self.per_block
        return self.tables[slot, entries // per] * per + entries % per


@dataclass
class V41Cache:
    cfg: V41Config
    max_len: int
    block_tokens: int
    dtype: torch.dtype
    tables: torch.Tensor  # [slots, max_blocks] int64
    windows: list[torch.Tensor]  # per layer [slots, window, head_dim]
    compressed: dict[int, CompressState]  # by kv-source layer
    classes: torch.Tensor  # [slots, ring] int64 Engram classes of the last positions, row pos % ring
    drafts: list[torch.Tensor] = field(default_factory=list)  # per DSpark block [slots, window, head_dim]
    lookahead: int = 0  # rows a step may write past the positions its sequence keeps
    num_tokens: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, cfg: V41Config, slots: int, max_len: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", block_tokens: int = BLOCK_TOKENS,
              num_blocks: int | None = None, packed: bool = True, lookahead: int = 0,
              draft_layers: int = 0) -> V41Cache:
        """`num_blocks` None: every slot owns the blocks for max_len positions; else a pool of `num_blocks`
        (and a scratch block) the runtime hands out through `tables`. `packed` False: the FP4 entries kept
        unpacked in `dtype` (`EntryStore`). `lookahead`: verify rows a step may write and not keep (speculative
        decoding); `draft_layers`: DSpark blocks with a window ring per slot."""
        if slots < 1 or max_len < 1 or lookahead < 0 or draft_layers < 0:
            raise ConfigError(f"a V4.1 cache needs slots >= 1, max_len >= 1, lookahead >= 0 and draft_layers >= 0, "
                              f"got {slots}, {max_len}, {lookahead} and {draft_layers}")
        ratios = sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layers})
        if block_tokens < 1 or any(block_tokens % r for r in ratios):
            raise ConfigError(f"block_tokens={block_tokens} must be a positive multiple of every compression "
                              f"ratio of the model ({ratios})")
        for name, dim, (group, _) in (("head_dim", cfg.head_dim, LATENT_FP4),
                                      ("index_head_dim", cfg.index_head_dim, INDEX_FP4)):
            if dim % group:
                raise ConfigError(f"{name}={dim}: V4.1's FP4 cache stores groups of {group} values; accepted: "
                                  f"multiples of {group}")
        max_blocks = -(-max_len // block_tokens)
        if num_blocks is None:
            num_blocks = slots * max_blocks
            tables = torch.arange(num_blocks, device=device).view(slots, max_blocks)
        else:
            tables = torch.full((slots, max_blocks), num_blocks, dtype=torch.long, device=device)
        d = cfg.head_dim
        windows = [torch.zeros(slots, cfg.sliding_window + lookahead, d, dtype=dtype, device=device)
                   for _ in range(cfg.num_hidden_layers)]
        drafts = [torch.zeros(slots, cfg.sliding_window, d, dtype=dtype, device=device) for _ in range(draft_layers)]
        compressed = {}
        for src in cfg.kv_source_layers:
            r = cfg.compress_ratios[src]
            per_block = block_tokens // r
            rows = (num_blocks + 1) * per_block
            partial = r > 1
            ring = -(-(r + lookahead) // r) * r
            compressed[src] = CompressState(
                r, per_block, dtype, tables, EntryStore.empty(rows, d, LATENT_FP4, packed, dtype, device),
                EntryStore.empty(rows, cfg.index_head_dim, INDEX_FP4, packed, dtype, device)
                if src in cfg.index_source_layers else None,
                torch.zeros(slots, ring, d, device=device) if partial else None,
                torch.zeros(slots, ring, d, device=device) if partial else None)
        back = cfg.engram.max_ngram + lookahead if cfg.engram is not None else 1
        classes = torch.zeros(slots, back, dtype=torch.int64, device=device)
        return cls(cfg, max_len, block_tokens, dtype, tables, windows, compressed, classes, drafts, lookahead,
                   [0] * slots)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding state."""
        out = [self.tables, *self.windows, *self.drafts, self.classes]
        for state in self.compressed.values():
            out += state.latents.tensors() + ([] if state.keys is None else state.keys.tensors())
            out += [t for t in (state.partial_kv, state.partial_score) if t is not None]
        return out

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def check_room(self, slot: int, new_tokens: int) -> None:
        if not 0 <= slot < len(self.num_tokens):
            raise ValueError(f"cache slot {slot} is outside [0, {len(self.num_tokens) - 1}]")
        if self.num_tokens[slot] + new_tokens > self.max_len:
            raise ValueError(f"slot {slot} holds {self.num_tokens[slot]} tokens; {new_tokens} more exceed the cache's "
                             f"max_len {self.max_len}")


def unit_bytes(cfg: V41Config, max_len: int, block_tokens: int, dtype: torch.dtype, lookahead: int = 0,
               draft_layers: int = 0) -> tuple[int, int]:
    """(bytes per block, bytes per slot) of a V4.1 cache whose slots span `max_len` positions."""
    def size(slots: int, blocks: int) -> int:
        return V41Cache.empty(cfg, slots, max_len, dtype, "meta", block_tokens, blocks, lookahead=lookahead,
                              draft_layers=draft_layers).num_bytes()

    return size(1, 2) - size(1, 1), size(2, 1) - size(1, 1)
