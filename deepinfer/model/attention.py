"""The V4 attention block: projections and output over a flat token batch, and the attention core of a
prefill chunk (one sequence at a time, eager).

Each query attends, through one shared K=V head, over the KV rows it lists: its sliding window (the last
`sliding_window` positions, itself included) and, on CSA/HCA layers, the compressed entries it may see (all
closed ones for HCA; the indexer's top-k for CSA). The decode core (batched, static shapes) is in `decode.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.runtime.cache import LayerCache, SeqCache
from deepinfer.config import CSA, ModelConfig
from deepinfer.model.compressor import RopeTables, compress_prefill
from deepinfer.model.stacked import project_all
from deepinfer.model.weights import Attention
from tilekernels import OpTable


@dataclass(frozen=True)
class AttentionContext:
    cfg: ModelConfig
    ops: OpTable
    layer: int
    rope: RopeTables  # this layer's flavour (main for sliding layers, compress otherwise)
    compress_rope: RopeTables  # the compressors' and the indexer's flavour

    @property
    def is_csa(self) -> bool:
        return self.cfg.layer_types[self.layer] == CSA

    @property
    def index_scale(self) -> float:
        """The indexer scores' scale: dI^-0.5, times the nI^-0.5 its head weights take (one product, not a kernel)."""
        return self.cfg.index_head_dim**-0.5 * self.cfg.index_n_heads**-0.5


@dataclass(frozen=True)
class Projected:
    q: torch.Tensor  # [N, heads, D], normed and rotated
    kv: torch.Tensor  # [N, D], normed and rotated
    comp: tuple[torch.Tensor, torch.Tensor] | None  # compressor kv, gate [N, width]
    index: tuple[torch.Tensor, ...] | None  # indexer kv, gate [N, 2 dI], q [N, nI, dI], weights [N, nI] fp32 unscaled


def project(ctx: AttentionContext, w: Attention, x: torch.Tensor, pos: torch.Tensor) -> Projected:
    lin, q_res = project_inputs(ctx, w, x)
    return Projected(project_query(ctx, w, q_res, pos), *project_keys(ctx, w, lin, q_res, pos))


def project_inputs(ctx: AttentionContext, w: Attention, x: torch.Tensor) -> tuple[Callable, torch.Tensor]:
    """The projections of x: (a part's output by name and weight, the normed query latent)."""
    stacked = project_all(ctx.ops, x, w.inputs)  # the parts that share a stack: one GEMM for them all

    def lin(name: str, weight) -> torch.Tensor:
        return stacked[name] if name in stacked else ctx.ops.linear(x, weight)

    return lin, ctx.ops.rms_norm(lin("q_a", w.q_a_proj), w.q_a_norm, ctx.cfg.rms_norm_eps)


def project_query(ctx: AttentionContext, w: Attention, q_res: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The queries [N, heads, D], normed and rotated, from the query latent."""
    cfg, n = ctx.cfg, q_res.shape[0]
    q = ctx.ops.linear(q_res, w.q_b_proj).view(n, cfg.num_attention_heads, cfg.head_dim)
    # rotated in place: every rope input here is a fresh intermediate no one else reads (q normalised in the pass)
    return ctx.ops.rope(q, pos, ctx.rope.inv_freq, ctx.rope.attention_factor, inplace=True, norm_eps=cfg.rms_norm_eps)


def project_keys(ctx: AttentionContext, w: Attention, lin: Callable, q_res: torch.Tensor, pos: torch.Tensor) -> tuple:
    """`Projected`'s kv, comp and index (what the cache and the indexer take) from `project_inputs`."""
    cfg, ops, n, eps = ctx.cfg, ctx.ops, q_res.shape[0], ctx.cfg.rms_norm_eps
    kv = ops.rms_norm(lin("kv", w.kv_proj), w.kv_norm, eps)
    kv = ops.rope(kv, pos, ctx.rope.inv_freq, ctx.rope.attention_factor, inplace=True)
    comp = index = None
    if w.compressor is not None:
        comp = (lin("comp_kv", w.compressor.kv_proj), lin("comp_gate", w.compressor.gate_proj))
    if w.indexer is not None:
        ix = w.indexer
        iq = ops.linear(q_res, ix.q_b_proj).view(n, cfg.index_n_heads, cfg.index_head_dim)
        iq = ops.rope(iq, pos, ctx.compress_rope.inv_freq, ctx.compress_rope.attention_factor, inplace=True)
        iw = lin("index_weights", ix.weights_proj).float()  # its nI^-0.5 is in `index_scale`
        index = (lin("index_kv", ix.compressor.kv_proj), lin("index_gate", ix.compressor.gate_proj), iq, iw)
    return kv, comp, index


def finish(ctx: AttentionContext, w: Attention, out: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Undo the value half's rotation, then the grouped output projection: [N, heads, D] -> [N, H]."""
    return output_projection(ctx.ops, out, pos, ctx.rope, ctx.cfg.o_groups, w.o_a_proj, w.o_b_proj)


def output_projection(ops: OpTable, out: torch.Tensor, pos: torch.Tensor, rope: RopeTables, groups: int, o_a,
                      o_b) -> torch.Tensor:
    """V4 and V4.1: inverse RoPE at the query positions (in place: `out` is the attention's fresh output), then `o_a`
    per head group and `o_b`: [N, heads, D] -> [N, H]."""
    n = out.shape[0]
    out = ops.rope(out, pos, rope.inv_freq, rope.attention_factor, inverse=True, inplace=True)
    grouped = ops.grouped_linear(out.reshape(n, groups, -1), o_a)
    return ops.linear(grouped.reshape(n, -1), o_b)


def prefill_core(ctx: AttentionContext, w: Attention, p: Projected, pos: torch.Tensor,
                 seqs: list[tuple[SeqCache, int, int]], layer: LayerCache) -> torch.Tensor:
    """Attention of prefill chunks: `seqs` lists (sequence, first row, rows); -> [N, heads, D]."""
    if len(seqs) == 1 and seqs[0][1] == 0 and seqs[0][2] == p.q.shape[0]:  # one sequence: its output, no copy
        seq, _, _ = seqs[0]
        pool, indices = _chunk_rows(ctx, w, p, slice(0, p.q.shape[0]), seq, layer)
        return ctx.ops.sparse_attention(p.q, pool, indices, w.sinks, ctx.cfg.head_dim**-0.5)
    out = torch.empty_like(p.q)
    for seq, start, length in seqs:
        rows = slice(start, start + length)
        pool, indices = _chunk_rows(ctx, w, p, rows, seq, layer)
        out[rows] = ctx.ops.sparse_attention(p.q[rows], pool, indices, w.sinks, ctx.cfg.head_dim**-0.5)
    return out


def _chunk_rows(ctx, w, p: Projected, rows: slice, seq: SeqCache, layer: LayerCache):
    """Update one sequence's state with its chunk; return the KV pool and each query's row list."""
    cfg, ops, lay = ctx.cfg, ctx.ops, layer.layout
    window, t0 = cfg.sliding_window, seq.num_tokens
    kv = p.kv[rows]
    n = kv.shape[0]
    # the slot's ring holds positions from seq.window_start on (0, or where a prefix hit's window begins)
    past_pos = torch.arange(max(seq.window_start, t0 - (window - 1)), t0, device=kv.device)
    full = torch.cat([layer.pool[lay.window_rows(seq.slot, past_pos)], kv], dim=0)
    keep = torch.arange(max(t0, t0 + n - window), t0 + n, device=kv.device)
    layer.pool[lay.window_rows(seq.slot, keep)] = kv[keep - t0].to(layer.pool.dtype)
    # Window rows of `full` (not of the cache): query at position q sees q-W+1 .. q; row of position x is
    # x - first, where first = t0 - len(past).
    pos = torch.arange(t0, t0 + n, device=kv.device)
    first = t0 - past_pos.numel()
    # int32 lists (the attention kernel's index type: no conversion of [n, K] lists later); any row before `full`'s
    # first (negative) is -1
    win_rows = (torch.arange(t0 - first, t0 - first + n, dtype=torch.int32, device=kv.device).view(-1, 1)
                + torch.arange(-window + 1, 1, dtype=torch.int32, device=kv.device).view(1, -1)).clamp_(min=-1)
    for boundary, snapshot in seq.take.items():  # exact prefix cache: the window as it is at a block boundary
        if t0 < boundary <= t0 + n:
            at = (torch.arange(boundary - window, boundary, device=kv.device) - first).clamp(min=0)
            layer.snap_ring[snapshot] = full[at].to(layer.snap_ring.dtype)
    if p.comp is None:
        return full, win_rows
    eps, crope = cfg.rms_norm_eps, ctx.compress_rope
    comp = layer.compressor
    entries = compress_prefill(ops, comp, w.compressor, seq, t0, p.comp[0][rows], p.comp[1][rows], eps, crope)
    visible = comp.layout.closed(pos)  # entries e < visible[s] are closed windows query s may see
    if ctx.is_csa:
        ikv, igate, iq, iw = (t[rows] for t in p.index)
        keys = compress_prefill(ops, layer.indexer, w.indexer.compressor, seq, t0, ikv, igate, eps, crope)
        scores = ops.indexer_scores(iq, keys, iw, ctx.index_scale)
        picks = ops.indexer_topk(scores, visible, cfg.index_topk)
    else:
        entry = torch.arange(entries.shape[0], device=kv.device).view(1, -1)
        picks = torch.where(entry < visible.view(-1, 1), entry, torch.full_like(entry, -1))
    comp_rows = torch.where(picks >= 0, picks.to(torch.int32) + full.shape[0], -1)
    return torch.cat([full, entries.to(full.dtype)], dim=0), torch.cat([win_rows, comp_rows], dim=1)
