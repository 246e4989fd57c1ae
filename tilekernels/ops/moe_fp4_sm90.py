"""K-permuted FP4 kernel for the routed experts on sm_90a (candidates of benchmarks/fp4_experts.py; the engine's
`grouped_gemm_fp4_kperm*` kernels, decode and 64-row tiles, when `moe_fp4.REPACKED` is on): the swapped-operand
kernel of `moe_fp4` (weight rows are the wgmma's M, 16 tokens its N,
weights converted into the MMA's A registers), but with the weight bytes and exponents repacked once at load
(`repack`) so that each thread's decode is a few vector loads and word-wide bit operations.

What changes against `moe_fp4.body_decode` ("pair"):

- Layout. Within every (64-row, BK-column) tile of W, the 16 bytes thread t needs for 64 consecutive K columns
  (its two rows, 2 x 32 values, exactly the 16 A registers of four m64n16k16 wgmmas) are stored contiguously at
  tile offset (q * 128 + t) * 16: one conflict-free 16-byte shared load per 32 values (was one byte load per
  two values, through a swizzle). The tile stays the same rectangle of W, so the pipeline's cp.async copies it
  unchanged. Exponents: per 64-row group, each 256-column chunk holds, for each thread's row pair (g, g+8),
  their 8 block exponents each (16 bytes, one load per 256 columns, broadcast to the 4 threads of the pair).
- Decode. Each 32-bit word holds the 4 A registers of one k16 step (8 codes), laid out (MAG, SIGN below) so that
  a register's bf16x2 pattern of e2m1 * 2^-126 (the exact trick of moe_fp4.PAIR_SOURCE) is 1-4 shifts and logic
  ops (11 per 4 registers; no multiplies, no byte extraction, no re-packing of 16-bit halves). Then one bf16x2
  multiply by 2^(e-1) ("kperm1": exponent bytes 0..128, i.e. scales <= 2, which `repack` checks) or two (by
  2^126, then 2^(e-127): "kperm", 1 <= e <= 254 as "pair"). The exponent's bf16x2 is built once per block.
- In SASS (nvcc 13, V4-Flash gate_up): 2,064 ("kperm1") / 2,392 ("kperm") instructions against the default's
  3,808 for the same 4-stage loop; the main loop about 6.5 instructions per value pair, all included.
- block_n 128 (two warpgroups, 64 rows each): both read the same activation tile, half the L2 reads per weight.

Restrictions (checked): bf16 activations, N % block_n == 0, K % block_k == 0, block_k a multiple of 256,
64 weight rows per warpgroup of 128 threads. The layout depends on block_k only (exponents: on nothing), so the
decode and prefill tiles share it when both use `moe_fp4.KPERM_BLOCK_K`; `unpermute` inverts `repack` exactly.
The engine repacks only with `moe_fp4.REPACKED` (`moe_experts.kernel_layout`); otherwise nothing changes.
"""

import torch

from tilekernels.op import require
from tilekernels.quant import FP4_BLOCK

CHUNK = 256  # K columns of one exponent chunk (8 blocks of 32)

# One value pair (an A register of the wgmma) from its 32-bit word. Each 16-bit half of the word holds one value
# of each of the word's 4 registers (low half: even columns), the 3 magnitude bits of register p at bits
# MAG[p]..MAG[p]+2 and its sign at bit SIGN[p], placed so that shifts shared between registers move them to the
# bf16 pattern of e2m1 * 2^-126 (magnitude at 6-8, sign at 15: the trick of moe_fp4.PAIR_SOURCE): register 0
# is one AND, 1 a shift and an AND, 2 and 3 two shifts and two logic ops (11 instructions per 4 registers).
# `ew` holds the block's exponent in byte `sel`. EXACT: x 2^126 then x 2^(e-127) (1 <= e <= 254); else one
# multiply by 2^(e-1) (0 <= e <= 128). nvcc shares the exponent's bf16x2 between the 8 registers of a block.
MAG, SIGN = (6, 3, 0, 9), (15, 12, 14, 13)
SOURCE = r"""
#ifndef DEEPINFER_FP4_KPERM
#define DEEPINFER_FP4_KPERM
template <bool EXACT>
static __device__ __forceinline__ unsigned deepinfer_fp4_kperm_pair(unsigned w, unsigned p, unsigned ew, unsigned sel) {
  unsigned r;
  if (p == 0) r = w & 0x81C081C0u;
  else if (p == 1) r = (w << 3) & 0x81C081C0u;
  else if (p == 2) r = ((w << 6) & 0x01C001C0u) | ((w << 1) & 0x80008000u);
  else r = ((w >> 3) & 0x01C001C0u) | ((w << 2) & 0x80008000u);
  const unsigned e2 = __byte_perm(ew, 0u, sel | 0x4040u | (sel << 8));  // 0x00ee00ee
  const unsigned s = EXACT ? (e2 << 7) : (e2 << 7) + 0x3F003F00u;
  if (EXACT) asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(0x7E807E80u));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(s));
  return r;
}
// One half of the pair, split with a PTX vector move: both halves of one pair stay one 32-bit register for
// the wgmma (a shift + byte permute per pair otherwise, when nvcc re-packs two 16-bit pieces).
template <bool EXACT, typename BF16>  // BF16: TileLang's bfloat16_t (declared after this source)
static __device__ __forceinline__ BF16 deepinfer_fp4_kperm_half(unsigned w, unsigned p, unsigned ew, unsigned sel,
                                                                      unsigned half) {
  const unsigned r = deepinfer_fp4_kperm_pair<EXACT>(w, p, ew, sel);
  unsigned short lo, hi;
  asm("mov.b32 {%0, %1}, %2;" : "=h"(lo), "=h"(hi) : "r"(r));
  return BF16::bitcast(half ? hi : lo);
}
#endif
"""


def check(v, tune) -> None:
    ok = tune.block_n in (64, 128) and tune.threads == 2 * tune.block_n and tune.block_k % CHUNK == 0
    require(ok, "moe_experts", f"the K-permuted FP4 kernel needs 64 weight rows per warpgroup (block_n 64 or 128, "
            f"2 threads per row) and block_k % {CHUNK} == 0, got {tune}")
    require(v.dtype == "bfloat16" and v.n % tune.block_n == 0 and v.k % tune.block_k == 0, "moe_experts",
            f"the K-permuted FP4 kernel needs bf16, N % {tune.block_n} == 0 and K % {tune.block_k} == 0, got {v}")


def body(P, v, cfg=None, tune=None):
    """grouped_gemm_fp4 with `repack`ed W and S (the same bytes, K-permuted, as 32-bit words): A [MT*BM, K] bf16,
    W [E, N, K/8] int32, S [E, N, K/128] int32, TileExpert [MT] int32, C [MT*BM, N] bf16."""
    T = P.T
    check(v, tune)
    N, K, E, BM, dtype = v.n, v.k, v.experts, v.block_m, v.dtype
    BN, BK = tune.block_n, tune.block_k
    NT, KT = N // BN, K // BK
    KS = K // FP4_BLOCK[1]
    MT = T.dynamic("MT")
    fn = f"deepinfer_fp4_kperm_half<{'true' if tune.decode == 'kperm' else 'false'}, bfloat16_t>"
    WW, SW = BK // 8, KS // 4  # 32-bit words per tile row / exponent row

    @T.prim_func
    def kernel(A: T.Tensor((MT * BM, K), dtype), W: T.Tensor((E, N, K // 8), "int32"),
               S: T.Tensor((E, N, KS // 4), "int32"), TileExpert: T.Tensor((MT,), "int32"),
               C: T.Tensor((MT * BM, N), dtype)):
        with T.Kernel(MT * NT, threads=tune.threads) as pid:
            T.annotate_min_blocks_per_sm(tune.min_blocks)
            T.import_source(SOURCE)
            x_s = T.alloc_shared((BM, BK), dtype)
            w_s = T.alloc_shared((BN, WW), "int32")  # plain rows: the repack put each thread's words together
            s_s = T.alloc_shared((BN, SW), "int32")  # the CTA's exponents for all of K, loaded once
            w_op = T.alloc_fragment((BN, BK), dtype)
            acc = T.alloc_fragment((BN, BM), "float32")
            m0 = pid // NT * BM
            n0 = pid % NT * BN
            if TileExpert[pid // NT] >= 0:
                T.copy(S[TileExpert[pid // NT], n0, 0], s_s)
                T.clear(acc)
                for kk in T.Pipelined(KT, num_stages=tune.stages):
                    T.copy(W[TileExpert[pid // NT], n0, kk * WW], w_s)
                    T.copy(A[m0, kk * BK], x_s)
                    for i, j in T.Parallel(BN, BK):
                        # (i, j) sits in A register p = h + 2a of k16 step ki of thread t of warpgroup i // 64
                        # (wgmma m64n16k16 layout); each 64-row group is a repacked tile of its own
                        h, a, ki = i % 16 // 8, j % 16 // 8, j // 16
                        t = i % 64 // 16 * 32 + i % 8 * 4 + j % 8 // 2
                        # the word: 16 bytes per thread per 64 columns
                        wf = i // 64 * (64 * WW) + (ki // 4 * 128 + t) * 4 + ki % 4
                        b = ki % 16 // 2  # 32-block within the 256-column exponent chunk
                        sf = i // 64 * (64 * SW) + (kk * (BK // CHUNK) + ki // 16) * 128 + t // 4 * 4 + h * 2 + b // 4
                        w_op[i, j] = T.call_extern(dtype, fn, T.cast(w_s[wf // WW, wf % WW], "uint32"), h + 2 * a,
                                                   T.cast(s_s[sf // SW, sf % SW], "uint32"), b % 4, j % 2)
                    if BN == 64:
                        T.gemm(w_op, x_s, acc, transpose_B=True)
                    else:  # each warpgroup its own 64 rows (not half the tokens of all rows: twice the decode)
                        T.gemm(w_op, x_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(BN, BM):
                    C[m0 + j, n0 + i] = T.cast(acc[i, j], dtype)

    return kernel


def _weight_words(codes: torch.Tensor) -> torch.Tensor:
    """(..., 64 * bk) e2m1 codes of tiles in row-major order -> (..., 8 * bk) int32 words of the K-permuted tiles:
    word (q * 128 + t) * 4 + j holds thread t's A registers of k16 step 4q + j (see MAG, SIGN)."""
    bk = codes.shape[-1] // 64
    o = torch.arange(8 * bk, device=codes.device)  # word index in the tile
    q, t, j = o // 512, o % 512 // 4, o % 4
    warp, g, c = t // 32, t % 32 // 4, t % 4
    words = torch.zeros(codes.shape[:-1] + (8 * bk,), dtype=torch.int64, device=codes.device)
    for p in range(4):  # register p: rows g (+8 if p odd), columns 2c, 2c + 1 (+8 if p >= 2) of step 4q + j
        row = 16 * warp + g + 8 * (p % 2)
        col = 16 * (4 * q + j) + 2 * c + 8 * (p // 2)
        for half in range(2):
            code = codes[..., row * bk + col + half].long()
            words |= ((code & 7) << (MAG[p] + 16 * half)) | ((code >> 3) << (SIGN[p] + 16 * half))
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _scale_order(ks: int) -> torch.Tensor:
    """For one 64-row group's (64, ks) exponents, the row-major index (row * ks + block) stored at each byte."""
    d = torch.arange(64 * ks)
    chunk, rest = d // 512, d % 512
    pair, hb = rest // 16, rest % 16  # pair = 8 * warp + g: the exponents of rows g and g + 8 of the warp
    h, b = hb // 8, hb % 8
    row = 16 * (pair // 8) + pair % 8 + 8 * h
    return row * ks + chunk * 8 + b


def _tile_index(bk: int, device) -> tuple[torch.Tensor, ...]:
    """For one (64, bk) tile's words: each word's register p, half: the row-major code index it holds, the bit of
    its magnitude and the bit of its sign (the index tables `_weight_words` and `_weight_codes` share)."""
    o = torch.arange(8 * bk, device=device)[:, None, None]  # word index in the tile
    p = torch.arange(4, device=device)[None, :, None]
    half = torch.arange(2, device=device)[None, None, :]
    q, t, j = o // 512, o % 512 // 4, o % 4
    warp, g, c = t // 32, t % 32 // 4, t % 4
    row = 16 * warp + g + 8 * (p % 2)
    col = 16 * (4 * q + j) + 2 * c + 8 * (p // 2)
    mag = torch.tensor(MAG, device=device)[p] + 16 * half
    sign = torch.tensor(SIGN, device=device)[p] + 16 * half
    return (row * bk + col + half).expand(-1, 4, 2), mag.expand(8 * bk, -1, -1), sign.expand(8 * bk, -1, -1)


def _weight_codes(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `_weight_words`: (..., 8 * bk) int32 words -> (..., 64 * bk) e2m1 codes (uint8)."""
    bk = words.shape[-1] // 8
    idx, mag, sign = _tile_index(bk, words.device)
    w = (words.long() & 0xFFFFFFFF)[..., :, None, None]
    codes = ((w >> mag) & 7) | (((w >> sign) & 1) << 3)
    out = torch.empty(words.shape[:-1] + (64 * bk,), dtype=torch.uint8, device=words.device)
    out[..., idx.reshape(-1)] = codes.reshape(*words.shape[:-1], -1).to(torch.uint8)
    return out


def unpermute(values: torch.Tensor, scales: torch.Tensor, block_k: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `repack` (exact): K-permuted words (E, N, K/8) int32 and exponents (E, N, K/128) int32 (or
    their bytes (E, N, K/32)) -> the plain (E, N, K/2) uint8 codes and (E, N, K/32) uint8 exponent bytes."""
    e, n, kw = values.shape
    k, bk = 8 * kw, block_k
    require(n % 64 == 0 and k % bk == 0 and bk % CHUNK == 0, "moe_experts", f"cannot un-permute {tuple(values.shape)}")
    sbytes = scales.contiguous().view(torch.uint8).reshape(e, n, k // FP4_BLOCK[1])
    sorder = _scale_order(k // FP4_BLOCK[1]).to(values.device)
    out_v = torch.empty(e, n, k // 2, dtype=torch.uint8, device=values.device)
    out_s = torch.empty(e, n, k // FP4_BLOCK[1], dtype=torch.uint8, device=values.device)
    for x in range(e):
        words = values[x].reshape(n // 64, 64, k // bk, bk // 8).permute(0, 2, 1, 3).reshape(n // 64, k // bk, -1)
        codes = _weight_codes(words).view(n // 64, k // bk, 64, bk).permute(0, 2, 1, 3).reshape(n, k)
        out_v[x].copy_(codes[:, 0::2] | (codes[:, 1::2] << 4))
        plain = torch.empty_like(out_s[x]).reshape(n // 64, -1)
        plain[:, sorder] = sbytes[x].reshape(n // 64, -1)
        out_s[x].copy_(plain.reshape(n, -1))
    return out_v, out_s


def repack(values: torch.Tensor, scales: torch.Tensor, tune) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 expert weights (E, N, K/2) uint8 (two e2m1 codes per byte, low nibble first) and their exponent bytes
    (E, N, K/32) -> the same bytes K-permuted for `body` with `tune` (once, at load), as int32 words:
    (E, N, K/8) and (E, N, K/128)."""
    require(tune.decode == "kperm" or int(scales.max()) <= 128, "moe_experts",
            "the one-multiply K-permuted decode needs exponent bytes <= 128 (scales <= 2); use decode='kperm'")
    e, n, kp = values.shape
    k, bk = 2 * kp, tune.block_k
    require(n % 64 == 0 and k % bk == 0 and bk % CHUNK == 0, "moe_experts", f"cannot repack {tuple(values.shape)}")
    sorder = _scale_order(k // FP4_BLOCK[1]).to(values.device)
    out_v = torch.empty(e, n, k // 8, dtype=torch.int32, device=values.device)
    out_s = torch.empty_like(scales)
    for x in range(e):  # one expert at a time: codes take a byte each
        b = values[x].view(n // 64, 64, k // bk, bk // 2)
        codes = torch.stack((b & 15, b >> 4), -1).reshape(n // 64, 64, k // bk, bk).permute(0, 2, 1, 3)
        words = _weight_words(codes.reshape(n // 64, k // bk, 64 * bk)).view(n // 64, k // bk, 64, bk // 8)
        out_v[x].copy_(words.permute(0, 2, 1, 3).reshape(n, k // 8))  # each tile: the rectangle T.copy moves
        out_s[x].copy_(scales[x].reshape(n // 64, -1)[:, sorder].reshape(n, -1))
    return out_v, out_s.view(torch.int32)
