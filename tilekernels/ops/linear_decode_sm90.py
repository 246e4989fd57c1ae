"""The bf16 `linear` GEMM on sm_90a at a few decode rows of a large weight: a whole-kernel override of the portable
body for its swapped variants (up to `linear.SWAP_ROWS` rows of at least `linear.SWAP_WEIGHT` values: `linear.variant`
picks them), one group or several, split K or not. Same signature and result as the portable body, which stays the
kernel of every other target and of the other narrow variants (more rows, smaller weights: measured faster there).

Why (`benchmarks/profile_ops.py` on the H200: the portable narrow tile reached 55-69 % of the copy bandwidth at one
token; lm_head alone took 0.36 ms of a 2.27 ms V4-Flash slice step against 0.25 ms for its bytes):

- Swapped operands, as the routed experts' decode kernel (`moe_bf16_sm90`): the weight rows are the wgmma's M (64
  per consumer warpgroup) and `block_m` token rows its N, so one token costs a 64 x 16 MMA per weight tile instead
  of the portable tile's 64 x 64; the CTA is a weight stream, `stages` TMA copies of a (block_n, block_k) weight
  tile in flight on TileLang's warp-specialised pipeline.
- Token tiles are the grid's fastest index, so that the CTAs of one weight tile run side by side (rows past
  `block_m` re-read the weight tile: `benchmarks/tune_linear_decode.py` measured 2-4x slower than the narrow tile
  at 64 rows, hence the row bound).
- Split K as the variant says (`linear.split_factor`): each split's partial goes to the fp32 workspace
  [split_k, M, (G,) N] that `split_sum` reduces, exactly as the portable body.
- Before its dependency wait, each CTA asks for the first `prefetch` K steps of its weight rows into L2
  (`tilekernels/l2_prefetch.py`): its CTAs are resident while the kernel before it runs (dependent launch), and
  the weights are written by no kernel of a step (`benchmarks/tune_linear_decode.py`, H100: 0-1.3 us a projection
  at one token, BENCHMARKS.md thirteenth round).
"""

from dataclasses import dataclass

from tilekernels import l2_prefetch
from tilekernels.op import require


@dataclass(frozen=True)
class Tune:
    """`block_n` weight rows per CTA (64 per consumer warpgroup of 128 threads), `block_m` token rows per CTA (the
    wgmma N), `block_k` input features per pipeline step (64 where a split's depth is not a multiple of it),
    `stages` weight tiles in flight, `min_blocks` CTAs per SM the registers must allow (0: no bound), `prefetch` K
    steps of each weight row warmed into L2 ahead of the dependency wait (0: none). The default is the best of
    benchmarks/tune_linear_decode.py's candidates on the H200 (2026-12-02; prefetch: on the H100, 2026-12-06)."""

    block_n: int = 64
    block_m: int = 16
    block_k: int = 128
    stages: int = 4
    min_blocks: int = 2
    prefetch: int = 4


TUNE = Tune()


def fits(v) -> bool:
    """The variants this override takes: swapped (a few rows of a large weight: `linear.variant`) 16-bit variants
    whose K is whole 64-wide tiles."""
    return bool(getattr(v, "swapped", False)) and v.dtype in ("bfloat16", "float16") and v.k % 64 == 0


def body(P, v, cfg=None, tune: Tune | None = None):
    """linear's gemm for a swapped variant on sm_90a: A [M, K] (or [M, G, K]), W [N, K] (or [G, N, K]) ->
    C [M, N] (or [M, G, N]) in A's dtype, or fp32 partials [split_k, ...] when the variant splits K."""
    from tilekernels.ops import linear  # linear imports this module for its override table

    tune = tune or TUNE
    T = P.T
    N, K, G, SK, dtype = v.n, v.k, v.groups, v.split_k, v.dtype
    require(fits(v), "linear", f"the sm_90a decode kernel takes swapped 16-bit variants with K % 64 == 0, got {v}")
    require(tune.block_n % 64 == 0 and tune.block_m % 8 == 0 and tune.block_k % 64 == 0 and tune.prefetch >= 0,
            "linear", f"bad decode tile {tune}: 64 weight rows per warpgroup, token rows a multiple of 8, K steps "
            f"of 64, prefetch >= 0 steps")
    require(K % SK == 0 and (K // SK) % 64 == 0, "linear", f"K={K} cannot be split {SK} ways in 64-wide tiles")
    BN, BM = tune.block_n, tune.block_m
    BK = tune.block_k if (K // SK) % tune.block_k == 0 else 64
    KT = K // SK // BK
    NT = -(-N // BN)
    M = T.dynamic("M")
    grouped = G > 1
    a_shape, w_shape, c_shape, out_dtype = linear.operands(v, M)
    ahead = l2_prefetch.row_bytes(tune.prefetch, BK, K // SK, 2)  # bytes of each weight row warmed early

    @T.prim_func
    def kernel(A: T.Tensor(a_shape, dtype), W: T.Tensor(w_shape, dtype), C: T.Tensor(c_shape, out_dtype)):
        MT = T.ceildiv(M, BM)
        with T.Kernel(MT * SK * G * NT, threads=BN * 2) as pid:
            tx = T.get_thread_binding()
            T.import_source(l2_prefetch.SOURCE)
            if ahead and tx < BN and pid // (MT * SK * G) * BN + tx < N:  # its rows, its K slice's first steps
                if grouped:
                    T.call_extern("handle", l2_prefetch.NAME, T.address_of(
                        W[pid // (MT * SK) % G, pid // (MT * SK * G) * BN + tx, pid // MT % SK * (K // SK)]), ahead)
                else:
                    T.call_extern("handle", l2_prefetch.NAME, T.address_of(
                        W[pid // (MT * SK * G) * BN + tx, pid // MT % SK * (K // SK)]), ahead)
            if tune.min_blocks:  # registers capped for that many CTAs: no setmaxnreg reallocation between roles
                T.annotate_min_blocks_per_sm(tune.min_blocks)
                T.disable_warp_group_reg_alloc()
            w_s = T.alloc_shared((BN, BK), dtype)
            x_s = T.alloc_shared((BM, BK), dtype)
            acc = T.alloc_fragment((BN, BM), "float32")
            m0 = pid % MT * BM  # token tiles fastest: a weight tile's CTAs run together
            ks = pid // MT % SK
            g = pid // (MT * SK) % G
            n0 = pid // (MT * SK * G) * BN
            T.clear(acc)
            for kk in T.Pipelined(KT, num_stages=tune.stages):
                k0 = (ks * KT + kk) * BK
                if grouped:
                    T.copy(W[g, n0:n0 + BN, k0:k0 + BK], w_s)
                    T.copy(A[m0:m0 + BM, g, k0:k0 + BK], x_s)
                else:
                    T.copy(W[n0, k0], w_s)
                    T.copy(A[m0, k0], x_s)
                T.gemm(w_s, x_s, acc, transpose_B=True)
            for i, j in T.Parallel(BN, BM):
                if n0 + i < N and m0 + j < M:
                    if grouped and SK > 1:
                        C[ks, m0 + j, g, n0 + i] = acc[i, j]
                    elif grouped:
                        C[m0 + j, g, n0 + i] = T.cast(acc[i, j], dtype)
                    elif SK > 1:
                        C[ks, m0 + j, n0 + i] = acc[i, j]
                    else:
                        C[m0 + j, n0 + i] = T.cast(acc[i, j], dtype)

    return kernel


def trial_request(op: str, kernel: str, variant):
    """Build request of a tune trial: kernel "gemm@<field=value,...>" is this kernel with those Tune fields,
    "gemm@portable" the portable body (benchmark sweeps; module level so that build workers import it)."""
    from tilekernels.kernels import tune_request
    from tilekernels.ops import linear

    return tune_request(op, kernel, variant, body, TUNE, cfg=linear.KERNEL.config("sm90"),
                        portable=linear.body)
