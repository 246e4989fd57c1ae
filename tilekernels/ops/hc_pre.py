"""mHC pre-block: from the N residual streams compute the pre/post/comb mixes (comb projected onto doubly
stochastic matrices by Sinkhorn-Knopp) and collapse the streams into the block input. All math in fp32."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import OpDecl
from tilekernels.ops import hc_collapse, hc_mixes


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
    (post [T, N] fp32, comb [T, N, N] fp32, collapsed [T, H] in streams' dtype): `hc_mixes`, then
    `hc_collapse` with the pre mix just computed."""
    pre, post, comb = hc_mixes.reference(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return post, comb, hc_collapse.reference(streams, pre)


@dataclass(frozen=True)
class Variant:
    hc: int  # N streams
    hidden: int  # H
    iters: int  # Sinkhorn iterations
    dtype: str
    split: int = 1  # column parts per token of the partials kernel (split K, `hc_mixes.split_for`)


# hc_mixes' kernels, storing the collapse instead of pre: "hc_pre_split" partial mixing products of (token, part)
# tiles (on sm_90a a tensor-core GEMM: `hc_mixes_sm90`) and "hc_pre_finish" their sum per token, the tail and the
# collapse
KERNELS = hc_mixes.kernels("hc_pre", collapse=True)


def variant(streams: torch.Tensor, sinkhorn_iters: int) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    _, n, h = streams.shape
    return Variant(hc=n, hidden=h, iters=sinkhorn_iters, dtype=dtypes.name(streams.dtype),
                   split=hc_mixes.split_for(n * h))


def run(launch, streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    m, n, h = streams.shape
    v = variant(streams, sinkhorn_iters)
    hc_mixes.check("hc_pre", streams, fn, base, scale, sinkhorn_iters)
    post = torch.empty(m, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(m, n * n, dtype=torch.float32, device=streams.device)
    out = torch.empty(m, h, dtype=streams.dtype, device=streams.device)
    hc_mixes.launch_mixes(launch, "hc_pre", True, v, streams, fn, base, scale, (post, comb, out), hc_eps, norm_eps)
    return post, comb.view(m, n, n), out


example = hc_mixes.example  # the same arguments: streams, fn, base, scale, iterations, hc_eps, norm_eps


OP = OpDecl(
    "hc_pre", "mHC mixes with Sinkhorn and stream collapse", reference,
    kernels=KERNELS,
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)},
    run=run, example=example,
)
