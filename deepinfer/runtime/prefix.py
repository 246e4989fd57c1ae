"""The prefix cache's index: which full blocks hold which token prefix, who references them, and which may be
evicted.

A full block (`block_tokens` positions) is named by a hash chain: the hash of (its parent's hash, its token ids),
seeded with a salt naming the model and cache dtype, so equal names mean equal prefixes from position 0. A block
is *published* under its name once every position in it has been written (its compressed entries are closed:
`block_tokens` is a multiple of every compression rate). Blocks are shared by reference count; a published
block nobody references stays cached, in least-recently-used order, until its memory is needed for a new block.

Exact mode keeps some sliding-window *snapshots* (the window KV and the compressors' carried state at a block
boundary, `runtime/snapshots.py`): each belongs to the published block that ends at its boundary and is evicted
with it, or alone (least recently used first) when the snapshot pool is full.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from deepinfer.errors import ConfigError

MODES = ("approximate", "exact", "off")


@dataclass(frozen=True)
class PrefixMode:
    """How a prefix hit gets its sliding-window state: `approximate` prefills the last `replay_tokens` tokens before
    the hit again (at least the window: sliding_window - 1), `exact` restores a snapshot taken at the hit's
    boundary (hits only where one is kept), `off` caches nothing."""

    mode: str = "approximate"
    replay_tokens: int = 128

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"prefix cache mode {self.mode!r} is not valid; accepted: {', '.join(MODES)}")
        if not isinstance(self.replay_tokens, int) or self.replay_tokens < 1:
            raise ConfigError(f"SWA replay tokens must be an integer >= 1, got {self.replay_tokens!r}")

    def replay_for(self, window: int) -> int:
        """Tokens an approximate hit prefills again: a decode step after it reads the whole window."""
        return max(self.replay_tokens, window - 1)


def block_names(tokens: list[int], block_tokens: int, salt: bytes, start: int = 0,
                parent: bytes | None = None) -> list[bytes]:
    """The names of the full blocks of `tokens` from block `start` on (`parent`: block start-1's name)."""
    out, name = [], parent if parent is not None else salt
    for b in range(start, len(tokens) // block_tokens):
        h = hashlib.blake2b(name, digest_size=16)
        h.update(array("q", tokens[b * block_tokens: (b + 1) * block_tokens]).tobytes())
        name = h.digest()
        out.append(name)
    return out


@dataclass
class Hit:
    """A new sequence's prefix found in the cache: `blocks` (shared, in order), so `tokens` positions are
    cached; `snapshot`: in exact mode, the snapshot at the end of the last shared block (None otherwise)."""

    blocks: list[int]
    tokens: int
    snapshot: int | None = None
    names: tuple[bytes, ...] = ()  # the shared blocks' names
    longest: int = 0  # tokens of the longest cached prefix, snapshot or not (exact mode cuts back from it)


class PrefixIndex:
    """Names, reference counts and LRU order of the cache's blocks; snapshots' owners and LRU order."""

    def __init__(self, num_blocks: int, block_tokens: int, salt: bytes, snapshots: int = 0):
        self.block_tokens, self.salt = block_tokens, salt
        self.refs = [0] * num_blocks
        self.name_of: dict[int, bytes] = {}  # published block -> its name
        self.block_of: dict[bytes, int] = {}  # name -> the published block holding it
        self.idle: OrderedDict[int, None] = OrderedDict()  # published, unreferenced: eviction order (oldest first)
        self.spare_snapshots = list(range(snapshots - 1, -1, -1))
        self.snapshot_of: dict[int, int] = {}  # published block -> the snapshot at its end
        self.owner_of: dict[int, int] = {}  # snapshot -> the block it belongs to
        self.snapshot_lru: OrderedDict[int, None] = OrderedDict()  # snapshots held by blocks, oldest first

    # ---- lookup ----
    def match(self, names: list[bytes], exact: bool) -> Hit:
        """The longest cached prefix among `names` (a request's full blocks, at most those it may skip); in
        exact mode, cut back to the last block that carries a snapshot."""
        blocks = []
        for name in names:
            block = self.block_of.get(name)
            if block is None:
                break
            blocks.append(block)
        longest, snapshot = len(blocks) * self.block_tokens, None
        if exact:
            while blocks and blocks[-1] not in self.snapshot_of:
                blocks.pop()
            if blocks:
                snapshot = self.snapshot_of[blocks[-1]]
        return Hit(blocks, len(blocks) * self.block_tokens, snapshot, tuple(names[: len(blocks)]), longest)

    def idle_among(self, blocks: list[int]) -> int:
        """How many of `blocks` are cached and unreferenced (taking them leaves fewer blocks to evict)."""
        return sum(1 for b in blocks if b in self.idle)

    # ---- references ----
    def take(self, block: int) -> None:
        self.refs[block] += 1
        self.idle.pop(block, None)

    def drop(self, block: int) -> bool:
        """One reference fewer; True when the block is free again (unreferenced and not published)."""
        self.refs[block] -= 1
        if self.refs[block] < 0:
            raise AssertionError(f"block {block} released more often than taken")
        if self.refs[block] > 0:
            return False
        if block in self.name_of:
            self.idle[block] = None  # most recently used last
            return False
        return True

    def evict(self) -> int | None:
        """The least recently used idle block, unpublished (and its snapshot freed); None when there is none."""
        if not self.idle:
            return None
        block, _ = self.idle.popitem(last=False)
        del self.block_of[self.name_of.pop(block)]
        snapshot = self.snapshot_of.get(block)
        if snapshot is not None:
            self.free_snapshot(snapshot)
        return block

    # ---- publishing ----
    def publish(self, block: int, name: bytes) -> bool:
        """Name a full block; False when another block already holds that prefix (this one stays private)."""
        if name in self.block_of or block in self.name_of:
            return False
        self.block_of[name] = block
        self.name_of[block] = name
        return True

    def attach_snapshot(self, block: int, snapshot: int) -> None:
        """Give a published block the snapshot taken at its end; where the block is not published (or already has
        one) the snapshot goes back to the pool."""
        if block not in self.name_of or block in self.snapshot_of:
            self.free_snapshot(snapshot)
            return
        self.snapshot_of[block] = snapshot
        self.owner_of[snapshot] = block
        self.snapshot_lru[snapshot] = None

    def touch_snapshot(self, snapshot: int) -> None:
        """A hit restored it: most recently used."""
        self.snapshot_lru.move_to_end(snapshot)

    def new_snapshot(self) -> int | None:
        """A snapshot to write: a free one, else the least recently used one taken from its block."""
        if self.spare_snapshots:
            return self.spare_snapshots.pop()
        if not self.snapshot_lru:
            return None
        snapshot, _ = self.snapshot_lru.popitem(last=False)
        del self.snapshot_of[self.owner_of.pop(snapshot)]
        return snapshot

    def free_snapshot(self, snapshot: int) -> None:
        """Back to the pool: taken from its block if it has one (a snapshot never attached has none)."""
        if snapshot in self.owner_of:
            del self.snapshot_of[self.owner_of.pop(snapshot)]
            self.snapshot_lru.pop(snapshot, None)
        self.spare_snapshots.append(snapshot)
