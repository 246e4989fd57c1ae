"""The FP4 routed-expert GEMM on sm_100a through Blackwell's block-scaled MMA (`tcgen05.mma ...
.kind::mxf8f6f4.block_scale`): a whole-kernel override of `grouped_gemm_fp4` with the portable body's
signature. LOWERED AND BUILT FOR sm_100a ONLY: no Blackwell GPU was available, it has never run.

W4A8, as DeepSeek's own `fp4_gemm` on Blackwell: the activations are quantized in the kernel to MXFP8 (e4m3
codes, one ue8m0 exponent per 1 x 32, `act_quant`'s rounding: scale = 2^ceil(log2(max|x| / 448))), the
weights keep their checkpoint scales (ue8m0 per 1 x 32) as the MMA's block scales, and the MMA applies both
per 32-deep K block into an fp32 accumulator in tensor memory. The e2m1 codes are widened to e4m3 bytes in
shared memory (exact: every e2m1 value is an e4m3 value): mxf8f6f4 keeps sub-byte operands in byte
containers anyway, so the widening costs no shared memory and keeps the MMA on the common MXFP8 path; the
faster `kind::mxf4` would need FP4 activations.

Operands swapped as in `moe_fp4` (sm_90a): 128 weight rows are the MMA's M, the tile's 16 (decode) or 64
(prefill) token rows its N, so decode tiles waste no M. Each K step (128 deep: four scale blocks, one uint32
of packed exponent bytes per row) stages the bytes, decodes and quantizes them in shared memory, copies the
packed scale words to tensor memory (`tcgen05.cp`, after the warp transpose the copy expects) and issues one
MMA; a simple serial schedule (no warp specialization), the correctness-first shape for a first build.
"""

from tilekernels.op import require
from tilekernels.quant import FP4_BLOCK

BN = 128  # weight rows per CTA: the MMA's M
BK = 128  # K per step: four 1 x 32 scale blocks, one packed uint32 per row
SF_ROWS = 128  # tcgen05.cp copies scale words in 128-row chunks
ONE = 0x7F7F7F7F  # four exponent bytes of 2^0: rows past the tile's tokens or weights
# Plain loads and stores into shared memory, a serial schedule: TileLang's TMA lowering and automatic warp
# specialisation are off for this kernel (they would reorder the explicit tcgen05 protocol below).
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def fits(v) -> bool:
    """Variants this kernel takes (others keep the portable body): bf16 activations, K a whole number of
    steps, token tiles the MMA's N can be (16 <= block_m <= 128, a multiple of 16)."""
    return (v.dtype == "bfloat16" and v.k % BK == 0 and 16 <= v.block_m <= SF_ROWS and v.block_m % 16 == 0)


def e4m3_of_e2m1(T, code):
    """The e4m3 byte of an e2m1 code (low 4 bits of `code`, uint32): sign moved to bit 7; magnitudes 0, 0.5 and
    the normals (2^(e-1) * (1 + m/2) -> exponent e + 6, mantissa m << 2)."""
    mag = code & 7
    byte = T.if_then_else(mag == 0, T.uint32(0), T.if_then_else(mag == 1, T.uint32(0x30), (mag << 2) + 0x30))
    return T.cast(byte | ((code & 8) << 4), "uint8")


def body(P, v, cfg=None):
    """grouped_gemm_fp4 on sm_100a: A [MT*BM, K] bf16, W [E, N, K/2] uint8, S [E, N, K/32] uint8, TileExpert
    [MT] int32 -> C [MT*BM, N] bf16."""
    from tilekernels import fp8

    T = P.T
    N, K, E, BM, dtype = v.n, v.k, v.experts, v.block_m, v.dtype
    SB = FP4_BLOCK[1]
    require(fits(v), "moe_experts", f"the sm_100a FP4 kernel takes bf16, K a multiple of {BK} and 16-128 token "
            f"rows per tile (multiple of 16); got {v}")
    NT, KT, KP, KS = -(-N // BN), K // BK, K // 2, K // SB
    MT = T.dynamic("MT")
    e4m3 = "float8_e4m3fn"

    @T.prim_func
    def kernel(A: T.Tensor((MT * BM, K), dtype), W: T.Tensor((E, N, KP), "uint8"), S: T.Tensor((E, N, KS), "uint8"),
               TileExpert: T.Tensor((MT,), "int32"), C: T.Tensor((MT * BM, N), dtype)):
        with T.Kernel(MT * NT, threads=128) as pid:
            w_raw = T.alloc_shared((BN, BK // 2), "uint8")
            x_raw = T.alloc_shared((BM, BK), dtype)
            w_s = T.alloc_shared((BN, BK), e4m3)  # weights widened to e4m3: the MMA's A (K-major)
            x_s = T.alloc_shared((BM, BK), e4m3)  # activations quantized: its B (K-major)
            sfw_s = T.alloc_shared((SF_ROWS,), "uint32")
            sfx_s = T.alloc_shared((SF_ROWS,), "uint32")
            c_tmem = T.alloc_tmem([BN, BM], "float32")
            sfw_tmem = T.alloc_tmem([SF_ROWS, 4], "uint32")
            sfx_tmem = T.alloc_tmem([SF_ROWS, 4], "uint32")
            c_frag = T.alloc_fragment((BN, BM), "float32")
            amax = T.alloc_local((4,), "float32")
            expo = T.alloc_local((4,), "int32")
            mbar = T.alloc_barrier(1)
            tx = T.get_thread_binding()
            expert = TileExpert[pid // NT]
            m0 = pid // NT * BM
            n0 = pid % NT * BN
            if expert >= 0:
                for ko in T.serial(KT):
                    T.copy(W[expert, n0:n0 + BN, ko * (BK // 2):(ko + 1) * (BK // 2)], w_raw)  # rows past N: zeros
                    T.copy(A[m0:m0 + BM, ko * BK:(ko + 1) * BK], x_raw)
                    T.sync_threads()
                    for i in T.serial(BK // 2):  # thread tx widens weight row tx and packs its four exponents
                        byte = T.cast(w_raw[tx, i], "uint32")
                        w_s[tx, 2 * i] = T.reinterpret(e4m3_of_e2m1(T, byte), e4m3)
                        w_s[tx, 2 * i + 1] = T.reinterpret(e4m3_of_e2m1(T, byte >> 4), e4m3)
                    sfw_s[tx] = T.if_then_else(
                        n0 + tx < N,
                        T.cast(S[expert, T.min(n0 + tx, N - 1), ko * 4], "uint32")
                        | (T.cast(S[expert, T.min(n0 + tx, N - 1), ko * 4 + 1], "uint32") << 8)
                        | (T.cast(S[expert, T.min(n0 + tx, N - 1), ko * 4 + 2], "uint32") << 16)
                        | (T.cast(S[expert, T.min(n0 + tx, N - 1), ko * 4 + 3], "uint32") << 24),
                        T.uint32(ONE))
                    if tx < BM:  # thread tx quantizes token row tx: four 32-wide groups (act_quant's rounding)
                        for g in T.serial(4):
                            amax[g] = 1e-4
                            for j in T.serial(SB):
                                x = T.cast(x_raw[tx, g * SB + j], "float32")
                                amax[g] = T.max(amax[g], T.max(x, -x))
                            expo[g] = fp8.exponent_of(T, fp8.pow2_ceil(T, amax[g] / 448.0))  # >= -22 (amax >= 1e-4)
                            for j in T.serial(SB):
                                code = fp8.encode(T, T.cast(x_raw[tx, g * SB + j], "float32")
                                                  * fp8.pow2(T, -expo[g]))
                                x_s[tx, g * SB + j] = T.reinterpret(code, e4m3)
                        sfx_s[tx] = (T.cast(expo[0] + 127, "uint32") | (T.cast(expo[1] + 127, "uint32") << 8)
                                     | (T.cast(expo[2] + 127, "uint32") << 16)
                                     | (T.cast(expo[3] + 127, "uint32") << 24))
                    else:
                        sfx_s[tx] = T.uint32(ONE)
                    T.fence_proxy_async()  # generic-proxy stores above, read by the MMA and tcgen05.cp
                    T.sync_threads()
                    if tx < 32:
                        T.tcgen05_sf_warp_transpose(sfw_s)
                        T.tcgen05_sf_warp_transpose(sfx_s)
                        T.fence_proxy_async()
                        T.tcgen05_cp_warpx4(sfw_s, sfw_tmem)
                        T.tcgen05_cp_warpx4(sfx_s, sfx_tmem)
                    if 32 <= tx and tx < 64:
                        T.tcgen05_gemm_blockscaled(w_s, x_s, c_tmem, sfw_tmem, sfx_tmem, transpose_B=True,
                                                   mbar=mbar, clear_accum=ko == 0, k_start=0,
                                                   sf_a_granularity_k=SB, sf_b_granularity_k=SB)
                    T.mbarrier_wait_parity(mbar, ko % 2)
                    T.sync_threads()
                T.copy(c_tmem, c_frag)
                for i, j in T.Parallel(BN, BM):
                    if n0 + i < N:
                        C[m0 + j, n0 + i] = T.cast(c_frag[i, j], dtype)

    return kernel
