"""V4.1's shared compressed state for one sequence chunk: the kv-source compressor (ratio 2: softmax-gated
pooling of two tokens; ratio 1: one normed latent per token), the index keys of the key owners, and the indexer
of the index-source layers with the candidate-block pre-selection (DeepSeek's reference `inference/model.py`
at dba1be0, tools/v41_reference/NOTES.md sections 3b-3g).

Latents and keys stand for the first token of their group (group g at position g * ratio): the keys are
computed from the latent before RoPE, then both are rotated there and stored through FP4 (latents: groups of 16
with e4m3 scales; keys: groups of 32 with ue8m0 scales, as the index queries are rounded: `v41_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.config_v41 import V41Config
from deepinfer.model.compressor import RopeTables
from deepinfer.model.v41_cache import INDEX_FP4, CompressState, EntryStore
from deepinfer.model.v41_weights import Compressor41, Indexer41
from tilekernels import OpTable


@dataclass(frozen=True)
class Chunk:
    """One sequence's tokens in a forward batch: flat rows start..start+length-1 at positions t0.."""

    slot: int
    start: int
    length: int
    t0: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


@dataclass
class Published:
    """What layers hand down within one forward: each index source's picks and the candidate blocks, per chunk
    (the reference's process-wide `shared_attn`, scoped to one call)."""

    picks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (index source, chunk) -> [S, k]
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk -> bool [S, E]


@dataclass(frozen=True)
class CompressContext:
    cfg: V41Config
    ops: OpTable
    layer: int
    rope: RopeTables  # the compressed flavour (theta compress_rope_theta, YaRN)

    @property
    def ratio(self) -> int:
        return self.cfg.compress_ratios[self.layer]


def _round(ops: OpTable, x: torch.Tensor, fmt: tuple[int, str]) -> torch.Tensor:
    return ops.fp4_act_qdq(x, *fmt)


def compress(ctx: CompressContext, w: Compressor41, idx: Indexer41 | None, state: CompressState, chunk: Chunk,
             kv: torch.Tensor, score: torch.Tensor | None) -> None:
    """Feed a kv source's projected `kv` (and gate `score` for ratio > 1) of one chunk [S, head_dim]; write the
    latents (and, for a key owner, the index keys) of every group that completes."""
    ops, r, slot = ctx.ops, ctx.ratio, chunk.slot
    if r == 1:
        first, pooled = chunk.t0, kv
    else:  # the open group's earlier rows from the ring; every row of the chunk enters it (a verify step's
        # kept rows may end anywhere in it)
        t0, n, ring = chunk.t0, kv.shape[0], state.partial_kv.shape[1]
        fill = t0 % r
        before = torch.arange(t0 - fill, t0, device=kv.device) % ring
        new_kv, new_score = kv.float(), score.float()
        kv = torch.cat([state.partial_kv[slot, before], new_kv])
        score = torch.cat([state.partial_score[slot, before], new_score])
        keep = torch.arange(max(0, n - ring), n, device=kv.device)
        state.partial_kv[slot, (t0 + keep) % ring] = new_kv[keep]
        state.partial_score[slot, (t0 + keep) % ring] = new_score[keep]
        used = kv.shape[0] // r * r
        first = t0 // r
        pooled = ops.compress_pool(kv[:used].view(-1, r, kv.shape[-1]), score[:used].view(-1, r, kv.shape[-1]))
    n = pooled.shape[0]
    if n == 0:
        return
    entries = torch.arange(first, first + n, device=pooled.device)
    latent, keys = cached_forms(ctx, w, idx, state, pooled, entries * r)
    rows = state.rows(slot, entries)
    if keys is not None:
        state.keys.write(ops, rows, keys)
    state.latents.write(ops, rows, latent)


def cached_forms(ctx: CompressContext, w: Compressor41, idx: Indexer41 | None, state: CompressState,
                 pooled: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pooled groups [n, head_dim] standing for `positions` -> (their latents, their index keys when `state` holds
    keys, else None), normed and rotated there: the values the caches store (through FP4)."""
    ops, eps = ctx.ops, ctx.cfg.rms_norm_eps
    latent = ops.rms_norm(pooled.to(state.dtype), w.norm, eps)
    keys = None
    if state.keys is not None:
        keys = ops.rms_norm(ops.linear(latent, idx.wk), idx.k_norm, eps)
        keys = ops.rope(keys, positions, ctx.rope.inv_freq, ctx.rope.attention_factor)
    return ops.rope(latent, positions, ctx.rope.inv_freq, ctx.rope.attention_factor), keys


def select(ctx: CompressContext, w: Indexer41, keys: EntryStore, rows: torch.Tensor, chunk_index: int,
           x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, shared: Published) -> torch.Tensor:
    """The indexer of an index source for the queries of one chunk (or of a decode step, `chunk_index` STEP):
    x [S, D] (the attention input), qr [S, q_lora], pos [S], the key owner's index keys at storage rows [E]
    shared by the queries or [S, E] one set per query (a query sees its first (pos + 1) // ratio) -> picks
    [S, min(index_topk, E)], -1 = none."""
    cfg, ops, r = ctx.cfg, ctx.ops, ctx.ratio
    s, e = x.shape[0], rows.shape[-1]
    visible = (pos + 1) // r
    if e == 0:
        shared.candidates.setdefault(chunk_index, torch.zeros(s, 0, dtype=torch.bool, device=x.device))
        return torch.full((s, 0), -1, dtype=torch.long, device=x.device)
    q = ops.linear(qr, w.wq_b).view(s, cfg.index_n_heads, cfg.index_head_dim)
    q = _round(ops, ops.rope(q, pos, ctx.rope.inv_freq, ctx.rope.attention_factor), INDEX_FP4)
    weights = ops.linear(x, w.weights_proj).float() * cfg.index_n_heads**-0.5
    scores = keys.scores(ops, q, rows, weights, cfg.index_head_dim**-0.5)
    scores = scores.masked_fill(torch.arange(e, device=x.device).view(1, -1) >= visible.view(-1, 1), float("-inf"))
    source = cfg.candidate_source_layer
    if source == ctx.layer:
        shared.candidates[chunk_index] = ops.candidate_blocks(scores, visible, cfg.candidate_topk_blocks,
                                                              cfg.candidate_block_size)
    elif source is not None and source < ctx.layer:
        scores = scores.masked_fill(~shared.candidates[chunk_index], float("-inf"))
    return ops.indexer_topk(scores, visible, cfg.index_topk)
