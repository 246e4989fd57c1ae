"""mHC pre-block: from the N residual streams compute the pre/post/comb mixes (comb projected onto doubly
stochastic matrices by Sinkhorn-Knopp) and collapse the streams into the block input. All math in fp32."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import OpDecl, require
from tilekernels.ops import hc_collapse, hc_mixes, rms_norm


def reference(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, H], fn [(2+N)N, N*H], base [(2+N)N], scale [3] ->
    (post [T, N] fp32, comb [T, N, N] fp32, collapsed [T, H] in streams' dtype): `hc_mixes`, then
    `hc_collapse` with the pre mix just computed. `norm` [H] (fp32): the collapse comes out RMS-normalized with
    that weight at `norm_eps` (`rms_norm`: the sublayer's input norm, in the same kernel)."""
    pre, post, comb = hc_mixes.reference(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    collapsed = hc_collapse.reference(streams, pre)
    return post, comb, collapsed if norm is None else rms_norm.reference(collapsed, norm, norm_eps)


@dataclass(frozen=True)
class Variant:
    hc: int  # N streams
    hidden: int  # H
    iters: int  # Sinkhorn iterations
    dtype: str
    split: int = 1  # column parts per token of the partials kernel (split K, `hc_mixes.split_for`)
    norm: bool = False  # the finish stores the collapse RMS-normalized (the partials kernel takes it False)


# hc_mixes' kernels, storing the collapse instead of pre: "hc_pre_split" partial mixing products of (token, part)
# tiles (on sm_90a a tensor-core GEMM: `hc_mixes_sm90`) and "hc_pre_finish" their sum per token, the tail and the
# collapse. (A one-pass form above 64 rows, on sm_90a a cluster of 16 CTAs per 32 rows keeping their columns of the
# streams in shared memory and exchanging the partials over distributed shared memory, was correct but ran at 0.64x
# of these two on the H100: BENCHMARKS.md, seventeenth round; its code is in commit 237c90a.)
KERNELS = hc_mixes.kernels("hc_pre", collapse=True)


def variant(streams: torch.Tensor, sinkhorn_iters: int, norm: bool = False) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    _, n, h = streams.shape
    return Variant(hc=n, hidden=h, iters=sinkhorn_iters, dtype=dtypes.name(streams.dtype),
                   split=hc_mixes.split_for(n * h), norm=norm)


def finish(launch, v: Variant, s, dots, sq, base, scale, hc_eps, norm_eps, norm=None, op: str = "hc_pre"):
    """The finishing kernel of variant `v` on streams s [M, N*H] and their partials (`hc_mixes.partials`, or
    `hc_mid`'s post-block) -> (post [M, N], comb [M, N, N], collapsed [M, H], normalized with `norm` when given)."""
    m, h, n = s.shape[0], v.hidden, v.hc
    require(norm is None or norm.shape == (h,), op, f"norm must be [{h}] (the hidden size), got "
            f"{None if norm is None else list(norm.shape)}")
    post = torch.empty(m, n, dtype=torch.float32, device=s.device)
    comb = torch.empty(m, n * n, dtype=torch.float32, device=s.device)
    out = torch.empty(m, h, dtype=s.dtype, device=s.device)
    weight = () if norm is None else (norm.float().contiguous(),)
    launch("hc_pre_finish", v)(s, dots, sq, base.float().contiguous(), scale.float().contiguous(), post, comb, out,
                               *weight, float(hc_eps), float(norm_eps))
    return post, comb.view(m, n, n), out


def run(launch, streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm=None):
    m, n, h = streams.shape
    v = variant(streams, sinkhorn_iters, norm is not None)
    hc_mixes.check("hc_pre", streams, fn, base, scale, sinkhorn_iters)
    s = streams.reshape(m, n * h).contiguous()
    return finish(launch, v, s, *hc_mixes.partials(launch, "hc_pre", v, s, fn), base, scale, hc_eps, norm_eps, norm)


def example(v: Variant, rows: int, device) -> tuple:
    """hc_mixes' arguments (streams, fn, base, scale, iterations, hc_eps, norm_eps), then a norm weight for a norm
    variant."""
    args = hc_mixes.example(v, rows, device)
    return (*args, 1 + 0.1 * torch.randn(v.hidden, device=device)) if v.norm else args


OP = OpDecl(
    "hc_pre", "mHC mixes with Sinkhorn and stream collapse", reference,
    kernels=KERNELS,
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)},
    run=run, example=example,
)
