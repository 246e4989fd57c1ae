"""The block-scaled FP8 GEMM on sm_90a at a few decode rows of a large weight: a whole-kernel override of `gemm_fp8`
for its swapped variants (up to `linear.SWAP_ROWS` rows of a weight of at least `linear.SWAP_WEIGHT` values, 128-deep
scale blocks: `linear_fp8.variant` picks them). Same signature and result as the narrow tile it replaces, which stays
the kernel of the other decode variants, of V4.1's 32-deep blocks and of every other target.

Why (`benchmarks/profile_ops.py --quantized` on the H100, 2026-12-06: the narrow 64 x 64 tile read V4-Flash's 16-32 MB
FP8 projections at one token at 38-63 % of the copy bandwidth, against 83-88 % for the bf16 swapped kernel):

- Swapped operands, as the bf16 decode kernel (`linear_decode_sm90`): the weight rows are the FP8 wgmma's M (64 per
  consumer warpgroup), `block_m` token rows its N (m64n16k32 instead of the narrow tile's m64n64k32 for one real row);
  the CTA is a weight stream, `stages` TMA copies of a (block_n, 128) e4m3 weight tile in flight on TileLang's
  warp-specialised pipeline, several CTAs per SM.
- One K step is one scale block (128 deep): its product goes to a fresh accumulator and is promoted into the fp32 sum
  with the weight block's scale (one per tile: 64 weight rows never straddle a 128-row scale block) and each token
  row's activation scale, as the narrow tile does (DeepSeek's fp32 "2xAcc").
- Token tiles are the grid's fastest index and split K comes from the variant (`linear.split_factor`), partials into
  the fp32 workspace that `split_sum` reduces, as every other `gemm_fp8` body.
"""

from dataclasses import dataclass

from tilekernels import l2_prefetch
from tilekernels.op import require, tuned

SCALE_K = 128  # the scale-block depth this kernel takes: one K step per block


@dataclass(frozen=True)
class Tune:
    """The default is the best of `benchmarks/tune_fp8_decode.py`'s candidates on the H100 (2026-12-06):
    `block_n` weight rows per CTA (64 per consumer warpgroup of 128 threads), `block_m` token rows per CTA (the
    wgmma N), `stages` pipeline steps in flight, each `blocks` scale blocks (128 columns) deep (1 where a split's
    blocks are not a multiple), `min_blocks` CTAs per SM the registers must allow (0: no bound)."""

    block_n: int = 64
    block_m: int = 8
    stages: int = 3
    min_blocks: int = 4
    blocks: int = 2
    prefetch: int = 3  # K steps of each weight row warmed into L2 before the dependency wait (tilekernels.l2_prefetch)


TUNE = Tune()


def fits(v) -> bool:
    """The variants this override takes: swapped (`linear_fp8.variant`) with 128-deep scale blocks and K whole
    blocks (each split too)."""
    return (bool(getattr(v, "swapped", False)) and v.block[1] == SCALE_K and v.k % SCALE_K == 0
            and (v.k // SCALE_K) % v.split_k == 0)


def body(P, v, cfg=None, tune: Tune | None = None):
    """gemm_fp8 for a swapped variant on sm_90a, `linear_fp8`'s signature: A codes (M, G*K), A scales (M, G*KB),
    W codes (G*N, K), W scales (G*NB, KB) -> C (M, G*N) in v.dtype, or fp32 partials (split_k, M, G*N)."""
    from tilekernels.ops import linear_fp8  # linear_fp8 imports this module for its override table

    tune = tune or TUNE
    T = P.T
    require(fits(v), "linear", f"the sm_90a FP8 decode kernel takes swapped variants with 128-deep scale blocks and "
            f"K a whole number of blocks per split, got {v}")
    require(tune.block_n % 64 == 0 and tune.block_m % 8 == 0, "linear",
            f"bad FP8 decode tile {tune}: 64 weight rows per warpgroup, token rows a multiple of 8")
    G, SK, K, N = v.groups, v.split_k, v.k, v.n
    BN, BM, BK = tune.block_n, tune.block_m, SCALE_K
    KB = K // BK
    SB = tune.blocks if tune.blocks == 2 and (KB // SK) % 2 == 0 else 1  # scale blocks per pipeline step
    KT = KB // SK // SB
    NT = -(-N // BN)
    M = T.dynamic("M")
    a_shape, sa_shape, w_shape, sw_shape, c_shape = linear_fp8._signature(T, v, M)
    out_dtype = "float32" if SK > 1 else v.dtype
    # one weight scale per tile: 64-row tiles of a group start on 64-row boundaries, inside one scale block row
    one_scale = v.block[0] % BN == 0 and (G == 1 or N % v.block[0] == 0)
    sdt = linear_fp8._scale_dtype(v)
    e4m3 = "float8_e4m3fn"
    ahead = l2_prefetch.row_bytes(tune.prefetch, BK * SB, K // SK, 1)  # bytes of each weight row warmed early

    @T.prim_func
    def kernel(A: T.Tensor(a_shape, "uint8"), SA: T.Tensor(sa_shape, "float32"), W: T.Tensor(w_shape, "uint8"),
               SW: T.Tensor(sw_shape, sdt), C: T.Tensor(c_shape, out_dtype)):
        MT = T.ceildiv(M, BM)
        with T.Kernel(MT * SK * G * NT, threads=BN * 2) as pid:
            tx = T.get_thread_binding()
            T.import_source(l2_prefetch.SOURCE)
            if tx < BN and pid // (MT * SK * G) * BN + tx < N:  # this CTA's weight rows, its K slice's first steps
                T.call_extern("handle", l2_prefetch.NAME, T.address_of(
                    W[pid // (MT * SK) % G * N + pid // (MT * SK * G) * BN + tx, pid // MT % SK * (K // SK)]), ahead)
            if tune.min_blocks:  # registers capped for that many CTAs: no setmaxnreg reallocation between roles
                T.annotate_min_blocks_per_sm(tune.min_blocks)
                T.disable_warp_group_reg_alloc()
            Af = T.view(A, dtype=e4m3)
            Wf = T.view(W, dtype=e4m3)
            w_s = T.alloc_shared((BN, BK), e4m3)
            x_s = T.alloc_shared((BM, BK), e4m3)
            w_s2 = T.alloc_shared((BN, BK), e4m3)  # a second scale block per step (blocks == 2)
            x_s2 = T.alloc_shared((BM, BK), e4m3)
            # the scales in the consumer threads' registers, loaded ahead of the MMA (see linear_fp8.body_native)
            sa_s = T.alloc_fragment((BM,), "float32")
            sa_s2 = T.alloc_fragment((BM,), "float32")
            sw_s = T.alloc_fragment((BN,), sdt)
            sw_s2 = T.alloc_fragment((BN,), sdt)
            ws = T.alloc_local((2,), sdt)
            part = T.alloc_fragment((BN, BM), "float32")
            part2 = T.alloc_fragment((BN, BM), "float32")
            total = T.alloc_fragment((BN, BM), "float32")
            m0 = pid % MT * BM  # token tiles fastest: a weight tile's CTAs run together
            ks = pid // MT % SK
            g = pid // (MT * SK) % G
            n0 = pid // (MT * SK * G) * BN
            T.clear(total)
            for kk in T.Pipelined(KT, num_stages=tune.stages):
                kb = (ks * KT + kk) * SB
                T.copy(Wf[g * N + n0, kb * BK], w_s)
                T.copy(Af[m0, g * K + kb * BK], x_s)
                if SB == 2:
                    T.copy(Wf[g * N + n0, kb * BK + BK], w_s2)
                    T.copy(Af[m0, g * K + kb * BK + BK], x_s2)
                for j in T.Parallel(BM):
                    sa_s[j] = SA[T.min(m0 + j, M - 1), g * KB + kb]
                if SB == 2:
                    for j in T.Parallel(BM):
                        sa_s2[j] = SA[T.min(m0 + j, M - 1), g * KB + kb + 1]
                if one_scale:
                    ws[0] = linear_fp8._weight_scale_raw(T, v, SW, g, n0, kb)
                    if SB == 2:
                        ws[1] = linear_fp8._weight_scale_raw(T, v, SW, g, n0, kb + 1)
                else:
                    for i in T.Parallel(BN):
                        sw_s[i] = linear_fp8._weight_scale_raw(T, v, SW, g, n0 + i, kb)
                    if SB == 2:
                        for i in T.Parallel(BN):
                            sw_s2[i] = linear_fp8._weight_scale_raw(T, v, SW, g, n0 + i, kb + 1)
                T.gemm(w_s, x_s, part, transpose_B=True, clear_accum=True)
                if SB == 2:
                    T.gemm(w_s2, x_s2, part2, transpose_B=True, clear_accum=True)
                if one_scale:
                    for i, j in T.Parallel(BN, BM):
                        total[i, j] += part[i, j] * (sa_s[j] * linear_fp8._scale_value(T, v, ws[0]))
                    if SB == 2:
                        for i, j in T.Parallel(BN, BM):
                            total[i, j] += part2[i, j] * (sa_s2[j] * linear_fp8._scale_value(T, v, ws[1]))
                else:
                    for i, j in T.Parallel(BN, BM):
                        total[i, j] += part[i, j] * sa_s[j] * linear_fp8._scale_value(T, v, sw_s[i])
                    if SB == 2:
                        for i, j in T.Parallel(BN, BM):
                            total[i, j] += part2[i, j] * sa_s2[j] * linear_fp8._scale_value(T, v, sw_s2[i])
            for i, j in T.Parallel(BN, BM):
                if n0 + i < N and m0 + j < M:
                    if SK > 1:
                        C[ks, m0 + j, g * N + n0 + i] = total[i, j]
                    else:
                        C[m0 + j, g * N + n0 + i] = T.cast(total[i, j], out_dtype)

    return kernel


def trial_request(op: str, kernel: str, variant):
    """Build request of a tune trial: kernel "gemm_fp8@<field=value,...>" is this kernel with those Tune fields,
    "gemm_fp8@narrow" the narrow tile it replaces (`linear_fp8.body_native` on the same variant), anything else the
    op's own (benchmark sweeps; module level so that build workers import it)."""
    from codegen import Request
    from tilekernels.kernels import request
    from tilekernels.lang import Facade
    from tilekernels.ops import linear_fp8

    if "@" not in kernel:
        return request(op, kernel, variant)
    spec = kernel.split("@", 1)[1]
    base = linear_fp8.KERNEL.config("sm90")
    if spec == "narrow":
        return Request(op, kernel, variant, lambda t: linear_fp8.body_native(Facade(t.traits), variant, base),
                       lambda t: {})
    tune = tuned(TUNE, spec)
    return Request(op, kernel, variant, lambda t: body(Facade(t.traits), variant, base, tune), lambda t: {})
