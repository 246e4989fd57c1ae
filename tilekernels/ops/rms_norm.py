"""Weighted RMSNorm, computed in fp32 with an fp32 weight, cast back to the input dtype.

The kernel also serves the unweighted norm (`rms_norm_unweighted`) and per-head norms (rows = tokens x heads).
"""


from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] (fp32) -> [..., D] in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


@dataclass(frozen=True)
class Variant:
    dim: int
    dtype: str
    weighted: bool = True


@dataclass(frozen=True)
class Config:
    threads: int = 128


def body(P, v: Variant, cfg: Config):
    T = P.T
    D, dtype = v.dim, v.dtype
    DP = P.padded(D, cfg.threads)  # register width; == D when the threads divide it (no edge code emitted)
    M = T.dynamic("M")

    def load(x_io, j):  # x[j] in fp32, 0 in the padding (adds nothing to the sum of squares)
        if DP == D:
            return T.cast(x_io[j], "float32")
        return T.if_then_else(j < D, T.cast(x_io[T.min(j, D - 1)], "float32"), 0.0)

    @T.macro
    def norm_rows(X, W, Y, eps):
        with P.kernel(M, cfg.threads) as pid:
            x_io = P.alloc_io((D,), dtype)
            w_io = P.alloc_io((D,), "float32")
            if v.weighted:
                T.copy(W[0:D], w_io)
            for row in P.tiles(M, pid):
                T.copy(X[row, 0:D], x_io)
                with P.vector(cfg.threads):
                    xf = P.alloc_reg((DP,), "float32")
                    sq = P.alloc_reg((DP,), "float32")
                    ss = P.alloc_reg((1,), "float32")
                    for j in T.Parallel(DP):
                        xf[j] = load(x_io, j)
                        sq[j] = xf[j] * xf[j]
                    T.reduce_sum(sq, ss, dim=0)
                    for j in T.Parallel(DP):
                        if v.weighted:
                            y = xf[j] * T.rsqrt(ss[0] / D + eps) * w_io[j if DP == D else T.min(j, D - 1)]
                        else:
                            y = xf[j] * T.rsqrt(ss[0] / D + eps)
                        if DP == D:
                            x_io[j] = T.cast(y, dtype)
                        else:
                            if j < D:
                                x_io[j] = T.cast(y, dtype)
                T.copy(x_io, Y[row, 0:D])

    if v.weighted:
        @T.prim_func
        def kernel(X: T.Tensor((M, D), dtype), W: T.Tensor((D,), "float32"), Y: T.Tensor((M, D), dtype), eps: T.float32):
            norm_rows(X, W, Y, eps)
    else:
        @T.prim_func
        def kernel(X: T.Tensor((M, D), dtype), Y: T.Tensor((M, D), dtype), eps: T.float32):
            norm_rows(X, None, Y, eps)
    return kernel


KERNEL = Kernel("rms_norm", body, configs={"default": Config(), "c": Config(threads=1)})


def variant(x: torch.Tensor, weight: torch.Tensor | None) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    return Variant(dim=x.shape[-1], dtype=dtypes.name(x.dtype), weighted=weight is not None)


def run(launch, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    v = variant(x, weight)
    rows = x.reshape(-1, v.dim).contiguous()
    y = torch.empty_like(rows)
    if weight is not None:
        require(weight.shape == (v.dim,) and weight.dtype == torch.float32, "rms_norm",
                f"weight must be fp32 [{v.dim}], got {weight.dtype} {list(weight.shape)}")
        launch("rms_norm", v)(rows, weight, y, float(eps))
    else:
        launch("rms_norm", v)(rows, y, float(eps))
    return y.view(x.shape)


def example(v: Variant, rows: int, device) -> tuple:
    dtype = dtypes.torch_dtype(v.dtype)
    x = torch.randn(rows, v.dim, device=device).to(dtype)
    if not v.weighted:
        return (x, None, 1e-6)
    return (x, 1.0 + 0.1 * torch.randn(v.dim, device=device), 1e-6)


OP = OpDecl(
    "rms_norm", "weighted RMSNorm (fp32 math)", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)},
    run=run, example=example,
)
