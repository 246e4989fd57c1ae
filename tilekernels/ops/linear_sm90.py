"""The sm90 (Hopper) override of the bf16 `linear` GEMM at prefill sizes: TMA-fed shared tiles, warp-specialised
wgmma (TileLang adds a producer warpgroup), a 3-stage pipeline, a swizzled block order (`T.use_swizzle`: `panel`
row tiles visit the N tiles together, so the W tiles they share stay in L2) and the output tile staged in shared
memory for one coalesced (TMA) store.

It takes the variants `linear.variant` gives for more than `linear.ROW_BUCKETS[1]` rows (one group, 16-bit
operands, no split K); decode (narrow) and split-K variants keep the portable body, whose fp32 partials
`linear.gemm` sums. The tiles come from `benchmarks/tune_linear.py` on the H200 (BENCHMARKS.md)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Tiles:
    """The override's tile. `threads`: the consumer threads; `panel`: row tiles per swizzle panel (0: row-major
    block order); `stage_c`: stage the output tile in shared memory (one TMA store) instead of storing from
    registers; `min_blocks`: CTAs each SM must hold (registers capped for that many, no setmaxnreg reallocation
    between the producer and the consumers; 0: the compiler's choice, one CTA; `benchmarks/tune_linear.py`'s two-CTA
    trials, BENCHMARKS.md "Eighteenth round")."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    threads: int = 256
    panel: int = 8
    stage_c: bool = True
    min_blocks: int = 0


def supports(v) -> bool:
    """The variants this override takes: prefill rows (not narrow), one group, 16-bit operands, no split K."""
    return not v.narrow and v.split_k == 1 and v.groups == 1 and v.dtype in ("bfloat16", "float16")


def body(P, v, cfg, tiles: Tiles | None = None):
    """C [M, N] = A [M, K] @ W [N, K]^T with `tiles` (default: the target config's `large`)."""
    from tilekernels.ops.linear import edge_tile

    T = P.T
    t = tiles or cfg.large
    N, K, dtype = v.n, v.k, v.dtype
    BN, NT = edge_tile(N, t.block_n)
    BK, KT = edge_tile(K, t.block_k)
    BM = t.block_m
    M = T.dynamic("M")

    @T.prim_func
    def kernel(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(NT, T.ceildiv(M, BM), threads=t.threads) as (bx, by):
            if t.min_blocks:
                T.annotate_min_blocks_per_sm(t.min_blocks)
                T.disable_warp_group_reg_alloc()
            if t.panel:
                T.use_swizzle(t.panel)
            a_s = T.alloc_shared((BM, BK), dtype)
            b_s = T.alloc_shared((BN, BK), dtype)
            acc = T.alloc_fragment((BM, BN), "float32")
            for kk in T.Pipelined(KT, num_stages=t.stages):
                T.copy(A[by * BM, kk * BK], a_s)
                T.copy(W[bx * BN, kk * BK], b_s)
                T.gemm(a_s, b_s, acc, transpose_B=True, clear_accum=kk == 0, policy=T.GemmWarpPolicy.FullRow)
            if t.stage_c:
                c_s = T.alloc_shared((BM, BN), dtype)
                T.copy(acc, c_s)
                T.copy(c_s, C[by * BM, bx * BN])
            else:
                T.copy(acc, C[by * BM, bx * BN])

    return kernel
