"""The lightning indexer's prefill scores on sm_90a (keys shared by every query of a chunk): a whole-kernel override
of `indexer_scores` for its shared-rows variant. Same signature and result as the portable body.

The portable body's work tile is (2 queries, 64 keys): every tile reloads its queries' 128 x dI rows, gathers its
keys, runs one small GEMM and sums the heads through shared memory (13.6 ms for 16K queries x 4K keys on the H200,
~80 TFLOP/s). Here a CTA owns `queries` queries for the whole key range: their rows stay in shared memory (loaded
once), each key tile is gathered once for all of them, and per query one wgmma (keys x query heads, m64 n`heads`)
leaves the logits in registers, where ReLU, scale and head weight are applied and the heads summed (a register and
quad-shuffle reduction, no shared-memory round trip). The reference's order per logit (ReLU, * scale, * weight) is
kept; the head sum's order differs from the portable body's (scores agree to fp32 rounding).
"""

from dataclasses import dataclass

from tilekernels.op import require


@dataclass(frozen=True)
class Tune:
    """`queries` per CTA (their rows held in shared memory: queries x heads x dI x 2 bytes), `min_blocks` CTAs per
    SM the registers must allow (0: no bound)."""

    queries: int = 2  # tune_indexer_prefill.py on the H200: 2 / 3 5.20 ms at 16K x 4,096 keys, 4 / 2 5.68, 8 / 1 6.47
    min_blocks: int = 3


TUNE = Tune()


def fits(v) -> bool:
    """Shared rows (a prefill chunk), keys in q's dtype (bf16), key tiles of one warpgroup's 64 rows, heads a wgmma
    N (a multiple of 16 up to 256), dI a multiple of 16."""
    return (v.shared and v.keys is None and v.dtype == "bfloat16" and v.block_e == 64 and v.heads % 16 == 0
            and v.heads <= 256 and v.dim % 16 == 0)


def body(P, v, cfg=None, tune: Tune | None = None):
    """indexer_scores for shared rows on sm_90a; the portable body's signature: Q [S * nI, dI], Store [N, dI],
    Rows [1, NE, BE] int64, W [S, nI] fp32, Out [S, NE, BE] fp32, scale."""
    tune = tune or TUNE
    require(fits(v), "indexer_scores", f"the sm_90a prefill kernel takes shared bf16 rows in 64-key tiles, got {v}")
    T = P.T
    H, D, dtype, BE, QC = v.heads, v.dim, v.dtype, v.block_e, tune.queries
    S = T.dynamic("S")
    SQ = T.dynamic("SQ")
    SR = T.dynamic("SR")
    NE = T.dynamic("NE")
    N = T.dynamic("N")

    @T.prim_func
    def kernel(Q: T.Tensor((SQ, D), dtype), Store: T.Tensor((N, D), dtype), Rows: T.Tensor((SR, NE, BE), "int64"),
               W: T.Tensor((S, H), "float32"), Out: T.Tensor((S, NE, BE), "float32"), scale: T.float32):
        with T.Kernel(T.ceildiv(S, QC), threads=128) as bq:
            if tune.min_blocks:
                T.annotate_min_blocks_per_sm(tune.min_blocks)
            q_s = T.alloc_shared((QC * H, D), dtype)  # query qb's heads: rows qb * H ..
            k_s = T.alloc_shared((BE, D), dtype)
            w_s = T.alloc_shared((QC, H), "float32")
            rid = T.alloc_shared((BE,), "int64")
            acc = T.alloc_fragment((BE, H), "float32")
            red = T.alloc_fragment((BE,), "float32")
            q0 = bq * QC
            for qb in range(QC):
                if q0 + qb < S:
                    T.copy(Q[(q0 + qb) * H, 0], q_s[qb * H : qb * H + H, 0:D])
            for qb, h in T.Parallel(QC, H):
                w_s[qb, h] = T.if_then_else(q0 + qb < S, W[T.min(q0 + qb, S - 1), h], 0.0)
            for ne in T.serial(NE):
                T.copy(Rows[0, ne, 0:BE], rid)
                for i, d in T.Parallel(BE, D):
                    k_s[i, d] = Store[rid[i], d]
                for qb in range(QC):
                    if q0 + qb < S:
                        T.gemm(k_s, q_s[qb * H : qb * H + H, 0:D], acc, transpose_B=True, clear_accum=True)
                        for i, h in T.Parallel(BE, H):  # the reference's order: ReLU, * scale, * weight
                            acc[i, h] = T.max(acc[i, h], 0.0) * scale * w_s[qb, h]
                        T.reduce_sum(acc, red, dim=1)
                        for i in T.Parallel(BE):
                            Out[q0 + qb, ne, i] = red[i]

    return kernel


def trial_request(op: str, kernel: str, variant):
    """Build request of a tune trial: "indexer_scores@<field=value,...>" is this kernel with those Tune fields,
    "indexer_scores@portable" the portable body (benchmark sweeps; module level so that build workers import it)."""
    from tilekernels.kernels import tune_request
    from tilekernels.ops import indexer_scores

    return tune_request(op, kernel, variant, body, TUNE, cfg=indexer_scores.KERNEL.config("sm90"),
                        portable=indexer_scores.body)
