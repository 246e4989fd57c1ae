"""mHC mixes: from the N residual streams, the pre/post/comb coefficients (comb projected onto doubly
stochastic matrices by Sinkhorn-Knopp), without collapsing. V4's `hc_pre` is these mixes plus `hc_collapse`
with its own pre; V4.1's "single pass" collapses each sublayer's input with the pre its predecessor computed."""

import torch

from tilekernels.op import OpDecl


def reference(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, H], fn [(2+N)N, N*H], base [(2+N)N], scale [3] ->
    (pre [T, N], post [T, N], comb [T, N, N]), all fp32. One RMS statistic per token over all N*H values."""
    t, n, _ = streams.shape
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * s_comb + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


OP = OpDecl("hc_mixes", "mHC pre/post/comb mixes with Sinkhorn (no collapse)", reference)
