"""sm90 override of sparse_attention's `split` and `whole` kernels for 64-head groups (FlashMLA-style).

One CTA per (query, split, 64-head group): the 64 heads' queries [64, D] sit in shared memory once (loaded
with cp.async, overlapping the first gather) and the split's listed KV rows stream through a double-buffered
shared tile of `rows` rows (several of `run`'s 32-row index blocks per step), gathered row by row with 16-byte
cp.async copies whose row numbers come from the split's index list staged in shared memory (up to `idx_chunk`
blocks at a time). S = Q K^T and O += P V are wgmma (M = 64: the two warpgroups split N), V being the same
gathered tile read as the [K, N] operand (no transposed copy); online softmax in fp32. The kernel signature and
outputs are the portable `split` body's: Op holds the unnormalised output and Stats (running max, running sum)
per head, merged by the portable `combine`; the `whole` form (a plan of one split: prefill, large decode
batches) merges the sink itself and stores the normalised output in q's dtype. `run`'s `plan` splits these
variants in whole 64-row steps over about one wave of CTAs (`SPLIT_ROWS`, `TARGET_CTAS`).

Empty slots (-1) gather row 0 (finite values: a masked column's P is 0, and 0 * finite V adds nothing) and are
masked to -inf before the max; the running max starts at -1e30, so a tile or a whole split without a valid
row gives P = 0, alpha = 1 and Stats (-1e30, 0), which `combine` weighs by exp(-1e30 - m) = 0.
"""


import dataclasses
from dataclasses import dataclass
from typing import Any

HEADS = 64  # heads per CTA: the wgmma M of one warpgroup row
DIMS = (512,)  # head dims the shared-memory budget is planned for (Q 64 KB + 2 x 64 KB of KV rows)
DTYPES = ("bfloat16",)  # the one dtype run on the H200 (fp16 would lower the same way, untested)
SPLIT_ROWS = 64  # `plan` splits wide variants in whole steps of this many rows (Tune.rows divides it)
TARGET_CTAS = 132  # ... into about this many CTAs: one wave on the H200's 132 SMs (one CTA per SM)


@dataclass(frozen=True)
class Tune:
    """Tile config of the override (the `sm90` Config of the op carries one)."""

    rows: int = 64  # KV rows per step (a multiple of the variant's block_k)
    stages: int = 2  # shared KV tiles in flight (T.Pipelined stages; 3+ fail to lower with a runtime trip count)
    threads: int = 256  # two warpgroups: each holds half of O's columns (128 fp32 registers a thread)
    idx_chunk: int = 64  # index blocks staged in shared memory at a time (0: every step reads Idx from global,
    #                      which puts an L2 round trip before each step's gather)
    lazy_sum: bool = True  # running sums kept per thread and reduced once at the end (one cross-warpgroup
    #                        reduction less per step)


def fits(v) -> bool:
    """The variants the override takes: 64-head groups, head dim 512, bf16."""
    return v.heads % HEADS == 0 and v.dim in DIMS and v.dtype in DTYPES


def body(P, v, cfg):
    """The split kernel; `cfg` is the op's Config (its `sm90` field a Tune)."""
    return _body(P, v, cfg, whole=False)


def whole_body(P, v, cfg):
    """The `whole` kernel (one split: the sink merged and the output normalised here, stored in q's dtype)."""
    return _body(P, v, cfg, whole=True)


def _body(P, v, cfg, whole: bool):
    tune: Tune = cfg.sm90
    T = P.T
    H, D, dtype, BK = v.heads, v.dim, v.dtype, v.block_k
    BR, HC = tune.rows, HEADS
    assert BR % BK == 0, f"rows per step {BR} must be a multiple of the index block {BK}"
    G = BR // BK  # index blocks per step
    HB = H // HC
    CH = tune.idx_chunk
    assert CH % G == 0, f"the index chunk ({CH} blocks) must be whole steps of {G} blocks"
    S, PR, NS, KB = T.dynamic("S"), T.dynamic("PR"), T.dynamic("NS"), T.dynamic("KB")
    NEG = -1e30
    LW = BR if tune.lazy_sum else 1  # width of the running-sum state

    @T.macro
    def attend(Q, KV, Idx, Op, Stats, Sinks, Out, scale):
        with T.Kernel(S * HB * NS, threads=tune.threads) as pid:
            q_s = T.alloc_shared((HC, D), dtype)
            kv_s = T.alloc_shared((BR, D), dtype)
            p_s = T.alloc_shared((HC, BR), dtype)
            idx_s = T.alloc_shared((max(CH, 1) * BK,), "int32", scope="shared")  # static: apart from the tiles
            acc_s = T.alloc_fragment((HC, BR), "float32")
            acc_o = T.alloc_fragment((HC, D), "float32")
            m_i = T.alloc_fragment((HC,), "float32")  # running max (scaled scores)
            m_t = T.alloc_fragment((HC,), "float32")  # this step's max
            l_i = T.alloc_fragment((HC, LW), "float32")  # running sum (per thread's columns when lazy)
            l_t = T.alloc_fragment((HC,), "float32")
            alpha = T.alloc_fragment((HC,), "float32")
            # truncating divisions: pid and NS are non-negative (see the portable body)
            s = T.truncdiv(pid, HB * NS)
            h0 = T.truncmod(T.truncdiv(pid, NS), HB) * HC
            sp = T.truncmod(pid, NS)
            # cp.async, not waited for here: the pipeline's first wait (all but the newest group) covers it, so
            # the query's load overlaps the index staging and the first gather
            T.async_copy(Q[s, h0 : h0 + HC, 0:D], q_s)
            T.fill(acc_o, 0.0)
            T.fill(m_i, NEG)
            T.fill(l_i, 0.0)
            for c in T.serial(T.ceildiv(KB, CH) if CH else 1):
                nb = T.min(CH, KB - c * CH) if CH else KB  # index blocks of this chunk
                if CH:
                    for j in T.Parallel(CH * BK):
                        idx_s[j] = T.if_then_else(j < nb * BK, Idx[s, sp, c * CH + j // BK, j % BK], -1)
                for it in T.Pipelined(T.ceildiv(nb, G), num_stages=tune.stages):
                    # gather (an empty slot reads row 0: finite values, masked below)
                    for r, d in T.Parallel(BR, D):
                        kv_s[r, d] = KV[T.max(_slot(T, tune, KB, BK, Idx, idx_s, s, sp, it, r), 0), d]
                    T.gemm(q_s, kv_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    for h, r in T.Parallel(HC, BR):
                        listed = _slot(T, tune, KB, BK, Idx, idx_s, s, sp, it, r)
                        acc_s[h, r] = T.if_then_else(listed >= 0, acc_s[h, r] * scale, -T.infinity("float32"))
                    T.reduce_max(acc_s, m_t, dim=1, clear=True)
                    for h in T.Parallel(HC):
                        m_t[h] = T.max(m_t[h], m_i[h])
                        alpha[h] = T.exp(m_i[h] - m_t[h])
                        m_i[h] = m_t[h]
                    for h, r in T.Parallel(HC, BR):
                        acc_s[h, r] = T.exp(acc_s[h, r] - m_i[h])
                    if tune.lazy_sum:
                        for h, r in T.Parallel(HC, BR):
                            l_i[h, r] = l_i[h, r] * alpha[h] + acc_s[h, r]
                    else:
                        T.reduce_sum(acc_s, l_t, dim=1, clear=True)
                        for h in T.Parallel(HC):
                            l_i[h, 0] = l_i[h, 0] * alpha[h] + l_t[h]
                    for h, d in T.Parallel(HC, D):
                        acc_o[h, d] = acc_o[h, d] * alpha[h]
                    T.copy(acc_s, p_s)
                    T.gemm(p_s, kv_s, acc_o, policy=T.GemmWarpPolicy.FullRow)  # V = the same rows, [K, N]
            T.reduce_sum(l_i, l_t, dim=1, clear=True)
            if whole:  # combine's merge with the sink as the only other part: o * b / (a + b * l)
                for h in T.Parallel(HC):
                    top = T.max(Sinks[h0 + h, 0], m_i[h])
                    alpha[h] = T.exp(m_i[h] - top) / (T.exp(Sinks[h0 + h, 0] - top) + T.exp(m_i[h] - top) * l_t[h])
                for h, d in T.Parallel(HC, D):
                    Out[s, h0 + h, d] = T.cast(acc_o[h, d] * alpha[h], dtype)
            else:
                T.copy(acc_o, Op[s, sp, h0 : h0 + HC, 0:D])
                for h in T.Parallel(HC):
                    Stats[s, sp, h0 + h, 0] = m_i[h]
                    Stats[s, sp, h0 + h, 1] = l_t[h]

    return prim_func(T, attend, v, whole, (S, PR, NS, KB))


def prim_func(T, attend, v, whole: bool, sizes):
    """The kernel of `attend(Q, KV, Idx, Op, Stats, Sinks, Out, scale)` (a T.macro over the runtime `sizes` S, PR,
    NS, KB) with the signature of `whole` (Sinks [H, 1] fp32 and Out) or of `split` (Op and Stats); shared by this
    override and the portable bodies."""
    Tn, H, D, BK, dtype = T.Tensor, v.heads, v.dim, v.block_k, v.dtype
    S, PR, NS, KB = sizes
    if whole:
        @T.prim_func
        def kernel(Q: Tn((S, H, D), dtype), KV: Tn((PR, D), dtype), Idx: Tn((S, NS, KB, BK), "int32"),
                   Sinks: Tn((H, 1), "float32"), Out: Tn((S, H, D), dtype), scale: T.float32):
            attend(Q, KV, Idx, None, None, Sinks, Out, scale)
    else:
        @T.prim_func
        def kernel(Q: Tn((S, H, D), dtype), KV: Tn((PR, D), dtype), Idx: Tn((S, NS, KB, BK), "int32"),
                   Op: Tn((S, NS, H, D), "float32"), Stats: Tn((S, NS, H, 2), "float32"), scale: T.float32):
            attend(Q, KV, Idx, Op, Stats, None, None, scale)
    return kernel


def _slot(T, tune: Tune, KB, BK, Idx, idx_s, s, sp, it, r):
    """The KV row listed at row r of step `it` (-1: empty, also past the split's KB blocks): from the chunk staged
    in shared memory, or (idx_chunk 0) from Idx."""
    if tune.idx_chunk:
        return idx_s[it * tune.rows + r]
    g = tune.rows // BK
    kb = it * g + r // BK
    if g == 1:
        return Idx[s, sp, kb, r % BK]
    return T.if_then_else(kb < KB, Idx[s, sp, T.min(kb, KB - 1), r % BK], -1)


@dataclass(frozen=True)
class Trial:
    """A tuning build of the `split` kernel (for timing scripts): the override with `tune`, or the portable body
    when `tune` is None. Its own cache key (the trial is the request's variant)."""

    variant: Any
    tune: Tune | None = None


def trial_request(op: str, kernel: str, trial: Trial):
    """The build request of a Trial (module level: `codegen.driver.build_all` workers import it by name)."""
    from codegen import Request
    from tilekernels.lang import Facade
    from tilekernels.ops import sparse_attention as sa

    assert (op, kernel) == ("sparse_attention", "split"), f"trials build sparse_attention.split, not {op}.{kernel}"
    base = sa.KERNELS[0].config("sm90")

    def build(target):
        P = Facade(target.traits)
        if trial.tune is None:
            return sa.split_body(P, trial.variant, base)
        return body(P, trial.variant, dataclasses.replace(base, sm90=trial.tune))

    return Request(op, kernel, trial, build, lambda target: dict(base.pass_configs))
