"""DeepSeek-V4.1 decode steps replayed from CUDA graphs: one graph per batch-size bucket (as V4's `DecodeGraphs`),
captured the first time a step of that bucket runs, over static inputs (ids, positions, cache slots) padded with
rows of the cache's scratch slot and sent with one copy through pinned memory (the ids may instead come from a
device, `DeviceIds`: the tokens the previous step sampled). The captured step is `DeepseekV41.decode_step` with its shapes fixed: the
indexers score every compressed entry a slot can hold (masked past each sequence's own), so one graph serves
every context up to the cache's length. A speculative verify step replays them too, with several rows per
sequence (the buckets then count rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepinfer.model.v41 import DeepseekV41
from deepinfer.model.v41_cache import V41Cache
from deepinfer.model.v41_decode import DecodeBatch
from deepinfer.runtime.graph import STAGED, batch_buckets, stage_rows, take_ids
from deepinfer.runtime.staging import DeviceIds, InputStage


@dataclass
class _Bucket:
    ids: torch.Tensor
    step: DecodeBatch
    stage: InputStage
    logits: torch.Tensor
    taps: torch.Tensor | None  # `hidden` graphs: the rows' DSpark taps
    replay: Callable[[], Any]


class V41DecodeGraphs:
    def __init__(self, model: DeepseekV41, cache: V41Cache, scratch_slot: int, max_batch: int,
                 capture: Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], Any]]],
                 hidden: bool = False):
        """`cache` holds `scratch_slot` beside the sequences' slots; `capture(fn)` runs fn under a graph capture
        and returns (its output, replay). `max_batch`: rows of the largest step (speculative decoding: requests x
        (1 + drafts)); `hidden`: the steps keep their rows' DSpark taps too (`last_taps`)."""
        self.model, self.cache, self.scratch, self.capture, self.hidden = model, cache, scratch_slot, capture, hidden
        self.buckets = batch_buckets(max_batch)
        self._graphs: dict[int, _Bucket] = {}
        self.last_logits: torch.Tensor | None = None  # the bucket-sized logits buffer of the last replayed step
        self.last_taps: torch.Tensor | None = None  # the last step's rows' taps (`hidden`)

    def _bucket(self, n: int) -> _Bucket:
        size = next(b for b in self.buckets if b >= n)
        if size not in self._graphs:
            stage = InputStage(STAGED, size, self.model.weights.embed.device)
            stage.staged[2].fill_(self.scratch)
            ids, t, slot, _ = stage.staged
            step = DecodeBatch(slot, t, self.cache.max_len - 1)
            # captured with every row on the scratch slot: only scratch state is touched
            out, replay = self.capture(lambda: self.model.decode_step(self.cache, ids, step, self.hidden))
            logits, taps = out if self.hidden else (out, None)
            self._graphs[size] = _Bucket(ids, step, stage, logits, taps, replay)
        return self._graphs[size]

    def replays(self) -> dict[int, Callable[[], Any]]:
        """Each captured bucket's replay, by rows."""
        return {size: b.replay for size, b in self._graphs.items()}

    def capture_all(self) -> list[torch.Tensor]:
        """Capture every bucket now, the largest first (its memory serves the smaller ones from the shared pool);
        their logits buffers."""
        return [self._bucket(size).logits for size in sorted(self.buckets, reverse=True)]

    def run(self, ids: list[int] | DeviceIds, positions: list[int], slots: list[int]) -> torch.Tensor:
        """fp32 logits [n, V] of one decode step of n rows (the caller advances the token counts); `ids` host ints
        or `DeviceIds`."""
        n = len(positions)
        b = self._bucket(n)
        take_ids(ids, b.stage.send(stage_rows(ids, positions, slots, b.ids.shape[0], self.scratch)))
        b.replay()
        self.last_logits = b.logits
        self.last_taps = None if b.taps is None else b.taps[:n]
        return b.logits[:n]
