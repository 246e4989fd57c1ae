"""The sum of a split-K GEMM's fp32 partials [split, M, C] -> [M, C] in the output dtype, in one kernel (PyTorch's
`partial.sum(0).to(dtype)` launches two: a reduction and a cast; at decode a step runs dozens of split GEMMs).
The slices are added in order 0..split-1: the result depends on the partials only. A kernel of the `linear` op
(its bf16 and FP8 GEMMs both split K at decode sizes); not an op of its own."""

import math
from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel


@dataclass(frozen=True)
class Variant:
    split: int  # K slices
    columns: int  # C: the output's columns (groups x N)
    dtype: str  # the output's


@dataclass(frozen=True)
class Config:
    block: int = 512  # columns per tile
    threads: int = 128


def body(P, v: Variant, cfg: Config):
    T = P.T
    SK, C, dtype = v.split, v.columns, v.dtype
    B = min(cfg.block, C)
    NB = -(-C // B)  # the last block is partial when B does not divide C: its lanes past C are predicated off
    M = T.dynamic("M")

    def total(W, row, col):
        acc = W[0, row, col]
        for s in range(1, SK):
            acc = acc + W[s, row, col]
        return acc

    @T.prim_func
    def kernel(W: T.Tensor((SK, M, C), "float32"), Y: T.Tensor((M, C), dtype)):
        with P.kernel(M * NB, cfg.threads) as pid:
            for t in P.tiles(M * NB, pid):
                row = t // NB
                col = t % NB * B
                with P.vector(cfg.threads):
                    for j in T.Parallel(B):
                        if C % B == 0:
                            Y[row, col + j] = T.cast(total(W, row, col + j), dtype)
                        elif col + j < C:
                            Y[row, col + j] = T.cast(total(W, row, col + j), dtype)

    return kernel


KERNEL = Kernel("split_sum", body, configs={"default": Config(), "c": Config(block=64, threads=1)})


def reduce(launch, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partial [split, M, ...] fp32 -> [M, ...] in `dtype`; `launch` is the `linear` op's launcher."""
    split, m = partial.shape[:2]
    out = torch.empty(partial.shape[1:], dtype=dtype, device=partial.device)
    columns = math.prod(partial.shape[2:])
    v = Variant(split, columns, dtypes.name(dtype))
    if m:
        launch("split_sum", v)(partial.view(split, m, columns), out.view(m, columns))
    return out
