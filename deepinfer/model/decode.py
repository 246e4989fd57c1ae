"""The attention core of a decode step: one new token for each of B sequences, static shapes, no host
syncs, so the whole step can be captured once per batch size and replayed.

Every row writes its token's K=V into its window ring and its compressor buffers, pools a closing window (the
entry goes to its block, or to the scratch block when no window closes), and attends over its window ring
rows and its compressed entries (all closed ones for HCA; the indexer's top-k over the whole block table for
CSA). Padding rows use the scratch slot and scratch blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping

import torch

from deepinfer.runtime.cache import LayerCache
from deepinfer.model.attention import AttentionContext, project_inputs, project_keys, project_query
from deepinfer.model.compressor import compress_decode
from deepinfer.model.side_stream import branch, join
from deepinfer.model.step_rows import StepRows
from deepinfer.model.weights import Attention


@dataclass(frozen=True)
class DecodeInputs:
    """Device tensors of one decode step (a graph's static inputs)."""

    ids: torch.Tensor  # [B] int64: the token each row feeds
    positions: torch.Tensor  # [B] int64: its position
    slots: torch.Tensor  # [B] int64: cache slot of the row's sequence (scratch for padding)
    blocks: torch.Tensor  # [B, max_blocks] int64: block table (scratch-padded)
    rows: Mapping[Hashable, object] = field(default_factory=dict)  # `StepRows` made on the host (`host_rows.py`)
    kept: Mapping[Hashable, torch.Tensor] = field(default_factory=dict)  # kept between steps (`HostRows.buffers`)


def decode_attention(ctx: AttentionContext, w: Attention, x: torch.Tensor, pos: torch.Tensor, layer: LayerCache,
                     rows: StepRows, side=None) -> torch.Tensor:
    """The attention of a decode step's rows x [B, H] at RoPE positions `pos` -> [B, heads, D]: the query's GEMM on
    the current stream, the key side (cache writes, compressors, indexer) on `side` beside it (`side_stream.py`)."""
    lin, q_res = project_inputs(ctx, w, x)
    with branch(side):  # reads x, q_res and the stacked outputs, all held here until the join
        indices = decode_keys(ctx, w, *project_keys(ctx, w, lin, q_res, pos), layer, rows)
    q = project_query(ctx, w, q_res, pos)
    join(side)
    return ctx.ops.sparse_attention(q, layer.pool, indices, w.sinks, ctx.cfg.head_dim**-0.5)


def decode_keys(ctx: AttentionContext, w: Attention, kv: torch.Tensor, comp, index, layer: LayerCache,
                rows: StepRows) -> torch.Tensor:
    """Write the rows' kv into the window ring and their compressors, pool what closes; -> the pool rows each row
    attends [B, window + picks]."""
    cfg, ops, lay = ctx.cfg, ctx.ops, layer.layout
    indices = rows.attend(lay)
    layer.pool.index_copy_(0, rows.window(lay), kv.to(layer.pool.dtype))  # index_copy_: ~0.5 us under index_put_
    if comp is None:
        return indices
    eps, crope, store = cfg.rms_norm_eps, ctx.compress_rope, layer.compressor
    compress_decode(ops, store, w.compressor, rows, *comp, eps, crope)
    cl = store.layout
    if ctx.is_csa:
        ikv, igate, iq, iw = index
        idx = layer.indexer
        compress_decode(ops, idx, w.indexer.compressor, rows, ikv, igate, eps, crope)
        # [B, E]: each sequence's keys, read where they are stored (no gathered copy)
        scores = ops.indexer_scores(iq, idx.store, iw, ctx.index_scale, rows=rows.keys(idx.layout))
        picks = ops.indexer_topk(scores, rows.closed(cl.rate), cfg.index_topk)
        return torch.cat([indices, rows.picked(cl, picks)], dim=1)
    # HCA: every closed entry, the same rows for every HCA layer of this geometry
    return rows.get(("hca", lay.window, lay.ring, cl), lambda: torch.cat([indices, rows.visible(cl)], dim=1))
