"""mHC collapse: the N residual streams weighted by a given pre mix and summed into one sublayer input.

The kernel is the collapse half of `hc_pre`'s (`hc_mixes.mixes_body`), on its own: V4.1's single-pass mHC
collapses with the pre mix the previous sublayer computed. One tile per (token, column chunk)."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require


def reference(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, N, H], pre [T, N] (fp32) -> [T, H] in streams' dtype; the weighted sum runs in fp32."""
    return (pre.float().unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


@dataclass(frozen=True)
class Variant:
    hc: int  # N streams
    hidden: int  # H
    dtype: str


@dataclass(frozen=True)
class Config:
    chunk: int = 512  # columns per tile
    threads: int = 128


def body(P, v: Variant, cfg: Config):
    T = P.T
    N, H, dtype = v.hc, v.hidden, v.dtype
    BH = min(cfg.chunk, H)
    NB = -(-H // BH)  # the last chunk is partial when BH does not divide H
    M = T.dynamic("M")

    def weighted(pre, s, j):  # the same sum, in the same order, as hc_pre's collapse
        total = pre[0] * T.cast(s[j], "float32")
        for n in range(1, N):
            total = total + pre[n] * T.cast(s[n * BH + j], "float32")
        return total

    def weighted_global(pre, S, row, h):
        total = pre[0] * T.cast(S[row, h], "float32")
        for n in range(1, N):
            total = total + pre[n] * T.cast(S[row, n * H + h], "float32")
        return total

    @T.prim_func
    def kernel(S: T.Tensor((M, N * H), dtype), Pre: T.Tensor((M, N), "float32"), Out: T.Tensor((M, H), dtype)):
        with P.kernel(M * NB, cfg.threads) as pid:
            s_io = P.alloc_io((N * BH,), dtype)
            o_io = P.alloc_io((BH,), dtype)
            pre_io = P.alloc_io((N,), "float32")
            for t in P.tiles(M * NB, pid):
                row = t // NB
                h0 = (t % NB) * BH
                T.copy(Pre[row, 0:N], pre_io)
                if H % BH == 0:
                    for n in T.serial(N):
                        T.copy(S[row, n * H + h0 : n * H + h0 + BH], s_io[n * BH : (n + 1) * BH])
                    with P.vector(cfg.threads):
                        for j in T.Parallel(BH):
                            o_io[j] = T.cast(weighted(pre_io, s_io, j), dtype)
                    T.copy(o_io, Out[row, h0 : h0 + BH])
                else:  # ragged tail: straight from/to global memory, predicated on the real width
                    with P.vector(cfg.threads):
                        for j in T.Parallel(BH):
                            if h0 + j < H:
                                Out[row, h0 + j] = T.cast(weighted_global(pre_io, S, row, h0 + j), dtype)

    return kernel


KERNEL = Kernel("hc_collapse", body, configs={"default": Config(), "c": Config(chunk=64, threads=1)})


def variant(streams: torch.Tensor) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    _, n, h = streams.shape
    return Variant(hc=n, hidden=h, dtype=dtypes.name(streams.dtype))


def run(launch, streams, pre):
    m, n, h = streams.shape
    require(pre.shape == (m, n), "hc_collapse", f"pre must be [{m}, {n}], got {list(pre.shape)}")
    out = torch.empty(m, h, dtype=streams.dtype, device=streams.device)
    launch("hc_collapse", variant(streams))(streams.reshape(m, n * h).contiguous(), pre.float().contiguous(), out)
    return out


def example(v: Variant, rows: int, device) -> tuple:
    streams = torch.randn(rows, v.hc, v.hidden, device=device).to(dtypes.torch_dtype(v.dtype))
    return (streams, torch.sigmoid(torch.randn(rows, v.hc, device=device)) + 1e-6)


OP = OpDecl(
    "hc_collapse", "mHC stream collapse with a given pre mix", reference,
    kernels=(KERNEL,),
    # fp32 sums of N terms in another order; bf16: plus one bf16 ulp of the output (at most 2^-7 relative)
    tolerance={"float32": (1e-5, 1e-5), "bfloat16": (1e-5, 2**-7)},
    run=run, example=example,
)
