"""The V4.1 attention block over a flat batch of sequence chunks (CPU reference path).

Every query attends, through one shared K=V head with a per-head sink, over its sliding window (its own
window ring, FP8-rounded K=V) and, on layers with a compression ratio, over the compressed positions its index
source picked from the shared latents of its kv source. Unlike V4 there is no per-head q norm and no
compressor position bias; the latents and picks are shared across layers (`v41_compress`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.config_v41 import V41Config
from deepinfer.model.attention import output_projection
from deepinfer.model.compressor import RopeTables
from deepinfer.model.v41_cache import V41Cache
from deepinfer.model.v41_compress import Chunk, CompressContext, Published, compress, select
from deepinfer.model.v41_decode import DecodeBatch, decode_attention
from deepinfer.model.v41_weights import Layer41, key_owner
from tilekernels import OpTable

WINDOW_FP8_GROUP = 32  # the window K=V is rounded through FP8 e4m3 with one ue8m0 scale per 32 values


@dataclass(frozen=True)
class LayerContext:
    cfg: V41Config
    ops: OpTable
    layer: int
    rope: RopeTables  # this layer's flavour: main for ratio 0, compressed otherwise
    compress: CompressContext | None  # ratio > 0
    kv_source: int | None
    index_source: int | None
    key_owner: int | None  # for index sources

    @classmethod
    def build(cls, cfg: V41Config, ops: OpTable, layer: int, main: RopeTables, compressed: RopeTables) -> LayerContext:
        ratio = cfg.compress_ratios[layer]
        is_index = layer in cfg.index_source_layers
        return cls(cfg, ops, layer, compressed if ratio else main,
                   CompressContext(cfg, ops, layer, compressed) if ratio else None,
                   cfg.kv_source(layer), cfg.index_source(layer), key_owner(cfg, layer) if is_index else None)


def fp8_round(ops: OpTable, x: torch.Tensor, group: int) -> torch.Tensor:
    """x [N, K] rounded through FP8 e4m3 with a power-of-two scale per `group` values (`act_quant`'s codes)."""
    codes, scales = ops.act_quant(x, group, True)
    return (codes.float() * scales.repeat_interleave(group, dim=-1)[:, : x.shape[-1]]).to(x.dtype)


def attention(ctx: LayerContext, w: Layer41, cache: V41Cache, chunks: list[Chunk] | DecodeBatch, x: torch.Tensor,
              pos: torch.Tensor, shared: Published) -> torch.Tensor:
    """x [N, D] (normed attention input of every chunk's rows, or of a decode step's sequences), pos [N] ->
    [N, D]."""
    cfg, ops, a, eps = ctx.cfg, ctx.ops, w.attn, ctx.cfg.rms_norm_eps
    n, rope = x.shape[0], ctx.rope
    qr = ops.rms_norm(ops.linear(x, a.wq_a), a.q_norm, eps)
    q = ops.linear(qr, a.wq_b).view(n, cfg.num_attention_heads, cfg.head_dim)
    q = ops.rope(q, pos, rope.inv_freq, rope.attention_factor)
    kv = ops.rope(ops.rms_norm(ops.linear(x, a.wkv), a.kv_norm, eps), pos, rope.inv_freq, rope.attention_factor)
    kv = fp8_round(ops, kv, WINDOW_FP8_GROUP)
    ckv = cscore = None
    if w.compressor is not None:
        gated = w.compressor.wgate is not None
        src = x.float() if gated else x  # ratio > 1 projects and pools in fp32, as the reference does
        ckv = ops.linear(src, w.compressor.wkv)
        cscore = ops.linear(src, w.compressor.wgate) if gated else None
    if isinstance(chunks, DecodeBatch):  # a decode step: every sequence at once (same rows, same values)
        out = decode_attention(ctx, w, cache, chunks, q, kv, ckv, cscore, x, qr, shared)
        return output_projection(ops, out, pos, rope, cfg.o_groups, a.wo_a, a.wo_b)
    out = torch.empty_like(q)
    for i, ch in enumerate(chunks):
        rows = ch.rows
        pool, indices = _window(ctx, cache, ch, kv[rows])
        if ctx.compress is not None:
            r = ctx.compress.ratio
            state = cache.compressed[ctx.kv_source]
            if w.compressor is not None:
                compress(ctx.compress, w.compressor, w.indexer, state, ch, ckv[rows],
                         None if cscore is None else cscore[rows])
            seen = torch.arange((ch.t0 + ch.length) // r, device=x.device)  # the entries the chunk's rows see
            if w.indexer is not None:
                owner = cache.compressed[ctx.key_owner]
                shared.picks[(ctx.layer, i)] = select(ctx.compress, w.indexer, owner.keys, owner.rows(ch.slot, seen),
                                                      i, x[rows], qr[rows], pos[rows], shared)
            picks = shared.picks[(ctx.index_source, i)]
            if picks.numel() < seen.shape[0]:  # decode: only the picked latents join the pool (not 32K rows)
                seen = picks.clamp(min=0).flatten()
                picks = torch.where(picks >= 0, torch.arange(picks.numel(), device=picks.device).view_as(picks), -1)
            latents = state.latents.read(ops, state.rows(ch.slot, seen), pool.dtype)
            comp_rows = torch.where(picks >= 0, picks + pool.shape[0], torch.full_like(picks, -1))
            pool = torch.cat([pool, latents])
            indices = torch.cat([indices, comp_rows], dim=1)
        out[rows] = ops.sparse_attention(q[rows], pool, indices, a.sink, cfg.head_dim**-0.5)
    return output_projection(ops, out, pos, rope, cfg.o_groups, a.wo_a, a.wo_b)


def _window(ctx: LayerContext, cache: V41Cache, ch: Chunk, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Update the chunk's sequence's window ring with its new rows; return the rows the chunk's queries see
    (the ring's earlier positions, then the chunk's own) and each query's window row list (-1 = none)."""
    win, t0, s = ctx.cfg.sliding_window, ch.t0, kv.shape[0]
    ring = cache.windows[ctx.layer][ch.slot]
    size = ring.shape[0]  # the window and the lookahead
    past = torch.arange(max(0, t0 - (win - 1)), t0, device=kv.device)
    rows = torch.cat([ring[past % size], kv])
    keep = torch.arange(max(t0, t0 + s - size), t0 + s, device=kv.device)
    ring[keep % size] = kv[keep - t0].to(ring.dtype)
    query = torch.arange(t0, t0 + s, device=kv.device).view(-1, 1)
    seen = query + torch.arange(-win + 1, 1, device=kv.device).view(1, -1)
    first = t0 - past.numel()
    return rows, torch.where(seen >= 0, seen - first, torch.full_like(seen, -1))
