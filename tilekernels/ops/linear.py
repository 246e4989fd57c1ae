"""Dense linear layer without bias: y = x @ w^T, the bf16 GEMM of every projection.

The kernel is a grouped GEMM: with `groups` g it computes g independent products side by side
(C[:, i, :] = A[:, i, :] @ W[i]^T). With one group it sees plain 2-D tensors A (M, K), W (N, K), C (M, N);
with more it sees 3-D views A (M, G, K), W (G, N, K), C (M, G, N), so that every dimension is bounds-checked
on its own and a ragged tile edge neither reads the next group's rows nor writes its outputs.

Any N and K: tiles keep the config's sizes (tensor-core shapes) and are launched ceil-div over N and K; the
last tile of a dimension runs past the tensor and TileLang masks it (bound checks on SIMT copies, zero fill of
TMA boxes), so the out-of-range K columns of both operands read as zero and out-of-range outputs are not
stored. A dimension smaller than the tile gets a tile rounded up to a multiple of 16 instead (less waste, still
a tensor-core shape). When N and K divide the tile no check is emitted: the big shapes cost nothing extra.

On sm90 the prefill variants (one group of 16-bit operands, more than ROW_BUCKETS[1] rows) run the override in
`linear_sm90` (swizzled wgmma tiles, the output staged for a TMA store), the swapped 16-bit variants (a few decode
rows of a large weight: `SWAP_ROWS`) the one in `linear_decode_sm90` (weight rows as the wgmma's M, token rows as
its N).
"""

from dataclasses import dataclass, field

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, Override, require
from tilekernels.ops import linear_decode_sm90, linear_fp8, linear_sm90, split_sum
from tilekernels.ops.linear_sm90 import Tiles
from tilekernels.quant import BlockQuantized, dense


def reference(x: torch.Tensor, weight: torch.Tensor | BlockQuantized) -> torch.Tensor:
    """x [..., K], weight [N, K] (plain, or block-quantized: dequantized to x's dtype) -> [..., N]."""
    return torch.nn.functional.linear(x, dense(weight, x.dtype))


@dataclass(frozen=True)
class Variant:
    n: int  # output features per group
    k: int  # input features per group
    dtype: str
    groups: int = 1
    split_k: int = 1  # >1: each tile sums a slice of K into an fp32 workspace [split_k, M, G, N]
    narrow: bool = False  # few rows (decode): 64x64 tiles so that more programs share the weight stream
    swapped: bool = False  # a few rows of a large weight (`SWAP_ROWS`, `SWAP_WEIGHT`): narrow, and on sm_90a the
    # weight rows are the MMA's M (`linear_decode_sm90`); the portable body reads it as any narrow variant


@dataclass(frozen=True)
class Config:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    stages: int = 3
    threads: int = 128
    narrow_threads: int = 128  # 64-row tiles: four warps cover 64 rows of wgmma/mma
    min_block_n: int = 16  # the narrowest N tile the target's MMA takes (sm_100a 64-row tcgen05 needs 64)
    fp32_block_k: int = 0  # K tile of fp32 operands (0: block_k): their tiles take twice the shared memory
    large: Tiles | None = None  # the sm90 override's tile at prefill rows (linear_sm90.py); None elsewhere
    short: Tiles | None = None  # ... instead of `large` where K <= short_k (`linear_sm90.body` says why)
    short_k: int = 0
    pass_configs: dict = field(default_factory=dict, hash=False, compare=False)


MIN_TILE = 16  # the smallest tile edge: a multiple of every tensor-core instruction's N and K granule


def edge_tile(total: int, tile: int, smallest: int = MIN_TILE) -> tuple[int, int]:
    """(block, count) covering `total` with ceil-div blocks of `tile`; when `total` is smaller than the tile, one
    block of `total` rounded up to a multiple of `smallest` (never above `tile`). Shared with moe_experts."""
    block = min(tile, -(-total // smallest) * smallest)
    return block, -(-total // block)


def shape(v: Variant, cfg: Config) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, n_tiles, block_k, k_tiles_per_split) of variant `v` built with `cfg`."""
    BM = min(cfg.block_m, 64) if v.narrow else cfg.block_m
    BN, NT = edge_tile(v.n, min(cfg.block_n, 64) if v.narrow else cfg.block_n, cfg.min_block_n)
    BK, KB = edge_tile(v.k, cfg.fp32_block_k if v.dtype == "float32" and cfg.fp32_block_k else cfg.block_k)
    require(KB % v.split_k == 0, "linear", f"K={v.k} in {KB} tiles of {BK} cannot be split {v.split_k} ways")
    return BM, BN, NT, BK, KB // v.split_k


def operands(v: Variant, M) -> tuple[tuple, tuple, tuple, str]:
    """The kernel's tensor shapes for `M` rows (A, W, C) and C's dtype: 2-D with one group, 3-D views with more
    (each dimension bounds-checked on its own); split K writes fp32 partials [split_k, ...]."""
    N, K, G, SK = v.n, v.k, v.groups, v.split_k
    split = (SK,) if SK > 1 else ()
    if G > 1:
        return (M, G, K), (G, N, K), split + (M, G, N), "float32" if SK > 1 else v.dtype
    return (M, K), (N, K), split + (M, N), "float32" if SK > 1 else v.dtype


def body(P, v: Variant, cfg: Config):
    T = P.T
    G, SK, dtype = v.groups, v.split_k, v.dtype
    BM, BN, NT, BK, KT = shape(v, cfg)
    M = T.dynamic("M")
    grouped = G > 1
    a_shape, w_shape, c_shape, out_dtype = operands(v, M)

    @T.prim_func
    def kernel(A: T.Tensor(a_shape, dtype), W: T.Tensor(w_shape, dtype), C: T.Tensor(c_shape, out_dtype)):
        MT = T.ceildiv(M, BM)
        with P.kernel(MT * NT * G * SK, cfg.narrow_threads if v.narrow else cfg.threads) as pid:
            a_op = P.alloc_operand((BM, BK), dtype)
            b_op = P.alloc_operand((BN, BK), dtype)
            acc = P.alloc_acc((BM, BN), "float32", operands=dtype)
            for t in P.tiles(MT * NT * G * SK, pid):
                ks = t % SK  # split-minor, then group-minor: neighbours share A rows
                g = t // SK % G
                m0 = t // (SK * NT * G) * BM
                n0 = (t // (SK * G)) % NT * BN
                for kk in T.Pipelined(KT, num_stages=cfg.stages):
                    k0 = (ks * KT + kk) * BK
                    if grouped:
                        T.copy(A[m0:m0 + BM, g, k0:k0 + BK], a_op)
                        T.copy(W[g, n0:n0 + BN, k0:k0 + BK], b_op)
                    else:
                        T.copy(A[m0, k0], a_op)
                        T.copy(W[n0, k0], b_op)
                    P.gemm(a_op, b_op, acc, clear_accum=kk == 0)
                if grouped and SK > 1:
                    P.store_acc(acc, C[ks, m0:m0 + BM, g, n0:n0 + BN])
                elif grouped:
                    P.store_acc(acc, C[m0:m0 + BM, g, n0:n0 + BN])
                elif SK > 1:
                    P.store_acc(acc, C[ks, m0, n0])
                else:
                    P.store_acc(acc, C[m0, n0])

    return kernel


_CPU = Config(block_m=16, block_n=16, block_k=16, stages=0, threads=1, narrow_threads=1)
KERNEL = Kernel("gemm", body, configs={
    "default": Config(),
    # benchmarks/tune_gemm.py; fp32 (V4.1's ratio-2 compressor) at half the K depth: 3 stages of 256x64 + 128x64
    # fp32 tiles would need 288 KB of shared memory (the SM has 227)
    # the override's prefill tile (one group, 16-bit, no split K) from benchmarks/tune_linear.py
    "sm90": Config(block_m=256, block_n=128, block_k=64, stages=3, threads=256, fp32_block_k=32, large=Tiles(),
                   short=Tiles(block_n=256, stages=3, panel=16, programs=132), short_k=2048),
    "sm100": Config(block_m=128, block_n=128, block_k=64, stages=3, threads=256, min_block_n=64, fp32_block_k=32),
    "ascend": Config(block_m=128, block_n=128, block_k=64, stages=2, threads=0),
    "c": _CPU,
}, overrides=(Override("sm90", linear_decode_sm90.fits, linear_decode_sm90.body),
               Override("sm90", linear_sm90.supports, linear_sm90.body)))


TARGET_PROGRAMS = 256  # split K until about this many programs run (small GEMMs stream the weight)
ROW_BUCKETS = (64, 511)  # decode-sized (narrow tiles) | medium (split K) | large (plain)
# up to SWAP_ROWS rows a weight of at least SWAP_WEIGHT values (all groups) takes the swapped decode variant:
# benchmarks/tune_linear_decode.py on the H200 (2026-12-02), swapped against the narrow tile: lm_head 245 / 417 us
# at one row, 244 / 383 at 4, the 16-67 MB projections 8-22 % faster at 1-4 rows; the 4-8 MB ones slower, and at
# 16 rows and more the narrow tile is as fast or faster (64 rows: 2-4x)
SWAP_ROWS = 8
SWAP_WEIGHT = 8 << 20


def variant(rows: int, n: int, k: int, groups: int = 1, dtype: str = "bfloat16", invariant: bool = False) -> Variant:
    """The one place the GEMM variant of a call is chosen, by row bucket, so a model needs three variants per
    projection at most (four for a large weight: up to `SWAP_ROWS` rows its swapped variant): up to 64 rows use
    64x64 tiles; up to 511 rows use the wide tiles; both split K (a power of two, each slice at least 256 deep and
    a whole number of 64-wide K tiles) until there are enough programs; from 512 rows on, the row tiles alone are enough. Ragged K never splits. `invariant`: the split is
    the decode bucket's at every row count (a row's K order is then a function of the shape alone; the tile still
    follows the rows, which changes no row's sum: tests/gpu/test_batch_invariance_gpu.py)."""
    k_tiles = k // 64 if k % 64 == 0 else 1
    narrow = rows <= ROW_BUCKETS[0]
    if invariant:
        return Variant(n, k, dtype, groups, split_factor(True, n, k, groups, k_tiles), narrow)
    if rows > ROW_BUCKETS[1]:
        return Variant(n, k, dtype, groups)
    swapped = rows <= SWAP_ROWS and n * k * groups >= SWAP_WEIGHT
    return Variant(n, k, dtype, groups, split_factor(narrow, n, k, groups, k_tiles), narrow, swapped)


def split_factor(narrow: bool, n: int, k: int, groups: int, k_tiles: int) -> int:
    """K splits (a power of two) of a decode- or medium-sized GEMM: doubled while fewer than TARGET_PROGRAMS
    programs run, each slice stays >= 256 deep and `k_tiles` (the K tiles a slice must hold whole) divides.
    Shared by the bf16 and the FP8 GEMM."""
    programs = (1 if narrow else 2) * max(1, n // (64 if narrow else 128)) * groups
    split = 1
    while programs * split * 2 <= TARGET_PROGRAMS and k // (split * 2) >= 256 and k_tiles % (split * 2) == 0:
        split *= 2
    return split


def gemm(launch, a: torch.Tensor, weight: torch.Tensor, v: Variant) -> torch.Tensor:
    """a [M, K] @ weight [N, K]^T -> [M, N] (groups 1), or a [M, G, K] with weight [G, N, K] -> [M, G, N]
    (per-group products), in a's dtype; split K sums an fp32 workspace [split_k, ...] afterwards (`split_sum`)."""
    out_shape = (*a.shape[:-1], v.n)
    if v.split_k == 1:
        y = torch.empty(out_shape, dtype=a.dtype, device=a.device)
        launch("gemm", v)(a, weight, y)
        return y
    partial = torch.empty((v.split_k, *out_shape), dtype=torch.float32, device=a.device)
    launch("gemm", v)(a, weight, partial)
    return split_sum.reduce(launch, partial, a.dtype)


def run(launch, x: torch.Tensor, weight: torch.Tensor | BlockQuantized) -> torch.Tensor:
    if isinstance(weight, BlockQuantized):  # FP8 checkpoint weight: W8A8 block-scaled GEMM
        y = linear_fp8.gemm(launch, x.reshape(-1, x.shape[-1]), weight)
        return y.view(*x.shape[:-1], y.shape[-1])
    require(x.shape[-1] == weight.shape[1], "linear", f"x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    require(x.dtype == weight.dtype, "linear", f"x is {x.dtype} but weight is {weight.dtype}")
    n, k = weight.shape
    a = x.reshape(-1, k).contiguous()
    y = gemm(launch, a, weight.contiguous(), variant(a.shape[0], n, k, 1, dtypes.name(x.dtype), getattr(launch, "invariant", False)))
    return y.view(*x.shape[:-1], n)


def example(v: Variant | linear_fp8.Variant, rows: int, device) -> tuple:
    """Reference args of `linear` for a one-group variant: x [rows, k], weight [n, k] scaled to unit outputs
    (FP8 with the variant's block for an FP8 variant). Grouped variants run through `grouped_linear.example`."""
    if v.groups != 1:
        raise ValueError(f"linear: a variant with groups={v.groups} runs through grouped_linear; use its example")
    dtype = dtypes.torch_dtype(v.dtype)
    if isinstance(v, linear_fp8.Variant):
        return (torch.randn(rows, v.k, device=device).to(dtype), linear_fp8.example_weight(v, v.n, device))
    return (torch.randn(rows, v.k, device=device).to(dtype), (torch.randn(v.n, v.k, device=device) / v.k**0.5).to(dtype))


OP = OpDecl(
    "linear", "dense projection y = x @ W^T", reference,
    kernels=(KERNEL, linear_fp8.KERNEL, split_sum.KERNEL),
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)},
    run=run, example=example, uses=("act_quant",),
    row_samples=(SWAP_ROWS + 1, ROW_BUCKETS[0] + 1, ROW_BUCKETS[1] + 1),
)
