"""DSpark's block pass through captured graphs: one per request-count bucket, eager where the backend cannot
capture (CPU).

Every bucket is captured at start (`Engine.capture_all`, through the speculator), into the decode graphs'
memory pool; each keeps its base logits ([requests, block, V] in the model's dtype). A pass's inputs (anchor
tokens, their positions, the requests' slots and the first position each window ring holds) go to the device
with one copy; padding rows use the cache's scratch slot and see no window. The graph
also runs the Markov loop for greedy drafts (argmax); a batch with sampled or biased requests redraws from the
captured base logits eagerly (`runtime/drafters.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepinfer.model.dspark import DSparkDrafter
from deepinfer.runtime.cache import PagedCache, SeqCache
from deepinfer.runtime.graph import batch_buckets, bucket_for
from deepinfer.runtime.staging import InputStage


@dataclass
class _Pass:
    stage: InputStage
    out: tuple[torch.Tensor, ...] | None = None  # base logits, collapsed rows, greedy drafts, their confidences
    replay: Callable[[], Any] | None = None


class DSparkGraphs:
    def __init__(self, drafter: DSparkDrafter, cache: PagedCache, max_requests: int,
                 capture: Callable[[Callable[[], Any]], tuple[Any, Callable[[], Any]]]):
        self.drafter, self.cache, self.capture = drafter, cache, capture
        self.buckets = batch_buckets(max_requests)
        self._passes: dict[int, _Pass] = {}

    def _pass(self, size: int) -> _Pass:
        if size not in self._passes:
            stage = InputStage(4, size, self.drafter.model.device)
            stage.staged[2].fill_(self.cache.scratch_slot)
            anchors, positions, slots, starts = stage.staged

            def run():
                logits, collapsed = self.drafter.block(self.cache, anchors, positions, slots, starts)
                tokens, confidence = self.drafter.markov(logits, collapsed, anchors, lambda x, i: x.argmax(dim=-1))
                return logits, collapsed, tokens, confidence

            entry = _Pass(stage)
            entry.out, entry.replay = self.capture(run)  # padding rows only: scratch state
            self._passes[size] = entry
        return self._passes[size]

    def capture_all(self) -> None:
        """Capture every bucket now (start-up), the largest first (its memory serves the smaller ones)."""
        for size in sorted(self.buckets, reverse=True):
            self._pass(size)

    @torch.inference_mode()
    def run(self, anchors: list[int], positions: list[int], shares: list[SeqCache]) -> tuple[torch.Tensor, ...]:
        """The block pass of n requests: base logits [n, b, V] (model dtype), collapsed rows [n, b, H], greedy drafts [n, b] and
        their confidences [n, b] (views of the graph's buffers, valid until the next pass of that bucket)."""
        n = len(anchors)
        size = bucket_for(self.buckets, n)
        if size is None:
            raise ValueError(f"a DSpark pass of {n} requests: the graphs hold at most {self.buckets[-1]}")
        entry = self._pass(size)
        pad = size - n
        entry.stage.send([list(anchors) + [0] * pad, list(positions) + [0] * pad,
                          [s.slot for s in shares] + [self.cache.scratch_slot] * pad,
                          [s.window_start for s in shares] + [0] * pad])
        entry.replay()
        return tuple(t[:n] for t in entry.out)
