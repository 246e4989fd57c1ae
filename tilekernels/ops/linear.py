"""Dense linear layer without bias: y = x @ w^T, the bf16 GEMM of every projection.

The kernel is a grouped GEMM: with `groups` g it computes g independent products side by side
(C[:, i*N:(i+1)*N] = A[:, i*K:(i+1)*K] @ W[i*N:(i+1)*N]^T), which is also the grouped output projection.
"""

from dataclasses import dataclass, field

import torch

from tilekernels import dtypes
from tilekernels.op import Arg, Kernel, OpDecl, require


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N]."""
    return torch.nn.functional.linear(x, weight)


@dataclass(frozen=True)
class Variant:
    n: int  # output features per group
    k: int  # input features per group
    dtype: str
    groups: int = 1


@dataclass(frozen=True)
class Config:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    stages: int = 3
    threads: int = 128
    pass_configs: dict = field(default_factory=dict, hash=False, compare=False)


def body(P, v: Variant, cfg: Config):
    T = P.T
    N, K, G, dtype = v.n, v.k, v.groups, v.dtype
    BM, BN, BK = cfg.block_m, min(cfg.block_n, N), min(cfg.block_k, K)
    NT, KT = N // BN, K // BK
    M = T.dynamic("M")

    @T.prim_func
    def kernel(A: T.Tensor((M, G * K), dtype), W: T.Tensor((G * N, K), dtype), C: T.Tensor((M, G * N), dtype)):
        MT = T.ceildiv(M, BM)
        with P.kernel(MT * NT * G, cfg.threads) as pid:
            a_op = P.alloc_operand((BM, BK), dtype)
            b_op = P.alloc_operand((BN, BK), dtype)
            acc = P.alloc_acc((BM, BN), "float32")
            for t in P.tiles(MT * NT * G, pid):
                g = t % G  # group-minor: consecutive tiles share the A rows of one M tile
                m0 = t // (NT * G) * BM
                n0 = (t // G) % NT * BN
                for kk in T.Pipelined(KT, num_stages=cfg.stages):
                    T.copy(A[m0, g * K + kk * BK], a_op)
                    T.copy(W[g * N + n0, kk * BK], b_op)
                    P.gemm(a_op, b_op, acc, clear_accum=kk == 0)
                P.store_acc(acc, C[m0, g * N + n0])

    return kernel


_LARGE = Config(block_m=128, block_n=256, block_k=64, stages=3, threads=256)
KERNEL = Kernel("gemm", body, configs={
    "default": Config(),
    "sm90": Config(block_m=128, block_n=128, block_k=64, stages=3, threads=256),
    "sm100": Config(block_m=128, block_n=128, block_k=64, stages=3, threads=256),
    "ascend": Config(block_m=128, block_n=128, block_k=64, stages=2, threads=0),
    "cpu": Config(block_m=16, block_n=16, block_k=16, stages=0, threads=1),
})


def check_blocks(op: str, v: Variant) -> None:
    cfg = Config()
    require(v.n % min(cfg.block_n, v.n) == 0 and v.k % min(cfg.block_k, v.k) == 0, op,
            f"N={v.n} and K={v.k} must be multiples of the tile ({cfg.block_n}, {cfg.block_k}) or below it")


def run(launch, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    require(x.shape[-1] == weight.shape[1], "linear", f"x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    require(x.dtype == weight.dtype, "linear", f"x is {x.dtype} but weight is {weight.dtype}")
    v = Variant(n=weight.shape[0], k=weight.shape[1], dtype=dtypes.name(x.dtype))
    check_blocks("linear", v)
    rows = x.reshape(-1, v.k).contiguous()
    y = torch.empty(rows.shape[0], v.n, dtype=x.dtype, device=x.device)
    launch("gemm", v)(rows, weight.contiguous(), y)
    return y.view(*x.shape[:-1], v.n)


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
