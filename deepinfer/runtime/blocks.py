"""Slot and block accounting, shared by every model's cache: which sequence holds which slot and which blocks.

A sequence holds one slot (its bounded state) and a list of blocks (`block_tokens` positions each) covering its
positions. The scheduler admits, grows, preempts and releases through this class only; what a slot or a block
physically holds is the subclass's business (V4's `PagedCache`, V4.1's `V41SlotCache`: paged tensors).

A subclass whose steps find blocks on the device sets `tables` ([slots + 1, max_blocks_per_seq] int64): a slot's
row lists its sequence's blocks, written as the sequence grows (one small copy per new block) and reset to the
scratch block on release, so a step reads it in place instead of a table built on the host each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.errors import RequestError
from deepinfer.runtime.cache_layout import CacheSpec
from deepinfer.runtime.staging import upload


@dataclass
class SeqCache:
    """One sequence's share of the cache: its slot, its blocks, and how many positions it holds."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class SlotBlocks:
    """Free lists of slots and blocks for a `CacheSpec`; slot `max_seqs` and block `num_blocks` are scratch."""

    tables: torch.Tensor | None = None

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self._free_slots = list(range(spec.max_seqs - 1, -1, -1))
        self._free_blocks = list(range(spec.num_blocks - 1, -1, -1))

    @property
    def scratch_slot(self) -> int:
        return self.spec.max_seqs

    @property
    def scratch_block(self) -> int:
        return self.spec.num_blocks

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def used_blocks(self) -> int:
        return self.spec.num_blocks - len(self._free_blocks)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.spec.block_tokens)

    def check_fits(self, tokens: int, what: str) -> None:
        """Raise RequestError for a request that could never be served, whatever else runs."""
        need = self.blocks_for(tokens)
        if tokens > self.spec.max_tokens or need > self.spec.num_blocks:
            limit = min(self.spec.max_tokens, self.spec.num_blocks * self.spec.block_tokens)
            raise RequestError(f"{what} needs {tokens} positions, more than this cache can ever hold ({limit}: "
                               f"{self.spec.num_blocks} blocks of {self.spec.block_tokens} positions, at most "
                               f"{self.spec.max_blocks_per_seq} per sequence); raise the cache size or shorten it")

    def admit(self) -> SeqCache | None:
        """A slot for a new sequence, or None when every slot is taken."""
        if not self._free_slots:
            return None
        return SeqCache(slot=self._free_slots.pop())

    def grow(self, seq: SeqCache, tokens: int) -> bool:
        """Give `seq` the blocks to hold `tokens` positions; False (and nothing taken) if they are not free."""
        need = self.blocks_for(tokens) - len(seq.blocks)
        if need <= 0:
            return True
        if need > len(self._free_blocks) or self.blocks_for(tokens) > self.spec.max_blocks_per_seq:
            return False
        held = len(seq.blocks)
        seq.blocks.extend(self._free_blocks.pop() for _ in range(need))
        if self.tables is not None:  # the new blocks enter the slot's table row
            new = torch.tensor(seq.blocks[held:], dtype=torch.long)
            self.tables[seq.slot, held: len(seq.blocks)] = upload(new, self.tables.device)
        return True

    def check_held(self, seq: SeqCache, new_tokens: int) -> None:
        """A sequence's blocks cover the positions a step writes (else its writes would land in the scratch
        block): the scheduler grows before it schedules."""
        if len(seq.blocks) * self.spec.block_tokens < seq.num_tokens + new_tokens:
            raise AssertionError(f"slot {seq.slot} holds {len(seq.blocks)} blocks of {self.spec.block_tokens} "
                                 f"positions, fewer than its {seq.num_tokens} + {new_tokens} tokens")

    def release(self, seq: SeqCache) -> None:
        """Return a sequence's slot and blocks (its slot state is reset on its next admission)."""
        if self.tables is not None:
            self.tables[seq.slot] = self.scratch_block  # no stale blocks in a free slot's row
        self._free_blocks.extend(reversed(seq.blocks))
        seq.blocks = []
        self._free_slots.append(seq.slot)
        seq.slot = -1
