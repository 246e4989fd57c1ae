"""Decode steps through preplanned static buffers: one graph per batch-size bucket, captured the first time a
step of that bucket runs where the backend can capture, and run eagerly where it cannot (CPU).
Inputs are padded to the bucket with rows that read and write only the cache's scratch slot and blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepinfer.runtime.cache import PagedCache, SeqCache
from deepinfer.model.decode import DecodeInputs
from deepinfer.model.model import DeepseekV4

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a graph is captured for (a step runs in the smallest that holds it)."""
    return tuple(b for b in DEFAULT_BUCKETS if b < max_batch) + (max_batch,)


@dataclass
class _Bucket:
    inputs: DecodeInputs
    logits: torch.Tensor | None = None
    replay: Callable[[], Any] | None = None


class DecodeGraphs:
    def __init__(self, model: DeepseekV4, cache: PagedCache, max_batch: int,
                 capture: Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], Any]]] | None):
        """`capture(fn)` runs fn under a graph capture and returns (its output, replay); None = eager."""
        self.model, self.cache, self.capture = model, cache, capture
        self.buckets = batch_buckets(max_batch)
        self._graphs: dict[int, _Bucket] = {}
        self.last_logits: torch.Tensor | None = None  # the bucket-sized logits buffer of the last replayed step

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _static(self, size: int) -> _Bucket:
        if size not in self._graphs:
            device, cache = self.model.device, self.cache
            inputs = DecodeInputs(
                ids=torch.zeros(size, dtype=torch.long, device=device),
                positions=torch.zeros(size, dtype=torch.long, device=device),
                slots=torch.full((size,), cache.scratch_slot, dtype=torch.long, device=device),
                blocks=torch.full((size, cache.spec.max_blocks_per_seq), cache.scratch_block, dtype=torch.long,
                                  device=device),
            )
            bucket = _Bucket(inputs)
            if self.capture is not None:  # all rows are padding while capturing: only scratch state is touched
                bucket.logits, bucket.replay = self.capture(lambda: self.model.decode(self.cache, inputs))
            self._graphs[size] = bucket
        return self._graphs[size]

    def run(self, ids: list[int], positions: list[int], seqs: list[SeqCache]) -> torch.Tensor:
        """fp32 logits [n, V] of one decode step for n sequences."""
        n = len(ids)
        bucket = self._static(self.bucket(n))
        inp, cache = bucket.inputs, self.cache
        size = inp.ids.shape[0]
        pad = size - n
        inp.ids.copy_(torch.tensor(ids + [0] * pad))
        inp.positions.copy_(torch.tensor(positions + [0] * pad))
        inp.slots.copy_(torch.tensor([s.slot for s in seqs] + [cache.scratch_slot] * pad))
        inp.blocks.copy_(cache.block_table(seqs, rows=size))
        if bucket.replay is None:
            return self.model.decode(cache, inp)[:n]
        bucket.replay()
        self.last_logits = bucket.logits
        return bucket.logits[:n]
