"""Unweighted RMSNorm over the last dim: the per-head q norm and the mHC input norm (the rms_norm kernel,
unweighted variant)."""

import torch

from tilekernels.op import OpDecl
from tilekernels.ops import rms_norm


def reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x * rsqrt(mean(x^2) + eps); the statistic in fp32, the product in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def variant(x: torch.Tensor) -> rms_norm.Variant:
    """The rms_norm kernel variant `run` launches (its unweighted form)."""
    return rms_norm.variant(x, None)


def run(launch, x: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm.run(launch.op("rms_norm"), x.contiguous(), None, eps)


def example(v: rms_norm.Variant, rows: int, device) -> tuple:
    """Rows of `v.dim` (the variant is the rms_norm kernel's, unweighted)."""
    return rms_norm.example(v, rows, device)[:1] + (1e-6,)


OP = OpDecl("rms_norm_unweighted", "unweighted RMSNorm (per head or over a flat row)", reference,
            tolerance=rms_norm.OP.tolerance, run=run, example=example, uses=("rms_norm",))
