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
from deepinfer.model.step_rows import StepRows
from deepinfer.model.weights import Attention


@dataclass(frozen=True)
class DecodeInputs:
    """Device tensors of one decode step (a graph's static inputs)."""

    ids: torch.Tensor  # [B] int64: the token each row feeds
    positions: torch.Tensor  # [B] int64: its position
    slots: torch.Tensor  # [B] int64: cache slot of the row's sequence (scratch for padding)
    blocks: torch.Tensor  # [B, max_blocks] int64: block table (scratch-padded)


def decode_core(ctx: AttentionContext, w: Attention, p: Projected, layer: LayerCache, rows: StepRows) -> torch.Tensor:
    cfg, ops, lay = ctx.cfg, ctx.ops, layer.layout
    indices = rows.attend(lay)
    layer.pool[rows.window(lay)] = p.kv.to(layer.pool.dtype)
    if p.comp is None:
        return ops.sparse_attention(p.q, layer.pool, indices, w.sinks, cfg.head_dim**-0.5)
    eps, crope, comp = cfg.rms_norm_eps, ctx.compress_rope, layer.compressor
    compress_decode(ops, comp, w.compressor, rows, *p.comp, eps, crope)
    cl = comp.layout
    if ctx.is_csa:
        ikv, igate, iq, iw = p.index
        idx = layer.indexer
        compress_decode(ops, idx, w.indexer.compressor, rows, ikv, igate, eps, crope)
        # [B, E]: each sequence's keys, read where they are stored (no gathered copy)
        scores = ops.indexer_scores(iq, idx.store, iw, ctx.index_scale, rows=rows.keys(idx.layout))
        picks = ops.indexer_topk(scores, rows.closed(cl.rate), cfg.index_topk)
        indices = torch.cat([indices, rows.picked(cl, picks)], dim=1)
    else:  # HCA: every closed entry, the same rows for every HCA layer of this geometry
        indices = rows.get(("hca", lay.window, lay.ring, cl), lambda: torch.cat([indices, rows.visible(cl)], dim=1))
    return ops.sparse_attention(p.q, layer.pool, indices, w.sinks, cfg.head_dim**-0.5)
