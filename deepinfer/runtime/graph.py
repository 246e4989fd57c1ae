"""Decode steps through preplanned static buffers: one graph per batch-size bucket, captured where the backend
can capture (all of them at start, `capture_all`, largest first into one memory pool; else the first time a step
of that bucket runs), and run eagerly where it cannot (CPU).

A step's inputs (ids, positions, cache slots, and the row arithmetic the host makes for it: `host_rows.py`) go to
the device with one copy through pinned memory; the block table is not sent at all: the captured step gathers its
rows from the cache's device-resident table by slot.
Inputs are padded to the bucket with rows that read and write only the cache's scratch slot and blocks. The ids
may instead be gathered on the device (`DeviceIds`: the tokens the previous step sampled, not yet seen by the
host)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from deepinfer.model.host_rows import HostRows
from deepinfer.runtime.cache import PagedCache, SeqCache
from deepinfer.runtime.staging import DeviceIds, InputStage
from deepinfer.model.decode import DecodeInputs
from deepinfer.model.model import DeepseekV4

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # past 256: speculative verify rows


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a graph is captured for (a step runs in the smallest that holds it)."""
    return tuple(b for b in DEFAULT_BUCKETS if b < max_batch) + (max_batch,)


def graph_logits_bytes(max_batch: int, vocab: int) -> int:
    """Device bytes of the fp32 logits buffers every captured bucket keeps (one per bucket, up to `max_batch`)."""
    return sum(batch_buckets(max_batch)) * vocab * 4


def bucket_for(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest of the (increasing) `buckets` holding n rows; None past the largest."""
    return next((b for b in buckets if b >= n), None)


STAGED = 4  # staged input rows: ids, positions, slots, and the rows of device ids (`DeviceIds.rows`)


def stage_rows(ids: list[int] | DeviceIds, positions: list[int], slots: list[int], size: int,
               scratch_slot: int) -> list[list[int]]:
    """The [STAGED, size] rows of a step padded to its bucket (device ids stage their rows; `take_ids` gathers)."""
    pad = size - len(positions)
    host_ids, rows = ([0] * len(positions), ids.rows) if isinstance(ids, DeviceIds) else (list(ids), [0] * len(ids))
    return [host_ids + [0] * pad, list(positions) + [0] * pad, list(slots) + [scratch_slot] * pad, rows + [0] * pad]


def take_ids(ids: list[int] | DeviceIds, staged: torch.Tensor) -> None:
    """Device ids into the staged ids row: gathered on the device by the staged rows (no host synchronisation)."""
    if isinstance(ids, DeviceIds):
        n = len(ids)
        staged[0, :n] = ids.tokens.index_select(0, staged[3, :n])


@dataclass
class _Bucket:
    inputs: DecodeInputs
    stage: InputStage  # STAGED rows, then the host-made rows' bytes
    host_rows: HostRows
    values: np.ndarray  # the staged rows as the host writes them, every step (`HostRows.fill` keeps its views)
    logits: torch.Tensor | None = None
    streams: torch.Tensor | None = None  # the rows' final residual streams (`hidden` graphs)
    replay: Callable[[], Any] | None = None


class DecodeGraphs:
    def __init__(self, model: DeepseekV4, cache: PagedCache, max_batch: int,
                 capture: Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], Any]]] | None,
                 hidden: bool = False):
        """`capture(fn)` runs fn under a graph capture and returns (its output, replay); None = eager. `max_batch`:
        rows of the largest step (speculative decoding: requests x (1 + drafts)). `hidden`: the steps keep their
        rows' final residual streams too (`last_streams`; the MTP draft layer reads them)."""
        self.model, self.cache, self.capture, self.hidden = model, cache, capture, hidden
        self.buckets = batch_buckets(max_batch)
        self._graphs: dict[int, _Bucket] = {}
        self.last_logits: torch.Tensor | None = None  # the bucket-sized logits buffer of the last replayed step
        self.last_streams: torch.Tensor | None = None  # the last step's rows' streams (`hidden`)
        self._buffers: dict | None = None  # what the host-made rows' steps keep between steps (`HostRows.buffers`)

    def bucket(self, n: int) -> int:
        size = bucket_for(self.buckets, n)
        if size is None:
            raise ValueError(f"a decode step of {n} rows: the graphs hold at most {self.buckets[-1]}")
        return size

    def capture_all(self) -> list[torch.Tensor]:
        """Capture every bucket now, the largest first (its memory serves the smaller ones from the shared pool);
        their logits buffers (none where nothing is captured)."""
        if self.capture is None:
            return []
        return [self._static(size).logits for size in sorted(self.buckets, reverse=True)]

    def replays(self) -> dict[int, Callable[[], Any]]:
        """Each captured bucket's replay, by rows (none where nothing is captured)."""
        return {size: b.replay for size, b in self._graphs.items() if b.replay is not None}

    def _step(self, inputs: DecodeInputs):
        torch.index_select(self.cache.tables, 0, inputs.slots, out=inputs.blocks)
        return self.model.decode(self.cache, inputs, hidden=self.hidden)

    def _static(self, size: int) -> _Bucket:
        if size not in self._graphs:
            device, cache = self.model.device, self.cache
            host_rows = HostRows(cache.layout.layers, size)
            if self._buffers is None:  # for the largest bucket, viewed by the others
                self._buffers = host_rows.buffers(self.buckets[-1], cache.spec.max_blocks_per_seq, device)
            stage = InputStage(STAGED + -(-host_rows.nbytes // (8 * size)), size, device)
            ids, positions, slots, _ = stage.staged[:STAGED]
            inputs = DecodeInputs(ids, positions, slots, blocks=torch.full(
                (size, cache.spec.max_blocks_per_seq), cache.scratch_block, dtype=torch.long, device=device),
                rows=host_rows.device(stage.staged[STAGED:].view(-1).view(torch.uint8)),
                kept=HostRows.sized(self._buffers, size))
            bucket = _Bucket(inputs, stage, host_rows, np.empty(tuple(stage.staged.shape), np.int64))
            self.stage(bucket, [], [], [])  # every row padding (what a capture runs on)
            if self.capture is not None:  # all rows are padding while capturing: only scratch state is touched
                out, bucket.replay = self.capture(lambda: self._step(inputs))
                bucket.logits, bucket.streams = out if self.hidden else (out, None)
            self._graphs[size] = bucket
        return self._graphs[size]

    def stage(self, bucket: _Bucket, ids: list[int] | DeviceIds, positions: list[int], seqs: list[SeqCache]) -> None:
        """Stage a step's inputs and host-made rows in its bucket (one copy)."""
        size, scratch, slots = bucket.inputs.ids.shape[0], self.cache.scratch_slot, [s.slot for s in seqs]
        values = bucket.values  # the host's copy, sent (copied to pinned memory) before this returns
        values[:STAGED] = stage_rows(ids, positions, slots, size, scratch)
        bucket.host_rows.fill(values[STAGED:].reshape(-1).view(np.uint8), positions, slots, [s.blocks for s in seqs],
                              scratch)
        take_ids(ids, bucket.stage.send(values))

    def run(self, ids: list[int] | DeviceIds, positions: list[int], seqs: list[SeqCache], rows: int = 0,
            eager: bool = False) -> torch.Tensor:
        """fp32 logits [n, V] of one decode step for n sequences; `ids` host ints or `DeviceIds`. `rows`: run in a
        bucket of at least that many rows (ranks stepping together); `eager`: not from its graph."""
        n = len(positions)
        bucket = self._static(self.bucket(max(n, rows, 1)))
        self.stage(bucket, ids, positions, seqs)
        if bucket.replay is None or eager:
            out = self._step(bucket.inputs)
            logits, streams = out if self.hidden else (out, None)
        else:
            bucket.replay()
            self.last_logits, logits, streams = bucket.logits, bucket.logits, bucket.streams
        self.last_streams = None if streams is None else streams[:n]
        return logits[:n]
