"""W4A8 FP4 routed-expert GEMM on sm_90a (a candidate of benchmarks/fp4_experts.py, not yet the engine's): the
swapped-operand kernel of `moe_fp4_sm90` (weight rows are the wgmma's M, the tile's tokens its N, weights
converted into the MMA's A registers), but with FP8 activations and the FP4 codes converted to e4m3, so that the
tensor core runs FP8 wgmma (m64nNk32) and the conversion costs about one instruction per value instead of ~3.

Why: at one to eight tokens `moe_fp4_sm90` is bound by the issue of its bf16 conversion (~6.5 instructions per
value pair, BENCHMARKS.md "FP4 experts at one token: why split-K is not the next step"), not by its bytes.

The conversion. An e2m1 magnitude m (0, 0.5, ..., 6) of a 32-block with exponent byte e is m * 2^(e - 127).
Within each 128-column block of a weight row a reference exponent r is chosen (`repack`: the largest exponent of
its four 32-blocks minus 6, at least 1) and each 32-block keeps d = e - r, which must lie in [-5, 6]; then m * 2^d
is an e4m3 normal number (or zero) for every m, and its byte is one of 8 per d: a table of two 32-bit words
(bytes of m = 0, 0.5, 1, 1.5 and of 2, 3, 4, 6), built with one multiply-add each from d, indexed with one byte
permute (`prmt`) for four codes at a time. The sign is one masked OR. The weight row's 2^(r - 127) and the token's
activation scale are applied once per 128 columns, when each block's wgmma partial sum is promoted into the fp32
total (as DeepGEMM does: FP8 wgmma accumulates with limited precision, so partials stay short).

Exactness: the FP8 values equal the FP4 weights times 2^(127 - r) exactly; the result equals the fp32 product of
the dequantized FP8 activations (`act_quant`, 1 x 128 groups) and the dequantized weights up to the order of
fp32 additions and the bf16 output rounding. Blocks whose exponents span more than 12 binades inside one
128-column block cannot be held (`repack` raises, naming the block); all-zero 32-blocks are exempt.

Layout (`repack`, once at load): each (64-row, 128-column) tile of W is 1,024 int32 words in the order the
threads read them: thread t's 8 words (two k32 steps per 16-byte load) at tile offset (q * 128 + t) * 4 + j.
Word j % 2 == a of k32 step s = 2q + j // 2 holds the 8 codes of the A registers a (row g, columns 16a + 4c +
0..3) and a + 1 (row g + 8): register a's magnitudes at bits 4i..4i+2 and signs at 8i+7, register a + 1's
magnitudes at 16 + 4i.. and signs at 8i+3 (i: byte in the register; g, c: the thread's row group and column
group). Per (row, 128-column block) one int32: bits 4b..4b+3 hold d + 5 of 32-block b, bits 16..23 r.

Restrictions (checked): bf16 output, N % 64 == 0, K % 128 == 0, 64 weight rows per warpgroup of 128 threads.
"""

import torch

from tilekernels.op import require
from tilekernels.quant import FP4_BLOCK

BLOCK_K = 128  # K columns per pipeline step: one activation scale group, one promotion
WORDS_PER_ROW = BLOCK_K // 8  # 32-bit words per tile row
STEP_K = (BLOCK_K, 2 * BLOCK_K, 4 * BLOCK_K)  # block_k: K columns per pipeline step
D_MIN, D_MAX = -5, 6  # a 32-block's exponent relative to its 128-block's reference: e4m3 normals for every code
# Two e4m3 byte tables for d = D_MIN (the codes' magnitudes 0, 0.5, 1, 1.5 | 2, 3, 4, 6 times 2^-5), and the step
# of one binade (exponent field + 1 in every byte but zero's)
LUT_LO, LUT_HI, STEP_LO, STEP_HI = 0x14100800, 0x24201C18, 0x08080800, 0x08080808
SOURCE = r"""
#ifndef DEEPINFER_FP4_E4M3
#define DEEPINFER_FP4_E4M3
// One A register (4 e4m3 bytes) of a k32 step from its word: half 0 the low register, 1 the high one; `s` the
// row's (128-column block) word, `blk` the 32-block in it.
static __device__ __forceinline__ unsigned deepinfer_fp4_e4m3_reg(unsigned w, unsigned s, unsigned blk,
                                                                 unsigned half) {
  const unsigned d = (s >> (4u * blk)) & 15u;
  const unsigned lo = d * 0x08080800u + 0x14100800u;
  const unsigned hi = d * 0x08080808u + 0x24201C18u;
  const unsigned m = w & 0x77777777u;  // prmt reads the low 16 bits only: one mask serves both halves
  const unsigned sel = half ? m >> 16 : m;
  const unsigned sign = half ? w << 4 : w;
  unsigned r;  // one asm block: nvcc sees a whole register, so the 4 bytes the fragment takes stay one register
  asm("{\n .reg .b32 t;\n prmt.b32 t, %1, %2, %3;\n lop3.b32 %0, t, %4, 0x80808080, 0xF8;\n}"
      : "=r"(r) : "r"(lo), "r"(hi), "r"(sel), "r"(sign));
  return r;
}
// The register's 4 bytes stored at once into the fragment (a 32-bit store into the register array: one whole
// register for the wgmma; byte by byte, nvcc re-assembles each register with four masks)
static __device__ __forceinline__ void deepinfer_fp4_e4m3_put(void* dst, unsigned w, unsigned s, unsigned blk,
                                                             unsigned half) {
  *reinterpret_cast<unsigned*>(dst) = deepinfer_fp4_e4m3_reg(w, s, blk, half);
}
#endif
"""


def check(v, tune) -> None:
    ok = tune.block_n in (64, 128) and tune.threads == 2 * tune.block_n and tune.block_k in STEP_K
    require(ok, "moe_experts", f"the W4A8 FP4 kernel needs 64 weight rows per warpgroup (block_n 64 or 128, "
            f"2 threads per row) and block_k in {STEP_K}, got {tune}")
    require(v.dtype == "bfloat16" and v.n % tune.block_n == 0 and v.k % tune.block_k == 0, "moe_experts",
            f"the W4A8 FP4 kernel needs a bf16 output, N % {tune.block_n} == 0 and K % {tune.block_k} == 0, got {v}")


def body(P, v, cfg=None, tune=None):
    """The W4A8 grouped GEMM: A [MT*BM, K] e4m3 codes (uint8), SA [MT*BM, K/128] fp32 (`act_quant`'s scales),
    W [E, N, K/8] int32 and S [E, N, K/128] int32 (`repack`), TileExpert [MT] int32, C [MT*BM, N] bf16. Each
    pipeline step stages block_k columns: 1, 2 or 4 blocks of 128, each converted, multiplied and promoted in
    turn (a wider step spends its copy and synchronisation overhead on more values)."""
    T = P.T
    check(v, tune)
    N, K, E, BM, dtype = v.n, v.k, v.experts, v.block_m, v.dtype
    BN, BK = tune.block_n, tune.block_k
    NS = BK // BLOCK_K  # 128-column blocks per step
    NT, KT, KB = N // BN, K // BK, K // BLOCK_K
    WW = NS * WORDS_PER_ROW
    MT = T.dynamic("MT")
    e4m3 = "float8_e4m3fn"
    policy = T.GemmWarpPolicy.FullRow  # each warpgroup its own 64 rows (block_n 128)

    @T.macro
    def block(w_s, s_s, sa_s, x_s, w_op, part, acc, kb, u: int):
        """Block u of the step (global 128-column block kb): convert, multiply, promote."""
        for i, j4 in T.Parallel(BN, BLOCK_K // 4):
            # (i, 4 j4 .. 4 j4 + 3) is A register h + 2a of k32 step s of thread t of warpgroup i // 64 (wgmma
            # m64nNk32 e4m3 layout); each 64-row group is a repacked (64, 128) tile of its own
            s, h, a = j4 // 8, i % 16 // 8, j4 % 8 // 4
            t = i % 64 // 16 * 32 + i % 8 * 4 + j4 % 4
            wf = i // 64 * (64 * WORDS_PER_ROW) + (s // 2 * 128 + t) * 4 + s % 2 * 2 + a
            T.evaluate(T.call_extern("handle", "deepinfer_fp4_e4m3_put", T.address_of(w_op[i, 4 * j4]),
                                     T.cast(w_s[wf // WORDS_PER_ROW, u * WORDS_PER_ROW + wf % WORDS_PER_ROW], "uint32"),
                                     T.cast(s_s[i, kb], "uint32"), s, h))
        T.gemm(w_op, x_s, part, transpose_B=True, clear_accum=True, policy=policy)
        for i, j in T.Parallel(BN, BM):  # 2^(r - 127) of the row's block times the token's scale
            r = T.shift_right(s_s[i, kb], 16) & 0xFF
            acc[i, j] += part[i, j] * (sa_s[j, kb] * T.reinterpret(T.shift_left(r, 23), "float32"))

    @T.prim_func
    def kernel(A: T.Tensor((MT * BM, K), "uint8"), SA: T.Tensor((MT * BM, KB), "float32"),
               W: T.Tensor((E, N, K // 8), "int32"), S: T.Tensor((E, N, KB), "int32"),
               TileExpert: T.Tensor((MT,), "int32"), C: T.Tensor((MT * BM, N), dtype)):
        with T.Kernel(MT * NT, threads=tune.threads) as pid:
            T.annotate_min_blocks_per_sm(tune.min_blocks)
            T.import_source(SOURCE)
            Af = T.view(A, dtype=e4m3)
            x0 = T.alloc_shared((BM, BLOCK_K), e4m3)  # one activation tile per 128-column block of the step
            x1 = T.alloc_shared((BM, BLOCK_K), e4m3) if NS > 1 else x0
            x2 = T.alloc_shared((BM, BLOCK_K), e4m3) if NS > 2 else x0
            x3 = T.alloc_shared((BM, BLOCK_K), e4m3) if NS > 2 else x0
            w_s = T.alloc_shared((BN, WW), "int32")  # plain rows: the repack put each thread's words together
            s_s = T.alloc_shared((BN, KB), "int32")  # the rows' block words for all of K, loaded once
            sa_s = T.alloc_shared((BM, KB), "float32")  # the tokens' activation scales for all of K, loaded once
            w_op = T.alloc_fragment((BN, BLOCK_K), e4m3)
            part = T.alloc_fragment((BN, BM), "float32")
            acc = T.alloc_fragment((BN, BM), "float32")
            m0 = pid // NT * BM
            n0 = pid % NT * BN
            if TileExpert[pid // NT] >= 0:
                T.copy(S[TileExpert[pid // NT], n0, 0], s_s)
                T.copy(SA[m0, 0], sa_s)
                T.clear(acc)
                for kk in T.Pipelined(KT, num_stages=tune.stages):
                    T.copy(W[TileExpert[pid // NT], n0, kk * WW], w_s)
                    T.copy(Af[m0, kk * BK], x0)
                    if NS > 1:
                        T.copy(Af[m0, kk * BK + BLOCK_K], x1)
                    if NS > 2:
                        T.copy(Af[m0, kk * BK + 2 * BLOCK_K], x2)
                        T.copy(Af[m0, kk * BK + 3 * BLOCK_K], x3)
                    block(w_s, s_s, sa_s, x0, w_op, part, acc, kk * NS, 0)
                    if NS > 1:
                        block(w_s, s_s, sa_s, x1, w_op, part, acc, kk * NS + 1, 1)
                    if NS > 2:
                        block(w_s, s_s, sa_s, x2, w_op, part, acc, kk * NS + 2, 2)
                        block(w_s, s_s, sa_s, x3, w_op, part, acc, kk * NS + 3, 3)
                for i, j in T.Parallel(BN, BM):
                    C[m0 + j, n0 + i] = T.cast(acc[i, j], dtype)

    return kernel


def _tile_index(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one (64, 128) tile's 1,024 words x 8 codes: the row-major code index each holds, the bit of its
    magnitude and the bit of its sign (see the module's docstring)."""
    o = torch.arange(64 * BLOCK_K // 8, device=device)[:, None, None]  # word index in the tile
    half = torch.arange(2, device=device)[None, :, None]
    byte = torch.arange(4, device=device)[None, None, :]
    q, t, j = o // 512, o % 512 // 4, o % 4
    warp, g, c = t // 32, t % 32 // 4, t % 4
    step, a = 2 * q + j // 2, j % 2
    row = 16 * warp + g + 8 * half
    col = 32 * step + 16 * a + 4 * c + byte
    mag = 4 * byte + 16 * half
    sign = 8 * byte + 7 - 4 * half
    shape = (o.shape[0], 2, 4)
    return (row * BLOCK_K + col).expand(shape), mag.expand(shape), sign.expand(shape)


def block_words(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., K] (uint8, one per value) and exponent bytes [..., K/32] -> the per-(row, 128-column
    block) words [..., K/128] int32 (d + 5 of each 32-block at 4b, r at 16). Raises when a block with a nonzero code
    lies more than 11 binades below its 128-block's largest."""
    k = codes.shape[-1]
    e = exps.long().reshape(*exps.shape[:-1], k // BLOCK_K, 4)
    live = ((codes & 7) != 0).reshape(*codes.shape[:-1], k // BLOCK_K, 4, FP4_BLOCK[1]).any(-1)
    top = torch.where(live, e, torch.zeros_like(e)).amax(-1, keepdim=True)
    r = (top - D_MAX).clamp(min=1)
    d = e - r
    bad = live & (d < D_MIN)
    if bool(bad.any()):
        *lead, kb, b = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"moe_experts: the W4A8 FP4 layout cannot hold the 32-column block {4 * kb + b} of row "
                         f"{tuple(lead)}: its exponent is more than {D_MAX - D_MIN} below the largest of its "
                         f"128-column block; the K-permuted bf16 layout takes any exponents")
    d = d.clamp(D_MIN, D_MAX) - D_MIN  # all-zero blocks: any d gives zeros
    shifts = 4 * torch.arange(4, device=codes.device)
    word = (d << shifts).sum(-1) | (r[..., 0] << 16)
    return word.to(torch.int32)


def repack(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 expert weights (E, N, K/2) uint8 (two e2m1 codes per byte, low nibble first) and their exponent bytes
    (E, N, K/32) -> the kernel's operands (once, at load): words (E, N, K/8) int32 and block words (E, N, K/128)
    int32."""
    e, n, kp = values.shape
    k = 2 * kp
    require(n % 64 == 0 and k % BLOCK_K == 0, "moe_experts", f"cannot repack {tuple(values.shape)} for W4A8: "
            f"N % 64 and K % {BLOCK_K} must be 0")
    idx, mag, sign = _tile_index(values.device)
    out_v = torch.empty(e, n, k // 8, dtype=torch.int32, device=values.device)
    out_s = torch.empty(e, n, k // BLOCK_K, dtype=torch.int32, device=values.device)
    for x in range(e):  # one expert at a time: codes take a byte each
        codes = torch.stack((values[x] & 15, values[x] >> 4), -1).reshape(n, k)
        try:
            out_s[x].copy_(block_words(codes, scales[x]))
        except ValueError as exc:
            raise ValueError(f"{exc} (expert {x})") from None
        tiles = codes.view(n // 64, 64, k // BLOCK_K, BLOCK_K).permute(0, 2, 1, 3).reshape(n // 64, k // BLOCK_K, -1)
        c = tiles[..., idx.reshape(-1)].long().view(*tiles.shape[:2], *idx.shape)
        words = (((c & 7) << mag) | ((c >> 3) << sign)).sum((-1, -2))  # disjoint bits: the sum is the OR
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        out_v[x].copy_(words.view(n // 64, k // BLOCK_K, 64, WORDS_PER_ROW).permute(0, 2, 1, 3).reshape(n, k // 8))
    return out_v, out_s



def _lut(d: torch.Tensor) -> torch.Tensor:
    """The e4m3 bytes of the 8 magnitudes for biased d (0..11): [..., 8] (as the kernel's two table words)."""
    lo = (d * STEP_LO + LUT_LO) & 0xFFFFFFFF
    hi = (d * STEP_HI + LUT_HI) & 0xFFFFFFFF
    sh = 8 * torch.arange(4, device=d.device)
    return torch.cat(((lo[..., None] >> sh) & 0xFF, (hi[..., None] >> sh) & 0xFF), -1)


def dequantize(words: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """What the kernel computes with: `repack`'s operands -> fp32 weights [E, N, K], decoded as the kernel does (the
    same bit operations: table bytes, sign, e4m3 value, times 2^(r - 127)); equals the dequantized FP4 weights."""
    e, n, kw = words.shape
    k = 8 * kw
    idx, mag, sign = _tile_index(words.device)
    w = (words.long() & 0xFFFFFFFF).view(e, n // 64, 64, k // BLOCK_K, WORDS_PER_ROW).permute(0, 1, 3, 2, 4)
    w = w.reshape(e, n // 64, k // BLOCK_K, -1)[..., None, None]  # [e, groups, kb, 1024, 1, 1]
    m = (w >> mag) & 7
    s = (w >> sign) & 1
    # each code's row and 32-block: its table from the row's block word
    rows = idx // BLOCK_K
    blk = idx % BLOCK_K // FP4_BLOCK[1]
    bw = (blocks.long() & 0xFFFFFFFF).view(e, n // 64, 64, k // BLOCK_K).permute(0, 1, 3, 2)  # [e, g, kb, 64]
    bw_code = bw[..., rows.reshape(-1)].view(*bw.shape[:3], *idx.shape)
    d = (bw_code >> (4 * blk)) & 15
    byte = torch.gather(_lut(d), -1, m[..., None]).squeeze(-1) | (s << 7)
    val = byte.to(torch.uint8).view(torch.float8_e4m3fn).float() * ((bw_code >> 16) & 0xFF).sub(127).float().exp2()
    out = torch.empty(e, n // 64, k // BLOCK_K, 64 * BLOCK_K, device=words.device)
    out[..., idx.reshape(-1)] = val.reshape(*val.shape[:3], -1)
    return out.view(e, n // 64, k // BLOCK_K, 64, BLOCK_K).permute(0, 1, 3, 2, 4).reshape(e, n, k)
