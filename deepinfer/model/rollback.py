"""Tentative steps: rows a step writes for positions its sequence may not keep (speculative verify rows).

Verifying draft tokens runs them as rows of one step; which of them stay is known only afterwards. Nothing the
step wrote needs undoing, because the cache is laid out for it (`CacheSpec.lookahead`):
- the sliding-window ring and each compressor's buffer ring hold `lookahead` rows more than the positions a later
  step reads, so a rejected position's row (at `position % ring rows`) overwrites only a position older than
  anything the sequence still reads, and is overwritten again when a real token takes that position;
- a compressed entry (or indexer key) of a window closed by rejected tokens is read only once that window has
  closed within the sequence's count, and is pooled again (its rows written again) when the real tokens close it.

So `commit(seq, end)` only sets the sequence's count: the cache is then what a step that never saw the rejected
tokens leaves, in every row a later step reads (tests/test_speculative_cache.py compares the two).
"""

from __future__ import annotations

from deepinfer.runtime.cache import SeqCache


def check_tentative(rows: int, lookahead: int) -> None:
    """A tentative chunk may write `lookahead` rows past its first (the ring room that keeps them harmless)."""
    if rows - 1 > lookahead:
        raise AssertionError(f"a tentative chunk of {rows} rows writes past the cache's lookahead of {lookahead} "
                             "positions (CacheSpec.lookahead): its rejected rows could overwrite kept state")


def commit(seq: SeqCache, end: int) -> None:
    """Keep a tentative step's positions before `end` (at most what it wrote); forget the rest."""
    if end > seq.num_tokens:
        raise AssertionError(f"slot {seq.slot} holds {seq.num_tokens} positions; cannot keep {end}")
    seq.num_tokens = end
