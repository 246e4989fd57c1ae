"""Slot and block accounting, shared by every model's cache: which sequence holds which slot and which blocks.

A sequence holds one slot (its bounded state) and a list of blocks (`block_tokens` positions each) covering its
positions. The scheduler admits, grows, preempts and releases through this class only; what a slot or a block
physically holds is the subclass's business (V4's `PagedCache`, V4.1's `V41SlotCache`: paged tensors).

A subclass whose steps find blocks on the device sets `tables` ([slots + 1, max_blocks_per_seq] int64): a slot's
row lists its sequence's blocks, written as the sequence grows (one small copy per new block) and reset to the
scratch block on release, so a step reads it in place instead of a table built on the host each step.

With a prefix cache (`enable_prefix`, `runtime/prefix.py`), blocks are shared: a new sequence starts on the cached
blocks of its longest cached prefix (`lookup`, `start`), full blocks are published as they fill (`publish`), a
released sequence's published blocks stay cached until their memory is needed (`free_blocks` counts them), and
the sequence resumes at the hit with its sliding window restored (exact mode: from a snapshot) or rebuilt by
prefilling the last tokens again (approximate mode: `shared_until` keeps those tokens' compressed entries, which
the cache already holds, from being written again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.errors import RequestError
from deepinfer.runtime.cache_layout import CacheSpec
from deepinfer.runtime.prefix import Hit, PrefixIndex, PrefixMode, block_names
from deepinfer.runtime.staging import upload


@dataclass
class SeqCache:
    """One sequence's share of the cache: its slot, its blocks, and how many positions it holds."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    window_start: int = 0  # the first position whose sliding-window KV the slot holds
    shared_until: int = 0  # positions before it lie in cached blocks: prefill does not write their entries again
    names: list[bytes] = field(default_factory=list)  # names of its first full blocks (prefix cache)
    wanted: list[int] = field(default_factory=list)  # boundaries to snapshot while prefilling (exact mode)
    take: dict[int, int] = field(default_factory=dict)  # boundary -> snapshot the next step writes
    pending: dict[int, int] = field(default_factory=dict)  # boundary -> snapshot written, not yet attached
    begun: bool = False  # put on its cached prefix (`SlotBlocks.start`) when its first prefill chunk was scheduled
    resume: int = 0  # the position its prefill began at (the hit, or an approximate hit's replay start)
    draft: SeqCache | None = None  # the draft layers' share of the slot (speculative decoding): their own count


class SlotBlocks:
    """Free lists of slots and blocks for a `CacheSpec`; slot `max_seqs` and block `num_blocks` are scratch."""

    tables: torch.Tensor | None = None
    window = 0  # the model's sliding window (a subclass with a prefix cache sets it)

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self._free_slots = list(range(spec.max_seqs - 1, -1, -1))
        self._free_blocks = list(range(spec.num_blocks - 1, -1, -1))
        self.prefix: PrefixIndex | None = None
        self.prefix_mode = PrefixMode("off")

    def enable_prefix(self, mode: PrefixMode, salt: bytes) -> None:
        """Turn the prefix cache on (a cache that has not served anything yet)."""
        if mode.mode == "off":
            return
        if mode.mode == "exact" and not self.spec.snapshots:
            raise AssertionError("exact prefix caching needs a cache with snapshots (CacheSpec.snapshots)")
        self.prefix_mode = mode
        self.prefix = PrefixIndex(self.spec.num_blocks, self.spec.block_tokens, salt, self.spec.snapshots)

    @property
    def scratch_slot(self) -> int:
        return self.spec.max_seqs

    @property
    def scratch_block(self) -> int:
        return self.spec.num_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence may take: free ones and cached ones nobody references."""
        return len(self._free_blocks) + (len(self.prefix.idle) if self.prefix is not None else 0)

    @property
    def unused_blocks(self) -> int:
        """Blocks no sequence references and no cached prefix holds (taking one evicts nothing)."""
        return len(self._free_blocks)

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence references."""
        return self.spec.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Published blocks (referenced or not)."""
        return 0 if self.prefix is None else len(self.prefix.name_of)

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
        if need > self.free_blocks or self.blocks_for(tokens) > self.spec.max_blocks_per_seq:
            return False
        held = len(seq.blocks)
        seq.blocks.extend(self._take_block() for _ in range(need))
        self._write_table(seq, held)
        return True

    def _take_block(self) -> int:
        block = self._free_blocks.pop() if self._free_blocks else self.prefix.evict()
        if self.prefix is not None:
            self.prefix.take(block)
        return block

    def _write_table(self, seq: SeqCache, held: int) -> None:
        if self.tables is not None and len(seq.blocks) > held:  # the new blocks enter the slot's table row
            new = torch.tensor(seq.blocks[held:], dtype=torch.long)
            self.tables[seq.slot, held: len(seq.blocks)] = upload(new, self.tables.device)

    # ---- prefix cache ----
    def names_of(self, tokens: list[int]) -> list[bytes]:
        """The names of the blocks a new sequence over `tokens` (what prefill must put in the cache) may skip:
        whole blocks, leaving at least one token to prefill (its logits give the first token)."""
        if self.prefix is None or len(tokens) <= self.spec.block_tokens:
            return []
        return block_names(tokens[: len(tokens) - 1], self.spec.block_tokens, self.prefix.salt)

    def lookup(self, names: list[bytes]) -> Hit:
        """The cached prefix a new sequence whose blocks are named `names` (`names_of`) may start on."""
        if self.prefix is None:
            return Hit([], 0)
        return self.prefix.match(names, self.prefix_mode.mode == "exact")

    def blocks_needed(self, tokens: int, hit: Hit) -> int:
        """Blocks a new sequence of `tokens` positions starting on `hit` takes from `free_blocks` (its cached
        blocks nobody references count there, so taking them costs as much as a new block)."""
        if self.prefix is None:
            return self.blocks_for(tokens)
        return self.blocks_for(tokens) - len(hit.blocks) + self.prefix.idle_among(hit.blocks)

    def start(self, seq: SeqCache, hit: Hit, tokens: list[int]) -> int:
        """Put a newly admitted sequence on its hit: take the shared blocks, restore or rebuild its window state;
        returns the position prefill resumes at (the hit, or where approximate mode's replay starts)."""
        if self.prefix is None:
            return 0
        bt = self.spec.block_tokens
        for b in hit.blocks:
            self.prefix.take(b)
        seq.blocks = list(hit.blocks)
        self._write_table(seq, 0)
        seq.names = list(hit.names)
        seq.shared_until = hit.tokens
        if self.prefix_mode.mode == "exact":
            if hit.snapshot is not None:
                self.prefix.touch_snapshot(hit.snapshot)
                self.restore_snapshot(seq.slot, hit.snapshot, hit.tokens)
            # where later requests will likely hit again: the end of the cached blocks this one could not use (no
            # snapshot there), and the end of its own full blocks
            last = (len(tokens) // bt) * bt
            seq.wanted = sorted({b for b in (hit.longest, last) if b > hit.tokens})
            seq.num_tokens = hit.tokens
            seq.window_start = max(0, hit.tokens - self.window)
        else:
            replay = min(hit.tokens, self.prefix_mode.replay_for(self.window))
            seq.window_start = seq.num_tokens = hit.tokens - replay
        seq.resume = seq.num_tokens
        return seq.num_tokens

    def plan_snapshots(self, seq: SeqCache, start: int, length: int, names: list[bytes] = ()) -> None:
        """Before a prefill step over positions start..start+length-1: snapshots for the wanted boundaries in it
        (`names`: the sequence's block names, where known: a boundary whose cached block has one is skipped)."""
        bt = self.spec.block_tokens
        for b in [b for b in seq.wanted if start < b <= start + length]:
            seq.wanted.remove(b)
            if b // bt <= len(names) and self.prefix.block_of.get(names[b // bt - 1]) in self.prefix.snapshot_of:
                continue
            sid = self.prefix.new_snapshot()
            if sid is not None:
                seq.take[b] = sid

    def snapshot_decode(self, seqs: list[SeqCache], positions: list[int]) -> None:
        """Exact mode, after launching a decode step: snapshot the rows whose token ends a block."""
        bt, rows = self.spec.block_tokens, []
        for s, p in zip(seqs, positions):
            if (p + 1) % bt == 0 and p + 1 > s.shared_until:
                sid = self.prefix.new_snapshot()
                if sid is not None:
                    s.pending[p + 1] = sid
                    rows.append((s.slot, sid, p + 1))
        if rows:
            self.take_snapshots(*map(list, zip(*rows)))

    def publish(self, seq: SeqCache, tokens: list[int]) -> None:
        """Name the sequence's blocks that are full and whose tokens are known (`tokens`: its tokens so far), and
        give their snapshots to them; prefill snapshots written by the last step become pending first."""
        seq.pending.update(seq.take)
        seq.take.clear()
        bt, prefix = self.spec.block_tokens, self.prefix
        full, start = min(seq.num_tokens, len(tokens)) // bt, len(seq.names)
        if full > start:
            parent = seq.names[-1] if seq.names else None
            seq.names += block_names(tokens[: full * bt], bt, prefix.salt, start, parent)
            for i in range(start, full):
                prefix.publish(seq.blocks[i], seq.names[i])  # False: an equal block is cached; this one stays private
        for b in [b for b in seq.pending if b // bt <= len(seq.names)]:
            sid, owner = seq.pending.pop(b), prefix.block_of.get(seq.names[b // bt - 1])
            if owner is None:
                prefix.free_snapshot(sid)
            else:
                prefix.attach_snapshot(owner, sid)

    def restore_snapshot(self, slot: int, snapshot: int, boundary: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no sliding-window snapshots")

    def take_snapshots(self, slots: list[int], snapshots: list[int], boundaries: list[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no sliding-window snapshots")

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
        if self.prefix is None:
            self._free_blocks.extend(reversed(seq.blocks))
        else:
            for sid in [*seq.take.values(), *seq.pending.values()]:
                self.prefix.free_snapshot(sid)
            seq.take, seq.pending, seq.wanted, seq.names = {}, {}, [], []
            self._free_blocks.extend(b for b in reversed(seq.blocks) if self.prefix.drop(b))
        seq.blocks = []
        self._free_slots.append(seq.slot)
        seq.slot = -1
