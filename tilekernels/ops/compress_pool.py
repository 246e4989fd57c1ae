"""Compressor pooling: each window's entry is the per-channel softmax-over-slots weighted sum of its kv."""

import torch

from tilekernels.op import OpDecl


def reference(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """kv [W, S, d], gate [W, S, d] (position bias added; -inf marks an empty slot) -> [W, d] in kv's dtype.

    The softmax over the S slots runs in fp32."""
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


OP = OpDecl("compress_pool", "softmax-gated window pooling of the CSA/HCA compressors", reference)
