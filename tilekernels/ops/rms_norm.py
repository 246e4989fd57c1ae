"""Weighted RMSNorm, computed in fp32 with an fp32 weight, cast back to the input dtype."""

import torch

from tilekernels.op import OpDecl


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] (fp32) -> [..., D] in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


OP = OpDecl("rms_norm", "weighted RMSNorm (fp32 math)", reference)
