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

from deepinfer.runtime.cache import LayerCache
from deepinfer.model.attention import AttentionContext, Projected
from deepinfer.model.compressor import compress_decode
from deepinfer.model.weights import Attention


@dataclass(frozen=True)
class DecodeInputs:
    """Device tensors of one decode step (a graph's static inputs)."""

    ids: torch.Tensor  # [B] int64: the token each row feeds
    positions: torch.Tensor  # [B] int64: its position
    slots: torch.Tensor  # [B] int64: cache slot of the row's sequence (scratch for padding)
    blocks: torch.Tensor  # [B, max_blocks] int64: block table (scratch-padded)


def decode_core(ctx: AttentionContext, w: Attention, p: Projected, inp: DecodeInputs,
                layer: LayerCache) -> torch.Tensor:
    cfg, ops, lay = ctx.cfg, ctx.ops, layer.layout
    pos, slots, blocks = inp.positions, inp.slots, inp.blocks
    layer.pool[lay.window_rows(slots, pos)] = p.kv.to(layer.pool.dtype)
    indices = lay.attend_rows(slots, pos)
    if p.comp is not None:
        eps, crope, comp = cfg.rms_norm_eps, ctx.compress_rope, layer.compressor
        compress_decode(ops, comp, w.compressor, slots, pos, blocks, *p.comp, eps, crope)
        visible = comp.layout.closed(pos)
        entry = comp.layout.table_entries(blocks)
        if ctx.is_csa:
            ikv, igate, iq, iw = p.index
            idx = layer.indexer
            compress_decode(ops, idx, w.indexer.compressor, slots, pos, blocks, ikv, igate, eps, crope)
            rows = idx.layout.entry_rows(blocks, entry)  # [B, E]: each sequence's keys, read where they are stored
            scores = ops.indexer_scores(iq, idx.store, iw, cfg.index_head_dim**-0.5, rows=rows)
            picks = ops.indexer_topk(scores, visible, cfg.index_topk)
        else:
            picks = torch.where(entry < visible.view(-1, 1), entry, torch.full_like(entry, -1))
        indices = torch.cat([indices, comp.layout.picked_rows(blocks, picks)], dim=1)
    return ops.sparse_attention(p.q, layer.pool, indices, w.sinks, cfg.head_dim**-0.5)
