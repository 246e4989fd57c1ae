"""The CSA/HCA compressors and the lightning indexer's key compressor, for one sequence at a time.

New tokens' projected kv and gate join the buffer of the open window; every window of `rate` tokens that
closes is pooled into one entry (softmax over the window's slots per channel, with the learned position
bias), normed, and rotated with the compressed RoPE at the window's first-token position.
With `overlap` (CSA and its indexer), kv/gate carry two series per token: entry w pools the first series of
window w-1 and the second series of window w, 2*rate slots in all.
"""

from __future__ import annotations

import torch

from deepinfer.model.state import CompressorState
from deepinfer.model.weights import Compressor
from tilekernels import OpTable


def _cat(prev: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if prev is None or prev.shape[0] == 0 else torch.cat([prev, new], dim=0)


def compress(
    ops: OpTable,
    state: CompressorState,
    weights: Compressor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    *,
    rate: int,
    overlap: bool,
    eps: float,
    inv_freq: torch.Tensor,
    attention_factor: float,
) -> torch.Tensor:
    """Feed one sequence's new tokens (kv, gate [S, width]) and return all its entries so far [E, d]."""
    first_position = state.entry_count * rate
    kv, gate = _cat(state.buffer_kv, kv), _cat(state.buffer_gate, gate)
    usable = (kv.shape[0] // rate) * rate
    state.buffer_kv, state.buffer_gate = kv[usable:], gate[usable:]
    d = weights.kv_norm.shape[0]
    if usable:
        n_windows = usable // rate
        chunk_kv = kv[:usable].view(n_windows, rate, -1)
        chunk_gate = gate[:usable].view(n_windows, rate, -1) + weights.position_bias
        if overlap:
            slots_kv = chunk_kv.new_zeros((n_windows, 2 * rate, d))
            slots_gate = chunk_gate.new_full((n_windows, 2 * rate, d), float("-inf"))
            slots_kv[:, rate:] = chunk_kv[..., d:]
            slots_gate[:, rate:] = chunk_gate[..., d:]
            slots_kv[1:, :rate] = chunk_kv[:-1, :, :d]
            slots_gate[1:, :rate] = chunk_gate[:-1, :, :d]
            if state.overlap_kv is not None:
                slots_kv[0, :rate] = state.overlap_kv.to(slots_kv.dtype)
                slots_gate[0, :rate] = state.overlap_gate.to(slots_gate.dtype)
            state.overlap_kv = chunk_kv[-1, :, :d].clone()
            state.overlap_gate = chunk_gate[-1, :, :d].clone()
        else:
            slots_kv, slots_gate = chunk_kv, chunk_gate
        entries = ops.rms_norm(ops.compress_pool(slots_kv, slots_gate), weights.kv_norm, eps)
        positions = torch.arange(n_windows, device=kv.device) * rate + first_position
        entries = ops.rope(entries, positions, inv_freq, attention_factor)
        state.entries = _cat(state.entries, entries)
        state.entry_count += n_windows
    if state.entries is None:
        state.entries = kv.new_zeros((0, d))
    return state.entries
