"""Unweighted RMSNorm over the last dim: the per-head q norm and the mHC input norm."""

import torch

from tilekernels.op import OpDecl


def reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x * rsqrt(mean(x^2) + eps); the statistic in fp32, the product in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


OP = OpDecl("rms_norm_unweighted", "unweighted RMSNorm (per head or over a flat row)", reference)
