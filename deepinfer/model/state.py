"""Per-sequence decoding state of a DeepSeek-V4 model, one `LayerState` per layer.

Every layer keeps the last `sliding_window - 1` rows of its shared K=V (the window of the next token).
A CSA/HCA layer adds a compressor state: the tokens of the not yet closed window (kv and gate without the
position bias), the compressed entries emitted so far, and for the overlapping CSA scheme the previous
window's first-half series (kv, and gate with the bias added). A CSA layer has a second compressor state for
the lightning indexer's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.config import CSA, HCA, ModelConfig


@dataclass
class CompressorState:
    buffer_kv: torch.Tensor | None = None
    buffer_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    entry_count: int = 0
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None

    def num_bytes(self) -> int:
        tensors = (self.buffer_kv, self.buffer_gate, self.entries, self.overlap_kv, self.overlap_gate)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class LayerState:
    window: torch.Tensor | None = None
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def num_bytes(self) -> int:
        total = 0 if self.window is None else self.window.numel() * self.window.element_size()
        for c in (self.compressor, self.indexer):
            total += 0 if c is None else c.num_bytes()
        return total


@dataclass
class SequenceState:
    """Everything a sequence needs to continue: its token count and each layer's state."""

    layers: list[LayerState]
    num_tokens: int = 0

    @classmethod
    def empty(cls, cfg: ModelConfig) -> SequenceState:
        layers = []
        for kind in cfg.layer_types:
            layers.append(
                LayerState(
                    compressor=CompressorState() if kind in (CSA, HCA) else None,
                    indexer=CompressorState() if kind == CSA else None,
                )
            )
        return cls(layers=layers)

    def num_bytes(self) -> int:
        return sum(layer.num_bytes() for layer in self.layers)


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's contiguous run of rows in a forward batch."""

    state: SequenceState
    offset: int
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)


@dataclass(frozen=True)
class ForwardBatch:
    """A flat batch of new tokens from one or more sequences, and the rows whose logits are wanted."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, absolute positions
    seqs: tuple[SeqSlice, ...]
    logit_rows: torch.Tensor = field(default=None)  # [M] int64 rows of the batch; None = every row
