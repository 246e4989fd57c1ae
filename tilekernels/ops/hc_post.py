"""mHC post-block: expand the block output into N streams and add the comb-mixed residual streams."""

import torch

from tilekernels.op import OpDecl


def reference(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """streams [T, N, H], out [T, H], post [T, N], comb [T, N, N] -> post x out + comb^T @ streams, [T, N, H]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


OP = OpDecl("hc_post", "mHC stream expansion and residual mix", reference)
