"""Partial interleaved RoPE on the trailing `2 * len(inv_freq)` channels, and its inverse.

Pairs are (0,1), (2,3), ... of the rotated slice; the leading channels pass through. cos/sin are computed
from the absolute positions in fp32, cast to x's dtype, and the rotation runs in fp32. `inverse=True` rotates
by the negative angle (used on the attention output, whose value half carries the keys' rotation).
"""

import torch

from tilekernels.op import OpDecl


def reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
    inverse: bool = False,
) -> torch.Tensor:
    """x [N, ..., D], positions [N] int, inv_freq [r/2] fp32 -> x with its last r channels rotated."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [N, r/2]
    cos = (freqs.cos() * attention_factor).to(x.dtype)
    sin = (freqs.sin() * attention_factor).to(x.dtype)
    if inverse:
        sin = -sin
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    cos = cos.repeat_interleave(2, dim=-1).view(view)
    sin = sin.repeat_interleave(2, dim=-1).view(view)
    r = cos.shape[-1]
    nope, rot = x[..., :-r], x[..., -r:]
    rot_half = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rot.float() * cos + rot_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


OP = OpDecl("rope", "partial interleaved RoPE on the trailing dims (and its inverse)", reference)
