"""Tentative steps: the bounded slot state a step writes for positions that may be rejected, kept undoable.

Verifying draft tokens runs them as a prefill chunk; which of them stay is known only afterwards. What such a
chunk writes into the paged cache splits in two:
- compressed entries and indexer keys, written to the sequence's blocks: an entry is read only once its window
  has closed within the sequence's token count, and a window closed by rejected tokens is pooled again (and its
  rows written again) when the tokens that really close it arrive, so nothing needs undoing;
- the slot's bounded state, which later steps read whatever the count says: the sliding-window ring (a row of
  position p overwrites the row of p - W, which the window still needs if p is rejected) and each compressor's
  open-window buffer and CSA overlap. Ring writes record the rows they overwrite (`RingWrite`); compressor state
  is not written at all but fed on commit up to the kept position (`CompressorFeed`).

`commit(seq, end)` keeps positions before `end`: it restores the ring rows of later positions, feeds the
compressors, and sets the sequence's token count to `end`. The cache is then what a step that had never seen
the rejected tokens would have left (tests/test_speculative_cache.py compares the two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.runtime.cache import Compressor, SeqCache


@dataclass(frozen=True)
class RingWrite:
    """Ring rows a tentative chunk wrote: the positions written, their pool rows, and what those rows held."""

    pool: torch.Tensor
    positions: torch.Tensor  # [n]
    rows: torch.Tensor  # [n]
    before: torch.Tensor  # [n, D]

    def keep(self, end: int) -> None:
        rejected = self.positions >= end
        self.pool[self.rows[rejected]] = self.before[rejected]


@dataclass(frozen=True)
class CompressorFeed:
    """A compressor's inputs from the start of its open window (`first`, a multiple of the rate) through the
    tentative chunk: kv and gate without the position bias, fed into its buffer (and overlap) on commit."""

    comp: Compressor
    position_bias: torch.Tensor  # [rate, width]
    slot: int
    first: int
    kv: torch.Tensor  # [n, width]
    gate: torch.Tensor  # [n, width]

    def keep(self, end: int) -> None:
        comp, rate = self.comp, self.comp.rate
        total = end - self.first
        closed = (total // rate) * rate
        comp.buf_kv[self.slot, : total - closed] = self.kv[closed:total]
        comp.buf_gate[self.slot, : total - closed] = self.gate[closed:total]
        if comp.overlap and closed:  # the last window closed before `end`: its first series is the overlap
            d = comp.layout.dim
            comp.ov_kv[self.slot] = self.kv[closed - rate : closed, :d]
            comp.ov_gate[self.slot] = self.gate[closed - rate : closed, :d] + self.position_bias[:, :d]


def record_ring(seq: SeqCache, pool: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
    """Before a tentative chunk writes `rows` (positions `positions`) of a ring: remember what they hold."""
    seq.undo.append(RingWrite(pool, positions, rows, pool[rows].clone()))


def commit(seq: SeqCache, end: int) -> None:
    """Keep a tentative step's positions before `end` (at least where the step began); forget the rest."""
    if seq.undo is None:
        raise AssertionError(f"slot {seq.slot} has no tentative step to commit")
    for write in seq.undo:
        write.keep(end)
    seq.undo = None
    seq.num_tokens = end
