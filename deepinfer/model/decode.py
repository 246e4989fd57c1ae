"""The attention core of a decode step: one new token for each of B sequences, static shapes, no host
syncs, so the whole step can be captured once per batch size and replayed.

Every row writes its token's K=V into its window ring and its compressor buffers, pools a closing window (the
entry goes to its block, or to the scratch block when no window closes), and attends over its window ring
rows and its compressed entries (all closed ones for HCA; the indexer's top-k over the whole block table for
CSA). Padding rows use the scratch slot and scratch blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.cache import LayerCache, PagedCache
from deepinfer.model.attention import AttentionContext, Projected
from deepinfer.model.compressor import compress_decode, entry_rows
from deepinfer.model.weights import Attention


@dataclass(frozen=True)
class DecodeInputs:
    """Device tensors of one decode step (a graph's static inputs)."""

    ids: torch.Tensor  # [B] int64: the token each row feeds
    positions: torch.Tensor  # [B] int64: its position
    slots: torch.Tensor  # [B] int64: cache slot of the row's sequence (scratch for padding)
    blocks: torch.Tensor  # [B, max_blocks] int64: block table (scratch-padded)


def decode_core(ctx: AttentionContext, w: Attention, p: Projected, inp: DecodeInputs, layer: LayerCache,
                cache: PagedCache) -> torch.Tensor:
    cfg, ops = ctx.cfg, ctx.ops
    window, pos, slots, blocks = cfg.sliding_window, inp.positions, inp.slots, inp.blocks
    layer.ring[slots, pos % window] = p.kv.to(layer.ring.dtype)
    win_pos = pos.view(-1, 1) + torch.arange(-window + 1, 1, device=pos.device).view(1, -1)
    win_rows = torch.where(win_pos >= 0, slots.view(-1, 1) * window + win_pos % window, torch.full_like(win_pos, -1))
    indices = win_rows
    if p.comp is not None:
        eps, crope, comp = cfg.rms_norm_eps, ctx.compress_rope, layer.compressor
        compress_decode(ops, comp, w.compressor, slots, pos, blocks, cache.scratch_block, *p.comp, eps, crope)
        visible = (pos + 1) // comp.rate
        entry = torch.arange(blocks.shape[1] * comp.per_block, device=pos.device).view(1, -1).expand(pos.shape[0], -1)
        if ctx.is_csa:
            ikv, igate, iq, iw = p.index
            idx = layer.indexer
            compress_decode(ops, idx, w.indexer.compressor, slots, pos, blocks, cache.scratch_block, ikv, igate, eps,
                            crope)
            keys = idx.entries.view(-1, idx.entries.shape[-1])[entry_rows(idx, blocks, entry)]  # [B, E, dI]
            scores = ops.indexer_scores(iq, keys, iw, cfg.index_head_dim**-0.5)
            picks = ops.indexer_topk(scores, visible, cfg.index_topk)
        else:
            picks = torch.where(entry < visible.view(-1, 1), entry, torch.full_like(entry, -1))
        rows = layer.entry_base + entry_rows(comp, blocks, picks.clamp(min=0))
        indices = torch.cat([win_rows, torch.where(picks >= 0, rows, torch.full_like(rows, -1))], dim=1)
    return ops.sparse_attention(p.q, layer.pool, indices, w.sinks, cfg.head_dim**-0.5)
