"""mHC pre-block: from the N residual streams compute the pre/post/comb mixes (comb projected onto doubly
stochastic matrices by Sinkhorn-Knopp) and collapse the streams into the block input. All math in fp32."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl
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


@dataclass(frozen=True)
class Config:
    chunk: int = 512  # stream columns per step of the mixing matvec
    threads: int = 128


def body(P, v: Variant, cfg: Config):
    return hc_mixes.mixes_body(P, v, cfg, collapse=True)  # the mixes kernel, storing the collapse instead of pre


KERNEL = Kernel("hc_pre", body, configs={"default": Config(), "c": Config(chunk=64, threads=1)})


def variant(streams: torch.Tensor, sinkhorn_iters: int) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    _, n, h = streams.shape
    return Variant(hc=n, hidden=h, iters=sinkhorn_iters, dtype=dtypes.name(streams.dtype))


def run(launch, streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    m, n, h = streams.shape
    v = variant(streams, sinkhorn_iters)
    hc_mixes.check("hc_pre", streams, fn, base, scale, sinkhorn_iters)
    post = torch.empty(m, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(m, n * n, dtype=torch.float32, device=streams.device)
    out = torch.empty(m, h, dtype=streams.dtype, device=streams.device)
    launch("hc_pre", v)(streams.reshape(m, n * h).contiguous(), fn.float().contiguous(), base.float().contiguous(),
                        scale.float().contiguous(), post, comb, out, float(hc_eps), float(norm_eps))
    return post, comb.view(m, n, n), out


example = hc_mixes.example  # the same arguments: streams, fn, base, scale, iterations, hc_eps, norm_eps


OP = OpDecl(
    "hc_pre", "mHC mixes with Sinkhorn and stream collapse", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)},
    run=run, example=example,
)
