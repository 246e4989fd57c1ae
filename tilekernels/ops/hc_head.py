"""mHC HyperHead: collapse the N residual streams once more before the final norm and the LM head."""

import torch

from tilekernels.op import OpDecl


def reference(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """streams [T, N, H], fn [N, N*H], base [N], scale [1] -> [T, H]."""
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


OP = OpDecl("hc_head", "mHC final stream collapse", reference)
