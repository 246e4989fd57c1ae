"""The V4.1 attention block when every chunk of a forward is one token (a decode step): every sequence at once,
one launch per op instead of one per sequence. The same arithmetic as the per-chunk path (`v41_attention`,
`v41_compress`) row by row: the window rows and compressed picks each query attends are the same values in the
same order (past window positions oldest first, then its own row, then its picks), the compressor and indexer
run the same ops on the same rows; shapes that differ between sequences (compressed entries seen) are padded
with entries no query sees (-inf scores, -1 indices)."""

from __future__ import annotations

import torch

from deepinfer.model.v41_cache import CompressState, V41Cache
from deepinfer.model.v41_compress import INDEX_FP4, LATENT_FP4, CompressContext, Published
from deepinfer.model.v41_weights import Compressor41, Indexer41, Layer41

STEP = -1  # the chunk index a decode step's picks and candidate blocks are published under (all sequences)


def decode_attention(ctx, w: Layer41, cache: V41Cache, slots: list[int], t: list[int], q: torch.Tensor,
                     kv: torch.Tensor, ckv: torch.Tensor | None, cscore: torch.Tensor | None, x: torch.Tensor,
                     qr: torch.Tensor, pos: torch.Tensor, shared: Published) -> torch.Tensor:
    """One token per sequence (sequence i in cache slot slots[i] at position t[i]): q [B, H, D], kv [B, D] (the
    window's FP8-rounded K=V), ckv / cscore [B, D] (a kv source's compressor projections) -> [B, H, D]."""
    cfg, ops, dev = ctx.cfg, ctx.ops, q.device
    slot = torch.tensor(slots, device=dev)
    pool, indices = _window(cache.windows[ctx.layer], slot, t, kv)
    if ctx.compress is not None:
        state = cache.compressed[ctx.kv_source]
        if w.compressor is not None:
            _compress(ctx.compress, w.compressor, w.indexer, state, slot, t, ckv, cscore)
        if w.indexer is not None:
            keys = cache.compressed[ctx.key_owner].keys
            shared.picks[(ctx.layer, STEP)] = _select(ctx.compress, w.indexer, keys, slot, t, x, qr, pos, shared)
        picks = shared.picks[(ctx.index_source, STEP)]  # [B, k], -1: none
        b, k = picks.shape
        picked = state.latents[slot.view(-1, 1), picks.clamp(min=0)]  # [B, k, D]: only what the queries read
        rows = pool.shape[0] + torch.arange(b * k, device=dev).view(b, k)
        indices = torch.cat([indices, torch.where(picks >= 0, rows, -1)], dim=1)
        pool = torch.cat([pool, picked.reshape(b * k, pool.shape[1]).to(pool.dtype)])
    return ops.sparse_attention(q, pool, indices, w.attn.sink, cfg.head_dim**-0.5)


def _window(ring: torch.Tensor, slot: torch.Tensor, t: list[int], kv: torch.Tensor):
    """Each sequence's earlier window rows (oldest first) and its own; then its own row enters its ring.
    -> pool [B * win, D], indices [B, win] (-1: a position before the sequence start)."""
    b, win, dev = len(t), ring.shape[1], kv.device
    now = torch.tensor(t, device=dev).view(-1, 1)
    seen = now + torch.arange(-win + 1, 1, device=dev).view(1, -1)  # [B, win] positions, the last one t
    rows = torch.cat([ring[slot.view(-1, 1), seen[:, :-1] % win], kv.unsqueeze(1).to(ring.dtype)], dim=1)
    ring[slot, now.view(-1) % win] = kv.to(ring.dtype)
    index = torch.arange(b * win, device=dev).view(b, win)
    return rows.view(b * win, -1), torch.where(seen >= 0, index, -1)


def _compress(ctx: CompressContext, w: Compressor41, idx: Indexer41 | None, state: CompressState,
              slot: torch.Tensor, t: list[int], kv: torch.Tensor, score: torch.Tensor | None) -> None:
    """A kv source's compressor for one new token per sequence: ratio 1 writes each token's latent; ratio r > 1
    keeps the token in its slot's partial group, and pools the groups this token completes."""
    ops, r, eps = ctx.ops, ctx.ratio, ctx.cfg.rms_norm_eps
    if r == 1:
        done, first, pooled = list(range(len(t))), torch.tensor(t, device=kv.device), kv
    else:
        fill = [p % r for p in t]
        done = [i for i, f in enumerate(fill) if f == r - 1]
        wait = [i for i, f in enumerate(fill) if f != r - 1]
        if wait:
            at = torch.tensor([fill[i] for i in wait], device=kv.device)
            state.partial_kv[slot[wait], at] = kv[wait].float()
            state.partial_score[slot[wait], at] = score[wait].float()
        if not done:
            return
        group = slot[done]
        pooled = ops.compress_pool(torch.cat([state.partial_kv[group, : r - 1], kv[done].float().unsqueeze(1)], 1),
                                   torch.cat([state.partial_score[group, : r - 1], score[done].float().unsqueeze(1)], 1))
        first = torch.tensor([t[i] // r for i in done], device=kv.device)
    target = slot[done]
    latent = ops.rms_norm(pooled.to(state.latents.dtype), w.norm, eps)
    positions = first * r
    if state.keys is not None:
        keys = ops.rms_norm(ops.linear(latent, idx.wk), idx.k_norm, eps)
        keys = ops.rope(keys, positions, ctx.rope.inv_freq, ctx.rope.attention_factor)
        state.keys[target, first] = ops.fp4_act_qdq(keys, *INDEX_FP4)
    latent = ops.rope(latent, positions, ctx.rope.inv_freq, ctx.rope.attention_factor)
    state.latents[target, first] = ops.fp4_act_qdq(latent, *LATENT_FP4)


def _select(ctx: CompressContext, w: Indexer41, keys: torch.Tensor, slot: torch.Tensor, t: list[int],
            x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, shared: Published) -> torch.Tensor:
    """The indexer of an index source for one token per sequence over its key owner's keys [slots, E, dI]
    (sequence i sees its first (t[i] + 1) // r) -> picks [B, min(index_topk, E max)], -1: none."""
    cfg, ops, r = ctx.cfg, ctx.ops, ctx.ratio
    b, seen = len(t), max((p + 1) // r for p in t)
    visible = (pos + 1) // r
    if seen == 0:
        shared.candidates.setdefault(STEP, torch.zeros(b, 0, dtype=torch.bool, device=x.device))
        return torch.full((b, 0), -1, dtype=torch.long, device=x.device)
    q = ops.linear(qr, w.wq_b).view(b, cfg.index_n_heads, cfg.index_head_dim)
    q = ops.fp4_act_qdq(ops.rope(q, pos, ctx.rope.inv_freq, ctx.rope.attention_factor), *INDEX_FP4)
    weights = ops.linear(x, w.weights_proj).float() * cfg.index_n_heads**-0.5
    scores = ops.indexer_scores(q, keys[slot, :seen], weights, cfg.index_head_dim**-0.5)  # [B, E max]
    scores = scores.masked_fill(torch.arange(seen, device=x.device).view(1, -1) >= visible.view(-1, 1), float("-inf"))
    source = cfg.candidate_source_layer
    if source == ctx.layer:
        shared.candidates[STEP] = ops.candidate_blocks(scores, visible, cfg.candidate_topk_blocks,
                                                       cfg.candidate_block_size)
    elif source is not None and source < ctx.layer:
        scores = scores.masked_fill(~shared.candidates[STEP], float("-inf"))
    return ops.indexer_topk(scores, visible, cfg.index_topk)
