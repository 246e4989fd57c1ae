"""DeepSeek-V4.1 decode steps replayed from CUDA graphs: one graph per batch-size bucket (as V4's `DecodeGraphs`),
captured the first time a step of that bucket runs, over static inputs (ids, positions, cache slots) padded with
rows of the cache's scratch slot. The captured step is `DeepseekV41.decode_step` with its shapes fixed: the
indexers score every compressed entry a slot can hold (masked past each sequence's own), so one graph serves
every context up to the cache's length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepinfer.model.v41 import DeepseekV41
from deepinfer.model.v41_cache import V41Cache
from deepinfer.model.v41_decode import DecodeBatch
from deepinfer.runtime.graph import batch_buckets


@dataclass
class _Bucket:
    ids: torch.Tensor
    step: DecodeBatch
    logits: torch.Tensor
    replay: Callable[[], Any]


class V41DecodeGraphs:
    def __init__(self, model: DeepseekV41, cache: V41Cache, scratch_slot: int, max_batch: int,
                 capture: Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], Any]]]):
        """`cache` holds `scratch_slot` beside the sequences' slots; `capture(fn)` runs fn under a graph capture
        and returns (its output, replay)."""
        self.model, self.cache, self.scratch, self.capture = model, cache, scratch_slot, capture
        self.buckets = batch_buckets(max_batch)
        self._graphs: dict[int, _Bucket] = {}
        self.last_logits: torch.Tensor | None = None  # the bucket-sized logits buffer of the last replayed step

    def _bucket(self, n: int) -> _Bucket:
        size = next(b for b in self.buckets if b >= n)
        if size not in self._graphs:
            device = self.model.weights.embed.device
            ids = torch.zeros(size, dtype=torch.long, device=device)
            step = DecodeBatch(torch.full((size,), self.scratch, dtype=torch.long, device=device),
                               torch.zeros(size, dtype=torch.long, device=device), self.cache.max_len - 1)
            # captured with every row on the scratch slot: only scratch state is touched
            logits, replay = self.capture(lambda: self.model.decode_step(self.cache, ids, step))
            self._graphs[size] = _Bucket(ids, step, logits, replay)
        return self._graphs[size]

    def run(self, ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """fp32 logits [n, V] of one decode step for n sequences (the caller advances their token counts)."""
        n = len(ids)
        b = self._bucket(n)
        pad = b.ids.shape[0] - n
        b.ids.copy_(torch.tensor(ids + [0] * pad))
        b.step.t.copy_(torch.tensor(positions + [0] * pad))
        b.step.slot.copy_(torch.tensor(slots + [self.scratch] * pad))
        b.replay()
        self.last_logits = b.logits
        return b.logits[:n]
