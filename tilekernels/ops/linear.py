"""Dense linear layer without bias: y = x @ w^T, the bf16 GEMM of every projection.

The kernel is a grouped GEMM: with `groups` g it computes g independent products side by side
(C[:, i*N:(i+1)*N] = A[:, i*K:(i+1)*K] @ W[i*N:(i+1)*N]^T), which is also the grouped output projection.
"""

from dataclasses import dataclass, field

import torch

from tilekernels import dtypes
from tilekernels.op import Arg, Kernel, OpDecl, require, tiles


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N]."""
    return torch.nn.functional.linear(x, weight)


@dataclass(frozen=True)
class Variant:
    n: int  # output features per group
    k: int  # input features per group
    dtype: str
    groups: int = 1
    split_k: int = 1  # >1: each tile sums a slice of K into an fp32 workspace [split_k, M, G*N]
    narrow: bool = False  # few rows (decode): 64x64 tiles so that more programs share the weight stream


@dataclass(frozen=True)
class Config:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    stages: int = 3
    threads: int = 128
    narrow_threads: int = 128  # 64-row tiles: four warps cover 64 rows of wgmma/mma
    pass_configs: dict = field(default_factory=dict, hash=False, compare=False)


def body(P, v: Variant, cfg: Config):
    T = P.T
    N, K, G, SK, dtype = v.n, v.k, v.groups, v.split_k, v.dtype
    BM = min(cfg.block_m, 64) if v.narrow else cfg.block_m
    BN, NT = tiles(N, min(cfg.block_n, 64) if v.narrow else cfg.block_n, "linear", "N")
    BK, KB = tiles(K, cfg.block_k, "linear", "K")
    require(KB % SK == 0, "linear", f"K={K} in {KB} tiles of {BK} cannot be split {SK} ways")
    KT = KB // SK
    M = T.dynamic("M")
    out_shape, out_dtype = ((SK, M, G * N), "float32") if SK > 1 else ((M, G * N), dtype)

    @T.prim_func
    def kernel(A: T.Tensor((M, G * K), dtype), W: T.Tensor((G * N, K), dtype), C: T.Tensor(out_shape, out_dtype)):
        MT = T.ceildiv(M, BM)
        with P.kernel(MT * NT * G * SK, cfg.narrow_threads if v.narrow else cfg.threads) as pid:
            a_op = P.alloc_operand((BM, BK), dtype)
            b_op = P.alloc_operand((BN, BK), dtype)
            acc = P.alloc_acc((BM, BN), "float32")
            for t in P.tiles(MT * NT * G * SK, pid):
                ks = t % SK  # split-minor, then group-minor: neighbours share A rows
                g = t // SK % G
                m0 = t // (SK * NT * G) * BM
                n0 = (t // (SK * G)) % NT * BN
                for kk in T.Pipelined(KT, num_stages=cfg.stages):
                    T.copy(A[m0, g * K + (ks * KT + kk) * BK], a_op)
                    T.copy(W[g * N + n0, (ks * KT + kk) * BK], b_op)
                    P.gemm(a_op, b_op, acc, clear_accum=kk == 0)
                if SK > 1:
                    P.store_acc(acc, C[ks, m0, g * N + n0])
                else:
                    P.store_acc(acc, C[m0, g * N + n0])

    return kernel


KERNEL = Kernel("gemm", body, configs={
    "default": Config(),
    "sm90": Config(block_m=256, block_n=128, block_k=64, stages=3, threads=256),  # benchmarks/tune_gemm.py
    "sm100": Config(block_m=128, block_n=128, block_k=64, stages=3, threads=256),
    "ascend": Config(block_m=128, block_n=128, block_k=64, stages=2, threads=0),
    "cpu": Config(block_m=16, block_n=16, block_k=16, stages=0, threads=1, narrow_threads=1),
})


TARGET_PROGRAMS = 256  # split K until about this many programs run (small GEMMs stream the weight)
ROW_BUCKETS = (64, 511)  # decode-sized (narrow tiles) | medium (split K) | large (plain)


def plan(rows: int, n: int, k: int, groups: int = 1) -> tuple[bool, int]:
    """(narrow, split_k) by row bucket, so a model needs three variants per projection at most: up to 64 rows
    use 64x64 tiles; up to 511 rows use the wide tiles; both split K (a power of two, each slice at least 256
    deep) until there are enough programs; from 512 rows on, the row tiles alone are enough."""
    if rows > ROW_BUCKETS[1]:
        return False, 1
    narrow = rows <= ROW_BUCKETS[0]
    tiles = (1 if narrow else 2) * max(1, n // (64 if narrow else 128)) * groups
    split = 1
    while tiles * split * 2 <= TARGET_PROGRAMS and k // (split * 2) >= 256 and k % (split * 2 * 64) == 0:
        split *= 2
    return narrow, split


def launch_gemm(launch, a: torch.Tensor, weight: torch.Tensor, n: int, k: int, groups: int) -> torch.Tensor:
    """a [M, G*K] @ blockdiag(weight [G*N, K])^T -> [M, G*N] in a's dtype."""
    rows = a.shape[0]
    narrow, split = plan(rows, n, k, groups)
    v = Variant(n=n, k=k, dtype=dtypes.name(a.dtype), groups=groups, split_k=split, narrow=narrow)
    if split == 1:
        y = torch.empty(rows, groups * n, dtype=a.dtype, device=a.device)
        launch("gemm", v)(a, weight, y)
        return y
    partial = torch.empty(split, rows, groups * n, dtype=torch.float32, device=a.device)
    launch("gemm", v)(a, weight, partial)
    return partial.sum(0).to(a.dtype)


def run(launch, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    require(x.shape[-1] == weight.shape[1], "linear", f"x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    require(x.dtype == weight.dtype, "linear", f"x is {x.dtype} but weight is {weight.dtype}")
    n, k = weight.shape
    y = launch_gemm(launch, x.reshape(-1, k).contiguous(), weight.contiguous(), n, k, 1)
    return y.view(*x.shape[:-1], n)


def example(v: Variant, rows: int, device) -> tuple:
    dtype = dtypes.torch_dtype(v.dtype)
    return (torch.randn(rows, v.k, device=device).to(dtype), (torch.randn(v.n, v.k, device=device) / v.k**0.5).to(dtype))


OP = OpDecl(
    "linear", "dense projection y = x @ W^T", reference,
    kernels=(KERNEL,), variant=Variant,
    signature=(Arg("x", ("M", "k"), "dtype"), Arg("weight", ("n", "k"), "dtype"), Arg("y", ("M", "n"), "dtype", "out")),
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)},
    run=run, example=example,
)
