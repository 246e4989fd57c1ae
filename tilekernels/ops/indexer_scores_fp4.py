"""Lightning-indexer scores over FP4-cached index keys: s[t, e] = sum_h w[t, h] * ReLU(q[t, h] . k[e]) * scale
(fp32), the keys read straight from DeepSeek-V4.1's paged FP4 cache (`fp4_pack`'s e2m1 code bytes, two per byte,
low nibble first, and one ue8m0 exponent byte per 32 values) at the storage rows `rows`: one key set per query
([S, E]: decode) or one shared by every query ([E]: a prefill chunk).

The kernel never materializes dequantized keys in global memory. A work tile is (a block of `block_q` queries, a
tile of `block_e` keys): the tile's row ids are staged, each key's code bytes gathered by its row id into on-chip
staging as int32 words (Ascend's SIMT vectors take no uint8 lanes) and its scales decoded once per group, then every
value decoded in integer and fp32 arithmetic (2 * e2m1 from a nibble table, times half the scale: one body for every
target, the CPU `c` target included) into q's dtype (e2m1 times a power of two is exact in fp32 and in bf16, so
the reference's keys exactly), and one GEMM keys (block_e x dI) x queries^T (block_q*nI x dI) gives
the fp32 logits of every (key, query head) pair; ReLU, times scale and the query's head weights, summed over the
heads, gives a (query, key) score. Keys are the GEMM's rows (M): on Ascend each vector core then holds whole rows
(every head of half the keys) and sums its heads alone. Per-query rows take one query per tile (block_q 1); shared
rows decode a key tile once for `block_q` queries.

`run` pads what the tiles do not divide (so every load and store of the body is whole and in bounds, on every
target): the keys to a multiple of block_e (padding rows read storage row 0; their scores are dropped) and, with
shared rows, the queries to a multiple of block_q (zero queries and weights). Row ids stay int64: a cache can pass
2^31 code bytes.
"""

from dataclasses import dataclass

import torch

from tilekernels import dtypes, fp8
from tilekernels.op import Kernel, OpDecl, require
from tilekernels.ops import fp4_gather, indexer_scores
# Keys per tile (the GEMM's M) and queries per tile, shared with the plain-key op: per-query rows take 128 keys of
# one query (N = nI = 32: tcgen05 on sm_100a takes N 32 only with M 128), shared rows 64 keys of 4 queries
# (N = 4 * nI = 128).
from tilekernels.ops.indexer_scores import BLOCK_E, SHARED_BLOCK_E, SHARED_BLOCK_Q

NAME = "indexer_scores_fp4"
GROUP = 32  # values per ue8m0 scale byte (V4.1's index keys)


def reference(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q [S, nI, dI], codes uint8 [N, dI / 2], scales uint8 [N, dI / 32] (ue8m0), rows int [S, E] (one key set per
    query) or [E] (shared), weights [S, nI] fp32 -> scores [S, E] fp32: `indexer_scores` of the gathered keys."""
    keys = fp4_gather.reference(codes, scales, rows, "ue8m0", torch.float32)
    return indexer_scores.reference(q, keys, weights, scale)


@dataclass(frozen=True)
class Variant:
    heads: int  # nI
    dim: int  # dI (a multiple of 32)
    dtype: str  # q's dtype: the GEMM operands' (keys are decoded into it exactly)
    shared: bool  # rows [E] shared by every query, else [S, E]
    block_q: int = 1  # queries per tile (shared rows only)
    block_e: int = BLOCK_E  # keys per tile


@dataclass(frozen=True)
class Config:
    threads: int = 128


def scale_words(dim: int) -> bool:
    """Whether a key row's scale bytes are read as int32 words (dI a multiple of 128), else byte by byte."""
    return dim // GROUP % 4 == 0


# 2 * the e2m1 magnitudes of codes 0..7 (0, 1, 2, 3, 4, 6, 8, 12), one per nibble from the low end, as an int32
E2M1_X2 = 0xC8643210 - (1 << 32)


def _half_scale(T, byte):
    """0.5 * 2^(b - 127) of a ue8m0 byte b, exactly (b = 0: 2^-128; b = 255: +inf, as the reference's exp2 gives)."""
    b = T.cast(byte, "int32")
    return fp8.pow2(T, T.max(b - 127, -126)) * T.if_then_else(b == 0, 0.25, 0.5)


def _key_value(T, word, half_scale, d):
    """Value d of a key row from the int32 word holding its code (little-endian: code byte d // 2 is byte d // 2 % 4
    of word d // 8, nibble d % 2 of it; bit 3 the sign) and its group's half scale: 2 * e2m1 (an integer from the
    nibble table) times half the scale, exact; the sign applied last (-0 for code 8, as the reference has it)."""
    code = T.bitwise_and(T.shift_right(word, (d % 8) * 4), 15)
    x2 = T.bitwise_and(T.shift_right(E2M1_X2, T.shift_left(T.bitwise_and(code, 7), 2)), 15)
    mag = T.cast(x2, "float32") * half_scale
    return T.if_then_else(T.bitwise_and(code, 8) != 0, -mag, mag)


def body(P, v: Variant, cfg: Config):
    require(v.dim % GROUP == 0 and v.block_e % 2 == 0 and (v.shared or v.block_q == 1), NAME,
            f"variant {v}: dim must be a multiple of {GROUP}, block_e even, and block_q 1 unless the rows are shared")
    T = P.T
    H, D, dtype, BE, QB = v.heads, v.dim, v.dtype, v.block_e, v.block_q
    KW, KS, QH = D // 8, D // GROUP, QB * H  # code words, scale bytes per key row; GEMM columns
    words = scale_words(D)
    SW, sdt = (KS // 4, "int32") if words else (KS, "uint8")  # scale words (or bytes) per key row
    HE = P.vec_rows(BE)  # keys per vector unit (Ascend: half the tile on each of its two)
    # Decode straight into the GEMM operand where vector code can write it (GPU shared memory, the c target);
    # Ascend decodes into UB and moves each unit's half to L1.
    direct = P.traits.operand_scope == P.traits.io_scope and not P.traits.vector_halves
    S = T.dynamic("S")  # queries (a multiple of QB)
    SQ = T.dynamic("SQ")  # S * nI query rows
    SR = T.dynamic("SR")  # row sets: S, or 1 when shared
    NE = T.dynamic("NE")  # key tiles
    N = T.dynamic("N")  # storage rows

    @T.prim_func
    def kernel(Q: T.Tensor((SQ, D), dtype), Codes: T.Tensor((N, KW), "int32"), Scales: T.Tensor((N, SW), sdt),
               Rows: T.Tensor((SR, NE, BE), "int64"), W: T.Tensor((S, H), "float32"),
               Out: T.Tensor((S, NE, BE), "float32"), scale: T.float32):
        with P.kernel(S // QB * NE, cfg.threads) as pid:
            q_op = P.alloc_operand((QH, D), dtype)
            k_op = P.alloc_operand((BE, D), dtype)
            acc = P.alloc_acc((BE, QH), "float32", operands=dtype)
            # A tensor-memory accumulator (sm_100a) reaches shared memory through registers: a plain copy of it
            # (what P.split_copy emits) lowers to stores of its TMEM addresses, not its values (no error).
            tmem = acc.scope() == "shared.tmem"
            part = T.alloc_fragment((BE, QH), "float32") if tmem else None
            scores = indexer_scores.score_tile(P, cfg.threads, H, QB, BE, direct, tmem)
            rid_io = P.alloc_io((1, HE), "int64")
            c_io = P.alloc_io((HE, KW), "int32")
            h_io = P.alloc_io((HE, KS), "float32")  # half scales
            k_io = k_op if direct else P.alloc_io((HE, D), dtype)
            w_io = P.alloc_io((QB, H), "float32")
            s_io = P.alloc_io((HE, QH), "float32")
            o_io = P.alloc_io((QB, 1, HE), "float32")
            for t in P.tiles(S // QB * NE, pid):
                qb0 = T.truncdiv(t, NE)  # key tiles minor: neighbouring programs share their queries
                ne = T.truncmod(t, NE)
                T.copy(Q[qb0 * QH : qb0 * QH + QH, 0:D], q_op)
                T.copy(W[qb0 * QB : qb0 * QB + QB, 0:H], w_io)
                P.split_copy(Rows[0 if v.shared else qb0, ne : ne + 1, 0:BE], rid_io)
                with P.vector(cfg.threads):  # gather this unit's keys by storage row (whole words)
                    for i, j in T.Parallel(HE, KW):
                        c_io[i, j] = Codes[rid_io[0, i], j]
                    for i, g in T.Parallel(HE, KS):  # decoded once per group
                        if words:
                            h_io[i, g] = _half_scale(T, T.bitwise_and(T.shift_right(Scales[rid_io[0, i], g // 4],
                                                                                    (g % 4) * 8), 255))
                        else:
                            h_io[i, g] = _half_scale(T, Scales[rid_io[0, i], g])
                with P.vector(cfg.threads):
                    for i, d in T.Parallel(HE, D):
                        k_io[i, d] = T.cast(_key_value(T, c_io[i, d // 8], h_io[i, d // GROUP], d), dtype)
                scores(k_io, k_op, q_op, acc, part, s_io, w_io, o_io, Out, qb0, ne, scale)

    return kernel


KERNEL = Kernel(NAME, body, configs={"default": Config(), "c": Config(threads=1)})


def variant(q: torch.Tensor, shared: bool) -> Variant:
    """The kernel variant `run` launches for q [S, nI, dI] (no tensor values are read: meta tensors work)."""
    _, heads, dim = q.shape
    if shared:
        return Variant(heads, dim, dtypes.name(q.dtype), True, SHARED_BLOCK_Q, SHARED_BLOCK_E)
    return Variant(heads, dim, dtypes.name(q.dtype), False)


def run(launch, q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
        weights: torch.Tensor, scale: float) -> torch.Tensor:
    require(q.dim() == 3, NAME, f"q must be [S, nI, dI], got {list(q.shape)}")
    s, h, d = q.shape
    require(q.dtype in dtypes.NAMES, NAME, f"q must be one of {', '.join(dtypes.NAMES.values())}, got {q.dtype}")
    require(d > 0 and d % GROUP == 0, NAME, f"dI must be a multiple of {GROUP} (one ue8m0 scale per {GROUP}), got {d}")
    require(codes.dtype == torch.uint8 and scales.dtype == torch.uint8, NAME,
            f"codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    require(codes.dim() == 2 and codes.shape[1] == d // 2, NAME,
            f"codes must be [N, dI / 2] = [N, {d // 2}], got {list(codes.shape)}")
    require(scales.dim() == 2 and scales.shape[1] == d // GROUP and scales.shape[0] == codes.shape[0], NAME,
            f"scales must be [N, dI / {GROUP}] = [{codes.shape[0]}, {d // GROUP}], got {list(scales.shape)}")
    indexer_scores.check_rows_weights(NAME, rows, weights, s, h)
    e = rows.shape[-1]
    v = variant(q, rows.dim() == 1)
    if s == 0 or e == 0:
        return torch.zeros(s, e, dtype=torch.float32, device=q.device)
    require(codes.shape[0] > 0, NAME, "rows given but the store has no rows")
    idx = indexer_scores.pad_rows(rows, v.shared, v.block_e)
    qq, w = indexer_scores.pad_queries(q, weights, v.block_q)
    out = torch.empty(qq.shape[0], idx.shape[1], v.block_e, dtype=torch.float32, device=q.device)
    sc = scales.contiguous()  # the kernel reads code (and at dI % 128 == 0 scale) bytes as int32 words
    sc = sc.view(torch.int32) if scale_words(d) else sc
    launch(NAME, v)(qq.view(-1, d), codes.contiguous().view(torch.int32), sc, idx, w, out, float(scale))
    return indexer_scores.unpad(out, s, e)


def example(v: Variant, rows: int, device, keys: int = 37) -> tuple:
    """`rows` queries and `keys` keys each (per query, or shared), gathered (repeated, out of order) from a store of
    2 * keys + 5 rows of random code bytes (every nibble) and scale bytes 2^-4 .. 2^4; q ~ N(0, 1) in v.dtype,
    weights ~ N(0, 1 / nI), scale dI^-0.5 (the model's)."""
    n = 2 * keys + 5
    codes = torch.randint(0, 256, (n, v.dim // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(127 - 4, 127 + 5, (n, v.dim // GROUP), dtype=torch.uint8, device=device)
    ids = torch.randint(0, n, (keys,) if v.shared else (rows, keys), device=device)
    if keys > 1:
        ids[..., 1] = ids[..., 0]  # a repeat
    q = torch.randn(rows, v.heads, v.dim, device=device).to(dtypes.torch_dtype(v.dtype))
    w = torch.randn(rows, v.heads, device=device) * v.heads**-0.5
    return (q, codes, scales, ids, w, v.dim**-0.5)


def error_bound(q, codes, scales, rows, weights, scale, accumulate_ulps: float = 1.0) -> torch.Tensor:
    """An elementwise bound of |kernel - reference| [S, E]: `indexer_scores.summation_bound` of B = the reference on
    absolute values (e2m1 times a power of two is exact in bf16: the products stay exact in fp32)."""
    b = reference(q.abs(), codes & 0x77, scales, rows, weights.abs(), scale)  # sign bits off: |k|
    return indexer_scores.summation_bound(b, q.shape[-2], q.shape[-1], accumulate_ulps)


OP = OpDecl(
    NAME, "lightning indexer scores over FP4-cached keys gathered by storage row", reference,
    kernels=(KERNEL,),
    # fp32 summation order only (the products of bf16 q and keys are exact in fp32): `error_bound` is the
    # elementwise bound the tests check; at V4.1 widths (nI 32, dI 128) and `example`'s magnitudes B stays below
    # ~2.5e3 (scores themselves ~10, up to ~100), so 2 * (128 + 32 + 3) * 2^-24 * 2.5e3 ~ 5e-2 absolute (x2 for
    # tensor-core adders) covers every score; a wrong head, key or scale moves a score by O(B).
    tolerance={"float32": (5e-2, 0.0), "bfloat16": (1e-1, 0.0)},
    run=run, example=example,
)
