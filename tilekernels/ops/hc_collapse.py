"""mHC collapse: the N residual streams weighted by a given pre mix and summed into one sublayer input."""

import torch

from tilekernels.op import OpDecl


def reference(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, N, H], pre [T, N] (fp32) -> [T, H] in streams' dtype; the weighted sum runs in fp32."""
    return (pre.float().unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


OP = OpDecl("hc_collapse", "mHC stream collapse with a given pre mix", reference)
