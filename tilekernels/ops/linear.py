"""Dense linear layer without bias: y = x @ w^T (the bf16 GEMM of every projection)."""

import torch

from tilekernels.op import OpDecl


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N]."""
    return torch.nn.functional.linear(x, weight)


OP = OpDecl("linear", "dense projection y = x @ W^T", reference)
