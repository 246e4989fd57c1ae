"""The V4.1 attention block when every chunk of a forward is one token (a decode step): every sequence at once,
one launch per op instead of one per sequence. The same arithmetic as the per-chunk path (`v41_attention`,
`v41_compress`) row by row: the window rows and compressed picks each query attends are the same values in the
same order (past window positions oldest first, then its own row, then its picks), the compressor and indexer
run the same ops on the same rows; shapes that differ between sequences (compressed entries seen) are padded
with entries no query sees (-inf scores, -1 indices)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.v41_cache import CompressState, V41Cache
from deepinfer.model.v41_compress import CompressContext, Published, cached_forms, select
from deepinfer.model.v41_weights import Compressor41, Indexer41, Layer41

STEP = -1  # the chunk index a decode step's picks and candidate blocks are published under (all sequences)


@dataclass(frozen=True)
class DecodeBatch:
    """One token per sequence: sequence i in cache slot `slot[i]` at position `t[i]` (both [B] int64 on the
    device). `bound` (an int at least every t) sizes the compressed entries the indexer scores: the cache's last
    position, so that a step's shapes do not change from step to step (a captured graph replays them)."""

    slot: torch.Tensor
    t: torch.Tensor
    bound: int


def decode_attention(ctx, w: Layer41, cache: V41Cache, step: DecodeBatch, q: torch.Tensor, kv: torch.Tensor,
                     ckv: torch.Tensor | None, cscore: torch.Tensor | None, x: torch.Tensor, qr: torch.Tensor,
                     shared: Published) -> torch.Tensor:
    """q [B, H, D], kv [B, D] (the window's FP8-rounded K=V), ckv / cscore [B, D] (a kv source's compressor
    projections) -> [B, H, D]. Only tensor work on the device (no host reads): a decode graph captures it."""
    cfg, ops, dev = ctx.cfg, ctx.ops, q.device
    pool, indices = _window(cache.windows[ctx.layer], cfg.sliding_window, step, kv)
    if ctx.compress is not None:
        state = cache.compressed[ctx.kv_source]
        if w.compressor is not None:
            _compress(ctx.compress, w.compressor, w.indexer, state, step, ckv, cscore)
        if w.indexer is not None:
            owner = cache.compressed[ctx.key_owner]
            # the keys each sequence's indexer scores: every entry a slot can hold (masked past its own)
            seen = torch.arange((step.bound + 1) // ctx.compress.ratio, device=dev).view(1, -1)
            keys = owner.rows(step.slot.view(-1, 1), seen)  # [B, E]
            shared.picks[(ctx.layer, STEP)] = select(ctx.compress, w.indexer, owner.keys, keys, STEP, x, qr, step.t,
                                                     shared)
        picks = shared.picks[(ctx.index_source, STEP)]  # [B, k], -1: none
        b, k = picks.shape
        # only what the queries read: [B, k, D]
        picked = state.latents.read(ops, state.rows(step.slot.view(-1, 1), picks.clamp(min=0)), pool.dtype)
        rows = pool.shape[0] + torch.arange(b * k, device=dev).view(b, k)
        indices = torch.cat([indices, torch.where(picks >= 0, rows, -1)], dim=1)
        pool = torch.cat([pool, picked.reshape(b * k, pool.shape[1])])
    return ops.sparse_attention(q, pool, indices, w.attn.sink, cfg.head_dim**-0.5)


def _window(ring: torch.Tensor, win: int, step: DecodeBatch, kv: torch.Tensor):
    """Every row's own K=V enters its slot's ring first (rows of one sequence at consecutive positions: a verify
    step), then each row reads its window from the ring (oldest first, its own last): the ring's lookahead rows
    keep a step's rows from overwriting positions its rows read. -> pool [B * win, D], indices [B, win] (-1: a
    position before the sequence start)."""
    b, size, dev = kv.shape[0], ring.shape[1], kv.device
    ring[step.slot, step.t % size] = kv.to(ring.dtype)
    seen = step.t.view(-1, 1) + torch.arange(-win + 1, 1, device=dev).view(1, -1)  # [B, win] positions, the last t
    rows = ring[step.slot.view(-1, 1), seen % size]
    index = torch.arange(b * win, device=dev).view(b, win)
    return rows.view(b * win, -1), torch.where(seen >= 0, index, -1)


def _compress(ctx: CompressContext, w: Compressor41, idx: Indexer41 | None, state: CompressState,
              step: DecodeBatch, kv: torch.Tensor, score: torch.Tensor | None) -> None:
    """A kv source's compressor for one new token per row: ratio 1 writes each token's latent (and key); ratio
    r > 1 puts every row's token in its slot's ring first, then each row pools its group from the ring. Where the
    token does not close its group the pooled row is a placeholder written at that open group's entry, which no
    query sees before the token that closes it rewrites it (entries seen: (t + 1) // r): so no row needs a
    host-side branch. Two rows of one group in a step (a verify step) pool the same ring rows: equal values."""
    ops, r, slot, t = ctx.ops, ctx.ratio, step.slot, step.t
    if r > 1:
        ring = state.partial_kv.shape[1]
        state.partial_kv[slot, t % ring] = kv.float()
        state.partial_score[slot, t % ring] = score.float()
        group, slots = state.group_rows(t), slot.view(-1, 1)
        kv = ops.compress_pool(state.partial_kv[slots, group], state.partial_score[slots, group])  # [B, r, D] -> [B, D]
    first = t // r
    latent, keys = cached_forms(ctx, w, idx, state, kv, first * r)
    rows = state.rows(slot, first)
    if keys is not None:
        state.keys.write(ops, rows, keys)
    state.latents.write(ops, rows, latent)
