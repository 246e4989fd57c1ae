"""A second CUDA stream for the independent halves of a layer, so that a step's small latency-bound kernels run
beside its large weight-bound ones instead of after them (a captured decode step records them as parallel branches
of its graph). At one token: the attention's key side (kv norm and RoPE, the cache writes, the compressors, the
indexer and its top-k) beside the query's GEMM, and the MoE's shared expert beside the routing and the routed
experts. Other targets have none: the model then runs the branch in place, in program order
(`deepinfer/model/side_stream.py`).

What keeps it safe with PyTorch's caching allocator: a branch only reads tensors its caller holds until `join`, so
no block the branch reads is freed and reused by the main stream while the branch runs; what the branch makes is
read by the main stream only after `join`; and a branch waits for the main stream's work so far when it starts."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class SideStream:
    def __init__(self, device: torch.device):
        # a higher priority than the main stream: the branch's small kernels take the SMs a GEMM's wave frees first
        self._stream = torch.cuda.Stream(device, priority=-1)

    @contextmanager
    def branch(self) -> Iterator[None]:
        """Run the body's work on the side stream, after the current stream's work so far."""
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            yield

    def join(self) -> None:
        """The current stream waits for the branch's work."""
        torch.cuda.current_stream().wait_stream(self._stream)
