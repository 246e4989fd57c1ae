"""The FP4 routed-expert GEMM on sm_90a: a whole-kernel override of `grouped_gemm_fp4` for its bf16 variants,
written for decode (block_m 16: `moe_experts.run` picks them up to DECODE_TOKENS tokens) and run with a
deeper-row tile at prefill sizes (block_m 64, `PREFILL_TUNE`). Same signature and result as the portable body,
which stays the kernel of every other target.

Why this shape (the portable body ran at 0.5-2.8 % of the H200's copy bandwidth at 1-64 tokens):

- Swapped operands. At decode an expert sees 1-8 rows, so a 64-row M tile is mostly padding and the tensor core
  only waits on the weight stream. Here the weight rows are the MMA's M (64 per warpgroup: wgmma m64n16k16) and
  the 16 rows of the M tile its N: the CTA computes C^T[n, t] = sum_k W[n, k] X[t, k] for `block_n` weight rows.
- The converted weights never touch shared memory. Weight bytes and activations are staged by a `stages`-deep
  cp.async pipeline (or TMA producer warps with `warp_specialized`); each thread decodes exactly the values its
  wgmma A fragment holds into registers (an RS GEMM). A shared bf16 tile written and read back would cost
  ~4.5 bytes of shared traffic per weight: about the SM's whole shared bandwidth at HBM speed.
- The CTA's exponents for all of K are loaded once (one byte per 32 values), not per K step.
- Swizzled staging tiles: each thread reads one byte of 8 different rows at a time; with plain 128-byte rows all
  8 sit in one bank (an 8-way conflict that alone capped the kernel at ~25 % of HBM speed).
- Cheap exact decode, no exp2 and no branches: see PAIR_SOURCE ("pair", ~5 instructions per value pair) and
  `decode` ("half", one value at a time through fp16 and fp32).
- Occupancy: registers bounded for `min_blocks` CTAs per SM (2-4 CTAs share an SM, so one CTA's decode overlaps
  another's copies), and no work at all for tiles whose expert is -1 (`moe_experts.layout` also bounds the tile
  count by the experts the rows reach: 6 tiles for one token, not 256).

Ragged N and K: out-of-range weight rows and K columns load as zero bytes (+0 values) and zero activations;
out-of-range outputs are not stored.
"""

from dataclasses import dataclass

from tilekernels.op import require
from tilekernels.quant import FP4_BLOCK


@dataclass(frozen=True)
class Tune:
    """Tile shape of the sm_90a decode kernel: `block_n` weight rows per CTA (64 per warpgroup of 128 threads),
    `block_k` input features per pipeline step (a multiple of 32), `stages` copies in flight, the decoder:
    "pair" (both codes of a byte to bf16x2: two integer multiplies, two masks, two bf16x2 multiplies) or "half"
    (one value at a time through fp16 and fp32), and how the copies run (TMA producer warps or cp.async).
    "kperm" / "kperm1" (candidates, `moe_fp4_sm90`): weights and exponents repacked once (`repack_for`) so that
    each thread decodes 16-byte vectors, with two / one bf16x2 multiplies per pair (kperm1: exponents <= 128)."""

    block_n: int = 64
    block_k: int = 256
    stages: int = 4
    threads: int = 128
    decode: str = "pair"
    warp_specialized: bool = False  # TMA producer warps + consumer warpgroup(s), or every thread does both
    min_blocks: int = 3  # CTAs per SM the registers must allow (__launch_bounds__)

    @property
    def repacked(self) -> bool:
        """Whether the kernel takes `repack_for`'s K-permuted weights instead of the plain ones."""
        return self.decode in KPERM

    @property
    def pass_configs(self) -> dict:
        return {} if self.warp_specialized else {"tl.disable_warp_specialized": True}


KPERM = ("kperm", "kperm1")  # decoders of moe_fp4_sm90's kernel (repacked weights)
TUNE = Tune()  # the default (from the sweep of benchmarks/fp4_experts.py)
# Prefill sizes (64-row tiles, wgmma n64): the same kernel with a shallower K step and one stage less, so that
# three CTAs' staging (64-row activation tiles, ~60 KB each) still fit an SM. The portable body it replaced took
# 62 ms for a V4-Flash layer at 4096 tokens, this 6.9 (BENCHMARKS.md).
PREFILL_TUNE = Tune(block_k=128, stages=3)


def tune_for(block_m: int) -> Tune:
    return TUNE if block_m <= 16 else PREFILL_TUNE


# The K-permuted layout in the engine (measured on the H200, BENCHMARKS.md "FP4 experts in the engine: the
# K-permuted layout": 1.7x faster at 1-64 tokens, 1.28x at 256-4096). On a target whose `grouped_gemm_fp4_kperm*`
# kernels have an override (sm_90a), routed FP4 experts are repacked once at load (`moe_experts.kernel_layout`,
# called by the model's assembly: "kperm1" when every exponent byte is <= 128, else "kperm") and both tiles below
# read them; every other target and the reference keep the plain layout. False: nothing is repacked and the plain
# kernels above run, as before.
REPACKED = True
KPERM_BLOCK_K = 256  # the repacked tile's K width: the layout of both tiles below (`moe_fp4_sm90.repack`)
KPERM_TUNE = Tune(block_n=64, block_k=KPERM_BLOCK_K, stages=3, threads=128, decode="kperm1", min_blocks=4)
# 64-row tiles on the repacked layout: 32 KB of activations + 8 KB of weights a stage (the fastest correct of
# benchmarks/fp4_experts.py's "p_kperm*_s2_mb2", "p_kperm*_s3_mb1", "p_kperm1_bn128_s2" on the H200)
KPERM_PREFILL_TUNE = Tune(block_n=64, block_k=KPERM_BLOCK_K, stages=2, threads=128, decode="kperm1", min_blocks=2)


def kperm_tune(block_m: int, decode: str) -> Tune:
    """The tile of the K-permuted kernel for `block_m`-row tiles, with decoder `decode` ("kperm" or "kperm1")."""
    base = KPERM_TUNE if block_m <= 16 else KPERM_PREFILL_TUNE
    return Tune(**{**base.__dict__, "decode": decode})


def repack_for(tune: Tune, values, scales) -> tuple:
    """The weight operands the kernel of `tune` takes: (values, scales) unchanged, or K-permuted once."""
    if not tune.repacked:
        return values, scales
    from tilekernels.ops import moe_fp4_sm90

    return moe_fp4_sm90.repack(values, scales, tune)


# Two e2m1 codes (one byte b, low nibble first) -> two bf16 (low half first), times 2^(e-127). b * 0x00040040
# puts the low code's magnitude bits at 6-8 and the high code's at 22-24, b * 0x01001000 the sign bits at 15 and
# 31 (the shifted copies do not overlap, so the multiplies add without carries): each half is then the bf16
# bit pattern of e2m1 * 2^-126 (0.5 a subnormal: bf16 arithmetic has no flush-to-zero). Two exact bf16x2
# multiplies, by 2^126 (0x7E80) and by 2^(e-127) (bits e << 7), give e2m1 * 2^(e-127) for every 1 <= e <= 254.
PAIR_SOURCE = r"""
#ifndef DEEPINFER_FP4X2_BF16X2
#define DEEPINFER_FP4X2_BF16X2
static __device__ __forceinline__ unsigned deepinfer_fp4x2_bf16x2(unsigned b, unsigned e) {
  unsigned v = ((b * 0x00040040u) & 0x01C001C0u) | ((b * 0x01001000u) & 0x80008000u);
  unsigned s = (e << 7) * 0x00010001u;
  unsigned r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(0x7E807E80u));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(s));
  return r;
}
#endif
"""


def body_decode(P, v, cfg=None, tune: Tune | None = None):
    """grouped_gemm_fp4 for few rows per M tile (v.block_m <= 16) on sm_90a; the same signature as the
    portable body: A [MT*BM, K] dtype, W [E, N, K/2] uint8, S [E, N, K/32] uint8, TileExpert [MT] int32,
    C [MT*BM, N] dtype."""
    from tilelang.layout import make_swizzled_layout

    tune = tune or tune_for(v.block_m)
    if tune.repacked:
        from tilekernels.ops import moe_fp4_sm90

        return moe_fp4_sm90.body(P, v, cfg, tune)
    T = P.T
    N, K, E, BM, dtype = v.n, v.k, v.experts, v.block_m, v.dtype
    SB = FP4_BLOCK[1]
    require(K % SB == 0, "moe_experts", f"FP4 weights need K divisible by {SB}, got {K}")
    require(dtype == "bfloat16", "moe_experts", f"the sm_90a FP4 decode kernel takes bf16 activations, got {dtype}")
    require(tune.block_k % SB == 0 and tune.block_n % 64 == 0 and tune.decode in ("pair", "half"), "moe_experts",
            f"bad decode tile {tune}")
    BN, BK = tune.block_n, min(tune.block_k, -(-K // SB) * SB)
    NT, KT = -(-N // BN), -(-K // BK)
    KP, KS, KB = K // 2, K // SB, BK // SB
    MT = T.dynamic("MT")

    def block(b):
        """A K step past K (ragged K) reads its zero bytes with the last real exponent, not out of range."""
        return b if K % BK == 0 else T.min(b, KS - 1)

    def decode(byte, exp, j):
        """The value of column j (its code is nibble j % 2 of `byte`) of a block with exponent byte `exp`."""
        if tune.decode == "pair":
            pair = T.call_extern("uint32", "deepinfer_fp4x2_bf16x2", T.cast(byte, "uint32"), T.cast(exp, "uint32"))
            return T.reinterpret(T.cast(T.shift_right(pair, (j % 2) * 16) & 0xFFFF, "uint16"), dtype)
        code = T.shift_right(T.cast(byte, "uint32"), (j % 2) * 4)
        half = T.reinterpret(T.cast(((code & 8) << 12) | ((code & 7) << 9), "uint16"), "float16")  # e2m1 * 2^-14
        scale = T.reinterpret((T.cast(exp, "uint32") + 14) << 23, "float32")  # 2^(e - 113)
        return T.cast(T.cast(half, "float32") * scale, dtype)

    @T.prim_func
    def kernel(A: T.Tensor((MT * BM, K), dtype), W: T.Tensor((E, N, KP), "uint8"), S: T.Tensor((E, N, KS), "uint8"),
               TileExpert: T.Tensor((MT,), "int32"), C: T.Tensor((MT * BM, N), dtype)):
        with T.Kernel(MT * NT, threads=tune.threads) as pid:
            T.annotate_min_blocks_per_sm(tune.min_blocks)
            if tune.decode == "pair":
                T.import_source(PAIR_SOURCE)
            x_s = T.alloc_shared((BM, BK), dtype)
            w_s = T.alloc_shared((BN, BK // 2), "uint8")
            s_s = T.alloc_shared((BN, KS), "uint8")  # the CTA's exponents for all of K, loaded once
            w_op = T.alloc_fragment((BN, BK), dtype)
            acc = T.alloc_fragment((BN, BM), "float32")
            # Each thread reads bytes of 8 rows at once: swizzled rows put them in 8 different banks.
            T.annotate_layout({w_s: make_swizzled_layout(w_s), s_s: make_swizzled_layout(s_s)})
            m0 = pid // NT * BM
            n0 = pid % NT * BN
            if TileExpert[pid // NT] >= 0:
                T.copy(S[TileExpert[pid // NT], n0, 0], s_s)
                T.clear(acc)
                for kk in T.Pipelined(KT, num_stages=tune.stages):
                    T.copy(W[TileExpert[pid // NT], n0, kk * (BK // 2)], w_s)
                    T.copy(A[m0, kk * BK], x_s)
                    for i, j in T.Parallel(BN, BK):
                        w_op[i, j] = decode(w_s[i, j // 2], s_s[i, block(kk * KB + j // SB)], j)
                    T.gemm(w_op, x_s, acc, transpose_B=True)
                for i, j in T.Parallel(BN, BM):
                    if n0 + i < N:
                        C[m0 + j, n0 + i] = T.cast(acc[i, j], dtype)

    return kernel
