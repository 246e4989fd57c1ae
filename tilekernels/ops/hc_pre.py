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


# Rows per pass of the two kernels past this many rows (prefill): the partials kernel reads a chunk of streams from HBM
# and the finishing kernel re-reads it for the collapse; 1024 V4-Flash rows are 32 MB of streams, which stay in the
# GPU's 50 MB L2 between the two (chosen by benchmarks/hc_chunks.py; BENCHMARKS.md). Rows are independent, so a row's
# bits do not depend on the chunking.
CHUNK_ROWS = 1024

# hc_mixes' kernels, storing the collapse instead of pre: "hc_pre_split" partial mixing products of (token, part)
# tiles (on sm_90a a tensor-core GEMM: `hc_mixes_sm90`) and "hc_pre_finish" their sum per token, the tail and the
# collapse
KERNELS = hc_mixes.kernels("hc_pre", collapse=True)


def variant(streams: torch.Tensor, sinkhorn_iters: int, norm: bool = False) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    _, n, h = streams.shape
    return Variant(hc=n, hidden=h, iters=sinkhorn_iters, dtype=dtypes.name(streams.dtype),
                   split=hc_mixes.split_for(n * h), norm=norm)


def outputs(v: Variant, m: int, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (post [m, N] fp32, comb [m, N*N] fp32, collapsed [m, H]) for `m` rows of streams like `s`."""
    return (torch.empty(m, v.hc, dtype=torch.float32, device=s.device),
            torch.empty(m, v.hc * v.hc, dtype=torch.float32, device=s.device),
            torch.empty(m, v.hidden, dtype=s.dtype, device=s.device))


def finish(launch, v: Variant, s, dots, sq, base, scale, hc_eps, norm_eps, norm=None, op: str = "hc_pre", into=None):
    """The finishing kernel of variant `v` on streams s [M, N*H] and their partials (`hc_mixes.partials`, or
    `hc_mid`'s post-block) -> (post [M, N], comb [M, N, N], collapsed [M, H], normalized with `norm` when given),
    stored in `into` (`outputs`' three tensors, contiguous) when given."""
    m, h, n = s.shape[0], v.hidden, v.hc
    require(norm is None or norm.shape == (h,), op, f"norm must be [{h}] (the hidden size), got "
            f"{None if norm is None else list(norm.shape)}")
    post, comb, out = into if into is not None else outputs(v, m, s)
    weight = () if norm is None else (norm.float().contiguous(),)
    launch("hc_pre_finish", v)(s, dots, sq, base.float().contiguous(), scale.float().contiguous(), post, comb, out,
                               *weight, float(hc_eps), float(norm_eps))
    return post, comb.view(m, n, n), out


def chunked(launch, v: Variant, s, fn, base, scale, hc_eps, norm_eps, norm=None, chunk_rows: int = CHUNK_ROWS,
            make=None):
    """Both kernels on streams s [M, N*H], in passes of `chunk_rows` rows past that many (a chunk's streams are
    still in L2 when the finishing kernel re-reads them) -> `finish`'s outputs. `make(c0, c1)`, when given, first
    writes rows c0:c1 of s (`hc_mid`'s post-block: the partials then read them from L2 too)."""
    m = s.shape[0]
    require(chunk_rows > 0, "hc_pre", f"chunk_rows must be positive, got {chunk_rows}")
    into = outputs(v, m, s)
    for c0 in range(0, max(m, 1), chunk_rows):
        c1 = min(m, c0 + chunk_rows)
        if make is not None:
            make(c0, c1)
        part = s[c0:c1]
        finish(launch, v, part, *hc_mixes.partials(launch, "hc_pre", v, part, fn), base, scale, hc_eps, norm_eps,
               norm, into=tuple(x[c0:c1] for x in into))
    post, comb, out = into
    return post, comb.view(m, v.hc, v.hc), out


def run(launch, streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm=None, chunk_rows: int = CHUNK_ROWS):
    m, n, h = streams.shape
    v = variant(streams, sinkhorn_iters, norm is not None)
    hc_mixes.check("hc_pre", streams, fn, base, scale, sinkhorn_iters)
    s = streams.reshape(m, n * h).contiguous()
    return chunked(launch, v, s, fn, base, scale, hc_eps, norm_eps, norm, chunk_rows)


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
