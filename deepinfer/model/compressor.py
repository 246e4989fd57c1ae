"""The CSA/HCA compressors and the lightning indexer's key compressor on the paged cache.

New tokens' projected kv and gate go into the slot's buffer ring (a position's row at `position % buffer_rows`);
every window of `rate` tokens that closes is pooled into one entry (softmax over the window's slots per
channel, with the learned position bias), normed, and rotated with the compressed RoPE at the window's
first-token position. With `overlap` (CSA and its indexer), kv/gate carry two series per token: entry w pools
the first series of window w-1 (still in the ring) and the second series of window w, 2*rate slots in all.

`compress_prefill` runs one sequence's chunk (any length); `compress_decode` runs one token per row with static
shapes (CUDA-graph safe; several rows may belong to one sequence, at consecutive positions: a verify step): it
pools every row's window, straight from the ring where the window is short (`compress_ring`: CSA and its indexer,
no gathered copies), and writes the entry only where a window closed (elsewhere to the scratch block).
The ring holds `lookahead` rows more than the windows need, so rows a step writes past the positions its
sequence keeps (rejected draft tokens) overwrite nothing a later step reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.runtime.cache import Compressor, SeqCache
from deepinfer.runtime.cache_layout import CompressorLayout
from deepinfer.model.step_rows import StepRows
from deepinfer.model.weights import Compressor as CompressorWeights
from tilekernels import OpTable
from tilekernels.ops import compress_ring


@dataclass(frozen=True)
class RopeTables:
    """Inverse frequencies and cos/sin scale of one RoPE flavour."""

    inv_freq: torch.Tensor
    attention_factor: float


def _finish(ops: OpTable, w: CompressorWeights, pooled: torch.Tensor, positions, eps: float, rope: RopeTables):
    """Pooled entries normed and rotated at their windows' first positions."""
    return ops.rope(ops.rms_norm(pooled, w.kv_norm, eps), positions, rope.inv_freq, rope.attention_factor)


def compress_prefill(
    ops: OpTable, comp: Compressor, w: CompressorWeights, seq: SeqCache, t0: int, kv: torch.Tensor,
    gate: torch.Tensor, eps: float, rope: RopeTables,
) -> torch.Tensor:
    """Feed one sequence's new tokens (kv, gate [S, width], positions t0..t0+S-1); return all its entries [E, d]."""
    rate, slot, d, n_new = comp.rate, seq.slot, w.kv_norm.shape[0], kv.shape[0]
    first_entry = t0 // rate
    # the rows the pooling reads from the ring: the open window's, and with overlap the last closed window's
    start = max(first_entry - int(comp.overlap), 0) * rate
    if start < t0:  # positions start .. t0 + S - 1 (a first chunk's rows are all new: no copy)
        old = torch.arange(start, t0, device=kv.device)
        kv = torch.cat([comp.buf_kv[slot, comp.rows(old)], kv], dim=0)
        gate = torch.cat([comp.buf_gate[slot, comp.rows(old)], gate], dim=0)
    new = torch.arange(max(t0, t0 + n_new - comp.layout.buffer_rows), t0 + n_new, device=kv.device)
    comp.buf_kv[slot, comp.rows(new)] = kv[new - start]
    comp.buf_gate[slot, comp.rows(new)] = gate[new - start]
    blocks = torch.tensor(seq.blocks, dtype=torch.long, device=kv.device)
    total = (t0 + n_new) // rate  # entries closed once the chunk is in
    n = total - first_entry
    if n > 0:
        base = first_entry * rate - start  # row of the first closing window's first position
        if comp.overlap:
            # window w's slots: window w-1's first series (none before window 0: zeros, -inf gates), then its own
            # second series; the windows from the first one's prior on, biased once, joined by one cat each
            skip = 1 if first_entry == 0 else 0
            lo = base - (1 - skip) * rate
            ext_kv = kv[lo : base + n * rate].view(n + 1 - skip, rate, -1)
            ext_gate = gate[lo : base + n * rate].view(n + 1 - skip, rate, -1) + w.position_bias
            prior_kv, prior_gate = ext_kv[:-1, :, :d], ext_gate[:-1, :, :d]
            if skip:
                prior_kv = torch.nn.functional.pad(prior_kv, (0, 0, 0, 0, 1, 0))
                prior_gate = torch.nn.functional.pad(prior_gate, (0, 0, 0, 0, 1, 0), value=float("-inf"))
            slots_kv = torch.cat([prior_kv, ext_kv[1 - skip:, :, d:]], dim=1)
            slots_gate = torch.cat([prior_gate, ext_gate[1 - skip:, :, d:]], dim=1)
        else:
            slots_kv = kv[base : base + n * rate].view(n, rate, -1)
            slots_gate = gate[base : base + n * rate].view(n, rate, -1) + w.position_bias
        entries = torch.arange(first_entry, total, device=kv.device)
        pooled = _finish(ops, w, ops.compress_pool(slots_kv, slots_gate), entries * rate, eps, rope)
        rows = comp.layout.entry_rows(blocks, entries)
        if (first_entry + 1) * rate <= seq.shared_until:  # windows a prefix hit shares: their entries are cached
            shared = (entries + 1) * rate <= seq.shared_until
            rows = torch.where(shared, torch.full_like(rows, comp.layout.scratch_row), rows)
        comp.store[rows] = pooled.to(comp.store.dtype)
    if comp.overlap:
        for boundary, snapshot in seq.take.items():  # exact prefix cache: the window that closes at a boundary
            if t0 < boundary <= t0 + n_new:
                comp.snap_kv[snapshot] = kv[boundary - rate - start : boundary - start]
                comp.snap_gate[snapshot] = gate[boundary - rate - start : boundary - start]
    return comp.store[comp.layout.entry_rows(blocks, torch.arange(total, device=kv.device))]


def _gathered(comp: Compressor, w: CompressorWeights, owner, ring_rows, entry, rows):
    """The slots of each row's window, kv and biased gate [B, S, d] (with overlap: the prior window's first series,
    -inf gates where no window is before it, then the window's second series). `compress_ring.reference` gathers
    the same for any slot list; here only the prior series can be empty, so HCA's windows need no clamp or mask."""
    rate, ring, d = comp.rate, comp.layout.buffer_rows, w.kv_norm.shape[0]
    chunk_kv = comp.buf_kv[owner, ring_rows]  # [B, rate, width]
    chunk_gate = comp.buf_gate[owner, ring_rows] + w.position_bias
    if not comp.overlap:
        return chunk_kv, chunk_gate
    before, first = rows.get(("before", rate, ring), lambda: ((ring_rows - rate) % ring, (entry == 0).view(-1, 1, 1)))
    prior_gate = (comp.buf_gate[owner, before][..., :d] + w.position_bias[:, :d]).masked_fill_(first, float("-inf"))
    return (torch.cat([comp.buf_kv[owner, before][..., :d], chunk_kv[..., d:]], dim=1),
            torch.cat([prior_gate, chunk_gate[..., d:]], dim=1))


def ring_kernel(lay: CompressorLayout) -> bool:
    """Whether a decode step pools the compressor's window with the ring kernel (CSA and its indexer), not from a
    gathered copy (HCA's long windows)."""
    return (2 if lay.overlap else 1) * lay.rate <= compress_ring.GATHER_SLOTS


def compress_decode(
    ops: OpTable, comp: Compressor, w: CompressorWeights, rows: StepRows, kv: torch.Tensor, gate: torch.Tensor,
    eps: float, rope: RopeTables,
) -> None:
    """One new token per row: kv/gate [B, width] at the step's positions [B] for its slots [B] (block tables [B,
    max_blocks]), the row arithmetic shared through `rows` with the step's other compressors. Static shapes
    throughout; rows of one sequence write their buffer rows before any row pools."""
    lay = comp.layout
    slots, positions = rows.slots, rows.positions
    rate, ring = lay.rate, lay.buffer_rows
    entry = rows.closing_entry(rate)  # the entry that closes now (where one closes)
    # the buffer place (a row of the rings seen as [slots * ring, width]) and the ring rows of the row's window: made
    # once per step for every compressor of this geometry; the writes are index_copy_ (~0.5 us under index_put_ each)
    at, ring_rows = rows.get(("ring", rate, ring), lambda: (
        lay.buffer_row(slots, positions),
        ((positions // rate * rate).view(-1, 1) + torch.arange(rate, device=positions.device).view(1, -1)) % ring))
    comp.buf_kv.view(-1, comp.buf_kv.shape[-1]).index_copy_(0, at, kv.to(comp.buf_kv.dtype))
    comp.buf_gate.view(-1, comp.buf_gate.shape[-1]).index_copy_(0, at, gate.to(comp.buf_gate.dtype))
    if ring_kernel(lay):
        owner = rows.get(("owner",), lambda: slots.to(torch.int32))
        if comp.overlap:  # the prior window's ring rows first (-1: no window before the first), then the window's own
            slot_rows = rows.get(("overlap rows", rate, ring), lambda: torch.cat(
                [torch.where(entry.view(-1, 1) == 0, -1, (ring_rows - rate) % ring), ring_rows], dim=1).to(torch.int32))
        else:
            slot_rows = rows.get(("window rows", rate, ring), lambda: ring_rows.to(torch.int32))
        pooled = ops.compress_ring(comp.buf_kv, comp.buf_gate, w.position_bias, owner, slot_rows)
    else:  # long windows (HCA): gathered by PyTorch, then pooled (compress_pool stages a window with one 2D copy)
        pooled = ops.compress_pool(*_gathered(comp, w, slots.view(-1, 1), ring_rows, entry, rows))
    # the first position of the closing window, in RoPE's position type (the host makes it so: no cast in the op)
    at_pos = rows.get(("closing at", rate), lambda: (entry * rate).to(torch.int32))
    entries = _finish(ops, w, pooled, at_pos, eps, rope)
    comp.store.index_copy_(0, rows.close_rows(lay), entries.to(comp.store.dtype))
