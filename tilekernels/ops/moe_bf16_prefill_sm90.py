"""The bf16 routed-expert GEMM on sm_90a at prefill sizes: a whole-kernel override of `grouped_gemm` for its
prefill variants (more than `moe_experts.DECODE_TOKENS` tokens: 64- or 128-row M tiles, each tile one expert's
rows). Same signature and result as the portable body, which stays the kernel of every other target.

The portable body computes a 64 x 128 tile with one warpgroup's synchronous MMAs on cp.async copies (~270 TFLOP/s
at 4,096 tokens on the H200). This is `linear_sm90`'s prefill GEMM over the expert layout: TMA copies of the M
tile's rows and of its expert's (block_n, block_k) weight tile (the expert index read from `TileExpert`), TileLang's
warp-specialised pipeline (a producer warpgroup, one consumer warpgroup of wgmma m64n`block_n` per 64 rows of the M
tile), and the output tile staged in shared memory for one TMA store. A tile of no expert (-1, past the last
expert's rows) does nothing. Ragged N and K are tensor edges (zero-filled loads, unstored outputs).
"""

from dataclasses import dataclass

from tilekernels.op import require

ROWS = (64, 128)  # the M tiles it takes: one consumer warpgroup per 64 rows


@dataclass(frozen=True)
class Tune:
    """`block_n` weight rows and `block_k` input features per step, `stages` tiles in flight, `panel`: M tiles per
    swizzle panel (0: row-major block order: a tile's N blocks run together and share its rows in L2),
    `stage_c`: the output through shared memory (one TMA store) instead of stores from registers."""

    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    panel: int = 0
    stage_c: int = 1


TUNE = Tune()


def fits(v) -> bool:
    """The variants this override takes: bf16 (not FP4) prefill tiles of 64 or 128 rows."""
    return v.dtype == "bfloat16" and not getattr(v, "fp4", False) and v.block_m in ROWS


def smem_bytes(v, tune: Tune = TUNE) -> int:
    """Shared memory of one CTA: the pipeline's stages and the staged output tile."""
    return tune.stages * (v.block_m + tune.block_n) * tune.block_k * 2 + tune.stage_c * v.block_m * tune.block_n * 2


def body(P, v, cfg=None, tune: Tune | None = None):
    """grouped_gemm for 64- or 128-row M tiles on sm_90a; the portable body's signature:
    A [MT*BM, K] bf16, W [E, N, K] bf16, TileExpert [MT] int32, C [MT*BM, N] bf16."""
    from tilekernels.ops.linear import edge_tile

    tune = tune or TUNE
    require(fits(v), "moe_experts", f"the sm_90a bf16 prefill kernel takes bf16 tiles of {ROWS} rows, got {v}")
    require(smem_bytes(v, tune) <= 227 * 1024, "moe_experts",
            f"tile {tune} at {v.block_m} rows needs {smem_bytes(v, tune)} bytes of shared memory; 232,448 fit")
    T = P.T
    N, K, E, BM, dtype = v.n, v.k, v.experts, v.block_m, v.dtype
    BN, NT = edge_tile(N, tune.block_n)
    BK, KT = edge_tile(K, tune.block_k)
    MT = T.dynamic("MT")

    @T.prim_func
    def kernel(A: T.Tensor((MT * BM, K), dtype), W: T.Tensor((E, N, K), dtype), TileExpert: T.Tensor((MT,), "int32"),
               C: T.Tensor((MT * BM, N), dtype)):
        with T.Kernel(NT, MT, threads=2 * BM) as (bx, by):
            if tune.panel:
                T.use_swizzle(tune.panel)
            a_s = T.alloc_shared((BM, BK), dtype)
            b_s = T.alloc_shared((BN, BK), dtype)
            acc = T.alloc_fragment((BM, BN), "float32")
            c_s = T.alloc_shared((BM, BN), dtype) if tune.stage_c else None
            if TileExpert[by] >= 0:
                for kk in T.Pipelined(KT, num_stages=tune.stages):
                    T.copy(A[by * BM, kk * BK], a_s)
                    T.copy(W[TileExpert[by], bx * BN, kk * BK], b_s)
                    T.gemm(a_s, b_s, acc, transpose_B=True, clear_accum=kk == 0, policy=T.GemmWarpPolicy.FullRow)
                if tune.stage_c:
                    T.copy(acc, c_s)
                    T.copy(c_s, C[by * BM, bx * BN])
                else:
                    T.copy(acc, C[by * BM, bx * BN])

    return kernel


def trial_request(op: str, kernel: str, variant):
    """Build request of a tune trial: "grouped_gemm@<field=value,...>" is this kernel with those Tune fields,
    "grouped_gemm@portable" the portable body with the sm90 config (benchmark sweeps; module level so that build
    workers import it)."""
    from tilekernels.kernels import tune_request
    from tilekernels.ops import moe_experts

    return tune_request(op, kernel, variant, body, TUNE, cfg=moe_experts.KERNEL.config("sm90"),
                        portable=moe_experts.body)
