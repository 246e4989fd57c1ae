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


class StepRows:
    """The cache rows of one decode step that layers of the same geometry share, each made once per step instead of
    once per layer: the window rows (every layer), a compressor's buffer place, closing flag and closing entry
    (every compressor of that rate), the rows its closing entry goes to and the indexer's key rows (every compressor
    of that layout), and an HCA layer's whole row list. Keys name the geometry a value depends on; a new object per
    step (the inputs' tensors are reused between steps)."""

    def __init__(self) -> None:
        self._made: dict = {}

    def get(self, key: tuple, make):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


@dataclass(frozen=True)
class DecodeInputs:
    """Device tensors of one decode step (a graph's static inputs)."""

    ids: torch.Tensor  # [B] int64: the token each row feeds
    positions: torch.Tensor  # [B] int64: its position
    slots: torch.Tensor  # [B] int64: cache slot of the row's sequence (scratch for padding)
    blocks: torch.Tensor  # [B, max_blocks] int64: block table (scratch-padded)


def decode_core(ctx: AttentionContext, w: Attention, p: Projected, inp: DecodeInputs,
                layer: LayerCache, rows: StepRows) -> torch.Tensor:
    cfg, ops, lay = ctx.cfg, ctx.ops, layer.layout
    pos, slots, blocks = inp.positions, inp.slots, inp.blocks
    layer.pool[rows.get(("window", lay.window), lambda: lay.window_rows(slots, pos))] = p.kv.to(layer.pool.dtype)
    indices = rows.get(("attend", lay.window), lambda: lay.attend_rows(slots, pos))
    if p.comp is None:
        return ops.sparse_attention(p.q, layer.pool, indices, w.sinks, cfg.head_dim**-0.5)
    eps, crope, comp = cfg.rms_norm_eps, ctx.compress_rope, layer.compressor
    compress_decode(ops, comp, w.compressor, inp, rows, *p.comp, eps, crope)
    cl = comp.layout
    visible = rows.get(("closed", cl.rate), lambda: cl.closed(pos))
    entry = rows.get(("entries", blocks.shape[-1] * cl.per_block), lambda: cl.table_entries(blocks))
    if ctx.is_csa:
        ikv, igate, iq, iw = p.index
        idx = layer.indexer
        compress_decode(ops, idx, w.indexer.compressor, inp, rows, ikv, igate, eps, crope)
        # [B, E]: each sequence's keys, read where they are stored (no gathered copy)
        keys = rows.get(("keys", idx.layout), lambda: idx.layout.entry_rows(blocks, entry))
        scores = ops.indexer_scores(iq, idx.store, iw, cfg.index_head_dim**-0.5, rows=keys)
        picks = ops.indexer_topk(scores, visible, cfg.index_topk)
        indices = torch.cat([indices, cl.picked_rows(blocks, picks)], dim=1)
    else:  # HCA: every closed entry, the same rows for every HCA layer of this geometry
        indices = rows.get(("hca", lay.window, cl), lambda: torch.cat([indices, cl.picked_rows(
            blocks, torch.where(entry < visible.view(-1, 1), entry, torch.full_like(entry, -1)))], dim=1))
    return ops.sparse_attention(p.q, layer.pool, indices, w.sinks, cfg.head_dim**-0.5)
