"""The CSA/HCA compressors and the lightning indexer's key compressor on the paged cache.

New tokens' projected kv and gate join the open-window buffer; every window of `rate` tokens that closes is
pooled into one entry (softmax over the window's slots per channel, with the learned position bias), normed,
and rotated with the compressed RoPE at the window's first-token position. With `overlap` (CSA and its
indexer), kv/gate carry two series per token: entry w pools the first series of window w-1 (kept as the
overlap state) and the second series of window w, 2*rate slots in all.

`compress_prefill` runs one sequence's chunk (any length); `compress_decode` runs one token for each of B
sequences with static shapes (CUDA-graph safe): it pools every row's buffer and writes the entry only where a
window closed (elsewhere to the scratch block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.runtime.cache import Compressor, SeqCache
from deepinfer.model.rollback import CompressorFeed
from deepinfer.model.weights import Compressor as CompressorWeights
from tilekernels import OpTable


@dataclass(frozen=True)
class RopeTables:
    """Inverse frequencies and cos/sin scale of one RoPE flavour."""

    inv_freq: torch.Tensor
    attention_factor: float


def _pool(ops: OpTable, w: CompressorWeights, slots_kv, slots_gate, positions, eps: float, rope: RopeTables):
    entries = ops.rms_norm(ops.compress_pool(slots_kv, slots_gate), w.kv_norm, eps)
    return ops.rope(entries, positions, rope.inv_freq, rope.attention_factor)


def compress_prefill(
    ops: OpTable, comp: Compressor, w: CompressorWeights, seq: SeqCache, t0: int, kv: torch.Tensor,
    gate: torch.Tensor, eps: float, rope: RopeTables,
) -> torch.Tensor:
    """Feed one sequence's new tokens (kv, gate [S, width], positions t0..t0+S-1); return all its entries [E, d]."""
    rate, slot, d = comp.rate, seq.slot, w.kv_norm.shape[0]
    fill, first_entry = t0 % rate, t0 // rate
    kv = torch.cat([comp.buf_kv[slot, :fill], kv], dim=0)
    gate = torch.cat([comp.buf_gate[slot, :fill], gate], dim=0)
    usable = (kv.shape[0] // rate) * rate
    left = kv.shape[0] - usable
    tentative = seq.undo is not None  # verifying drafts: the buffer and overlap are fed on commit (model.rollback)
    if tentative:
        seq.undo.append(CompressorFeed(comp, w.position_bias, slot, t0 - fill, kv, gate))
    else:
        comp.buf_kv[slot, :left] = kv[usable:]
        comp.buf_gate[slot, :left] = gate[usable:]
    blocks = torch.tensor(seq.blocks, dtype=torch.long, device=kv.device)
    if usable:
        n = usable // rate
        chunk_kv = kv[:usable].view(n, rate, -1)
        chunk_gate = gate[:usable].view(n, rate, -1) + w.position_bias
        if comp.overlap:
            slots_kv = chunk_kv.new_zeros((n, 2 * rate, d))
            slots_gate = chunk_gate.new_full((n, 2 * rate, d), float("-inf"))
            slots_kv[:, rate:] = chunk_kv[..., d:]
            slots_gate[:, rate:] = chunk_gate[..., d:]
            slots_kv[1:, :rate] = chunk_kv[:-1, :, :d]
            slots_gate[1:, :rate] = chunk_gate[:-1, :, :d]
            if first_entry > 0:  # the previous call closed a window: its first series is the overlap
                slots_kv[0, :rate] = comp.ov_kv[slot]
                slots_gate[0, :rate] = comp.ov_gate[slot]
            if not tentative:
                comp.ov_kv[slot] = chunk_kv[-1, :, :d]
                comp.ov_gate[slot] = chunk_gate[-1, :, :d]
            for boundary, snapshot in seq.take.items():  # exact prefix cache: the overlap at a block boundary
                j = boundary // rate - 1 - first_entry  # the window that ends there
                if 0 <= j < n:
                    comp.snap_kv[snapshot] = chunk_kv[j, :, :d]
                    comp.snap_gate[snapshot] = chunk_gate[j, :, :d]
        else:
            slots_kv, slots_gate = chunk_kv, chunk_gate
        new = torch.arange(first_entry, first_entry + n, device=kv.device)
        entries = _pool(ops, w, slots_kv, slots_gate, new * rate, eps, rope)
        rows = comp.layout.entry_rows(blocks, new)
        if (first_entry + 1) * rate <= seq.shared_until:  # windows a prefix hit shares: their entries are cached
            shared = (new + 1) * rate <= seq.shared_until
            rows = torch.where(shared, torch.full_like(rows, comp.layout.scratch_row), rows)
        comp.store[rows] = entries.to(comp.store.dtype)
    total = (t0 + kv.shape[0] - fill) // rate
    return comp.store[comp.layout.entry_rows(blocks, torch.arange(total, device=kv.device))]


def compress_decode(
    ops: OpTable, comp: Compressor, w: CompressorWeights, inp, rows, kv: torch.Tensor, gate: torch.Tensor,
    eps: float, rope: RopeTables,
) -> None:
    """One new token per row: kv/gate [B, width] at `inp.positions` [B] for sequences in `inp.slots` [B] whose block
    tables are `inp.blocks` [B, max_blocks] (`decode.DecodeInputs`); the row arithmetic shared through `rows`
    (`decode.StepRows`) with the step's other compressors. Static shapes throughout."""
    lay, d = comp.layout, w.kv_norm.shape[0]
    slots, positions, blocks = inp.slots, inp.positions, inp.blocks
    # the buffer place, whether a window closes, the entry that closes now (where one closes)
    at, closing, entry = rows.get(("closing", lay.rate), lambda: (
        lay.buffer_index(slots, positions), lay.closing(positions), lay.closing_entry(positions)))
    comp.buf_kv[at] = kv.to(comp.buf_kv.dtype)
    comp.buf_gate[at] = gate.to(comp.buf_gate.dtype)
    chunk_kv = comp.buf_kv[slots]  # [B, rate, width]
    chunk_gate = comp.buf_gate[slots] + w.position_bias
    if comp.overlap:
        has_prior = (entry > 0).view(-1, 1, 1)
        prior_gate = torch.where(has_prior, comp.ov_gate[slots], torch.full_like(comp.ov_gate[slots], float("-inf")))
        slots_kv = torch.cat([comp.ov_kv[slots], chunk_kv[..., d:]], dim=1)
        slots_gate = torch.cat([prior_gate, chunk_gate[..., d:]], dim=1)
        keep = closing.view(-1, 1, 1)
        comp.ov_kv[slots] = torch.where(keep, chunk_kv[..., :d], comp.ov_kv[slots])
        comp.ov_gate[slots] = torch.where(keep, chunk_gate[..., :d], comp.ov_gate[slots])
    else:
        slots_kv, slots_gate = chunk_kv, chunk_gate
    entries = _pool(ops, w, slots_kv, slots_gate, rows.get(("closing at", lay.rate), lambda: entry * lay.rate), eps,
                    rope)
    comp.store[rows.get(("close rows", lay), lambda: lay.close_rows(blocks, positions))] = entries.to(comp.store.dtype)
