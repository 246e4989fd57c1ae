"""The bf16 routed-expert GEMM on sm_90a at decode sizes: a whole-kernel override of `grouped_gemm` for its
decode variants (block_m = DECODE_BLOCK_M, 16 rows per M tile: `moe_experts.variant` picks them for bf16 up to
DECODE_TOKENS tokens). Same signature and result as the portable body, which stays the kernel of every other
target and of the 64-row (prefill) variants.

Why this shape (the 64-row portable body computed 64 rows per tile for 1-2 real ones at decode):

- Swapped operands. The expert's weight rows are the wgmma's M (64 per consumer warpgroup) and the 16 rows of
  the M tile its N: the CTA computes C^T[n, t] = sum_k W[n, k] X[t, k] for `block_n` weight rows (wgmma
  m64n16k16, both operands K-major in shared memory, fp32 accumulators in registers).
- The weights are the only real traffic (50 MB per V4-Flash expert against 16 x K activations), so the CTA is
  a weight stream: `stages` TMA copies of a (block_n, block_k) weight tile in flight (TileLang's warp-specialised
  pipeline: a producer warpgroup issues the copies, the consumer warpgroup(s) run the wgmmas), several CTAs per
  SM, so that every SM keeps enough bytes in flight to cover HBM latency.
- Narrow N tiles (64 weight rows) so that one token's 6 experts already make 6 x N/64 CTAs (384 at V4-Flash
  widths: about 3 per SM, one wave), and no work at all for tiles whose expert is -1 (`moe_experts.layout`
  bounds the tile count by the experts the rows reach: 6 tiles for one token).

Ragged N and K: the copies are tensor-edge masked by TileLang (zero-filled loads), out-of-range outputs are not
stored.
"""

from dataclasses import dataclass

from tilekernels.op import require


@dataclass(frozen=True)
class Tune:
    """Tile of the sm_90a decode kernel: `block_n` weight rows per CTA (64 per consumer warpgroup of 128
    threads), `block_k` input features per pipeline step, `stages` weight tiles in flight, `min_blocks` CTAs per
    SM the registers must allow (0: no bound; V4-Flash at 1 token: 384 CTAs, 3 per SM is one wave; shared
    memory stages * (block_n + 16) * block_k * 2 bytes must fit that many too: 60 KB by default). `warp_specialized` is TileLang's default on sm_90a (TMA producer
    warpgroup); a plain cp.async pipeline would need the target's pass config, shared with the prefill body."""

    block_n: int = 64
    block_k: int = 128
    stages: int = 3
    threads: int = 128
    min_blocks: int = 3


TUNE = Tune()


def fits(v) -> bool:
    """The variants this override takes: bf16 (not FP4) with decode tiles (16 rows or fewer)."""
    return v.dtype == "bfloat16" and not getattr(v, "fp4", False) and v.block_m <= 16


def smem_bytes(v, tune: Tune = TUNE) -> int:
    """Shared memory of one CTA (the pipeline's weight and activation tiles)."""
    bk = min(tune.block_k, -(-v.k // 16) * 16)
    return tune.stages * (tune.block_n + v.block_m) * bk * 2


def body_decode(P, v, cfg=None, tune: Tune | None = None):
    """grouped_gemm for v.block_m <= 16 rows per M tile on sm_90a; the portable body's signature:
    A [MT*BM, K] bf16, W [E, N, K] bf16, TileExpert [MT] int32, C [MT*BM, N] bf16."""
    tune = tune or TUNE
    T = P.T
    N, K, E, BM, dtype = v.n, v.k, v.experts, v.block_m, v.dtype
    require(fits(v), "moe_experts", f"the sm_90a bf16 decode kernel takes bf16 16-row tiles, got {v}")
    require(tune.block_n % 64 == 0 and tune.threads == tune.block_n * 2 and tune.block_k % 16 == 0,
            "moe_experts", f"bad decode tile {tune}: 64 weight rows per warpgroup of 128 threads")
    BN = tune.block_n
    BK = min(tune.block_k, -(-K // 16) * 16)  # a K narrower than the step: one 16-aligned step (edge zero-filled)
    NT, KT = -(-N // BN), -(-K // BK)
    MT = T.dynamic("MT")

    @T.prim_func
    def kernel(A: T.Tensor((MT * BM, K), dtype), W: T.Tensor((E, N, K), dtype), TileExpert: T.Tensor((MT,), "int32"),
               C: T.Tensor((MT * BM, N), dtype)):
        with T.Kernel(MT * NT, threads=tune.threads) as pid:
            if tune.min_blocks:  # registers capped for that many CTAs: no setmaxnreg reallocation between roles
                T.annotate_min_blocks_per_sm(tune.min_blocks)
                T.disable_warp_group_reg_alloc()
            w_s = T.alloc_shared((BN, BK), dtype)
            x_s = T.alloc_shared((BM, BK), dtype)
            acc = T.alloc_fragment((BN, BM), "float32")
            m0 = pid // NT * BM
            n0 = pid % NT * BN
            if TileExpert[pid // NT] >= 0:
                T.clear(acc)
                for kk in T.Pipelined(KT, num_stages=tune.stages):
                    T.copy(W[TileExpert[pid // NT], n0, kk * BK], w_s)
                    T.copy(A[m0, kk * BK], x_s)
                    T.gemm(w_s, x_s, acc, transpose_B=True)
                for i, j in T.Parallel(BN, BM):
                    if n0 + i < N:
                        C[m0 + j, n0 + i] = T.cast(acc[i, j], dtype)

    return kernel


# Launched without dependent launch (`tilekernels.kernels.plain_launch`): with it, the GPU hung in eager prefills
# of 64-token prompts, and tools/kernel_watchdog.py named this kernel (the down projection, K 2048, after swiglu; on
# the H100), while the same prefills with every kernel launched plainly never hung (tools/no_dependent_launch.py;
# BENCHMARKS.md, twenty-fifth round). The cause inside the kernel is not known. With this kernel plain and every other
# one dependent, the same table completed twice on the H100 (twenty-sixth round).
body_decode.plain_launch = True


def trial_request(op: str, kernel: str, variant):
    """Build request of a tune trial: kernel "grouped_gemm@<field=value,...>" is this kernel with those Tune
    fields (benchmark sweeps; module level so that build workers import it), anything else the op's own."""
    from tilekernels.kernels import tune_request

    return tune_request(op, kernel, variant, body_decode, TUNE)
