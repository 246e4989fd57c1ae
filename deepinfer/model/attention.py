"""The V4 attention block over a flat batch of tokens from one or more sequences.

Projections run over the whole batch; the stateful part (window update, compressors, indexer top-k and the
attention core) runs per sequence. Each query attends, through one shared K=V head, over the KV rows it
lists: its sliding window (the last `sliding_window` positions, itself included) and, on CSA/HCA layers, the
compressed entries it may see (all causal ones for HCA; the indexer's top-k for CSA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.config import CSA, ModelConfig
from deepinfer.model.compressor import compress
from deepinfer.model.state import ForwardBatch, LayerState
from deepinfer.model.weights import Attention
from tilekernels import OpTable


@dataclass(frozen=True)
class RopeTables:
    """Inverse frequencies and cos/sin scale of the RoPE flavour a layer uses."""

    inv_freq: torch.Tensor
    attention_factor: float


@dataclass(frozen=True)
class AttentionContext:
    cfg: ModelConfig
    ops: OpTable
    layer: int
    rope: RopeTables  # this layer's flavour (main for sliding layers, compress otherwise)
    compress_rope: RopeTables  # the compressors' and the indexer's flavour


def attention_block(ctx: AttentionContext, w: Attention, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """x [N, H] (already input-normed) -> [N, H]."""
    cfg, ops = ctx.cfg, ctx.ops
    n, eps = x.shape[0], cfg.rms_norm_eps
    pos = batch.positions
    q_res = ops.rms_norm(ops.linear(x, w.q_a_proj), w.q_a_norm, eps)
    q = ops.linear(q_res, w.q_b_proj).view(n, cfg.num_attention_heads, cfg.head_dim)
    q = ops.rope(ops.rms_norm_unweighted(q, eps), pos, ctx.rope.inv_freq, ctx.rope.attention_factor)
    kv = ops.rms_norm(ops.linear(x, w.kv_proj), w.kv_norm, eps)
    kv = ops.rope(kv, pos, ctx.rope.inv_freq, ctx.rope.attention_factor)

    comp_kv = comp_gate = None
    if w.compressor is not None:
        comp_kv, comp_gate = ops.linear(x, w.compressor.kv_proj), ops.linear(x, w.compressor.gate_proj)
    idx_inputs = None
    if w.indexer is not None:
        ix = w.indexer
        iq = ops.linear(q_res, ix.q_b_proj).view(n, cfg.index_n_heads, cfg.index_head_dim)
        iq = ops.rope(iq, pos, ctx.compress_rope.inv_freq, ctx.compress_rope.attention_factor)
        iw = ops.linear(x, ix.weights_proj).float() * cfg.index_n_heads**-0.5
        idx_inputs = (ops.linear(x, ix.compressor.kv_proj), ops.linear(x, ix.compressor.gate_proj), iq, iw)

    out = torch.empty_like(q)
    for seq in batch.seqs:
        rows = seq.rows
        state = seq.state.layers[ctx.layer]
        seq_idx = None if idx_inputs is None else tuple(t[rows] for t in idx_inputs)
        pool, indices = _kv_rows(
            ctx, w, state, kv[rows], pos[rows],
            None if comp_kv is None else (comp_kv[rows], comp_gate[rows]),
            seq_idx,
        )
        out[rows] = ops.sparse_attention(q[rows], pool, indices, w.sinks, cfg.head_dim**-0.5)

    out = ops.rope(out, pos, ctx.rope.inv_freq, ctx.rope.attention_factor, inverse=True)
    grouped = ops.grouped_linear(out.view(n, cfg.o_groups, cfg.group_in_dim), w.o_a_proj)
    return ops.linear(grouped.reshape(n, -1), w.o_b_proj)


def _kv_rows(ctx, w, state: LayerState, kv, pos, comp_inputs, idx_inputs):
    """Update one sequence's layer state with its new tokens; return the KV pool and per-query row lists."""
    cfg, ops = ctx.cfg, ctx.ops
    window = cfg.sliding_window
    past = 0 if state.window is None else state.window.shape[0]
    full = kv if past == 0 else torch.cat([state.window, kv], dim=0)
    state.window = full[-(window - 1) :] if window > 1 else full[:0]
    # Window rows: query at position p sees positions p-W+1 .. p; pool row of position q is q - (pos0 - past).
    first = pos[0] - past
    offsets = torch.arange(-window + 1, 1, device=kv.device)
    win_pos = pos.view(-1, 1) + offsets.view(1, -1)
    win_rows = torch.where(win_pos >= 0, win_pos - first, torch.full_like(win_pos, -1))
    if comp_inputs is None:
        return full, win_rows

    layer, eps = ctx.layer, cfg.rms_norm_eps
    rate = cfg.compress_rate(layer)
    is_csa = cfg.layer_types[layer] == CSA
    crope = ctx.compress_rope
    entries = compress(
        ops, state.compressor, w.compressor, *comp_inputs,
        rate=rate, overlap=is_csa, eps=eps, inv_freq=crope.inv_freq, attention_factor=crope.attention_factor,
    )
    visible = (pos + 1) // rate  # entries e < visible[s] are closed windows query s may see
    n_entries = entries.shape[0]
    if is_csa:
        ikv, igate, iq, iw = idx_inputs
        keys = compress(
            ops, state.indexer, w.indexer.compressor, ikv, igate,
            rate=rate, overlap=True, eps=eps, inv_freq=crope.inv_freq, attention_factor=crope.attention_factor,
        )
        scores = ops.indexer_scores(iq, keys, iw, cfg.index_head_dim**-0.5)
        picks = ops.indexer_topk(scores, visible, cfg.index_topk)
    else:
        entry = torch.arange(n_entries, device=kv.device).view(1, -1)
        picks = torch.where(entry < visible.view(-1, 1), entry, torch.full_like(entry, -1))
    comp_rows = torch.where(picks >= 0, picks + full.shape[0], torch.full_like(picks, -1))
    pool = torch.cat([full, entries.to(full.dtype)], dim=0)
    return pool, torch.cat([win_rows, comp_rows], dim=1)
