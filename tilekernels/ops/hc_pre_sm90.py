"""sm_90a override of `hc_pre_fused`: the whole mHC pre-block of prefill rows in one pass over the streams.

The two-kernel form (`hc_pre_split`, then `hc_pre_finish`) reads the streams twice: the partials need each row's
whole dot products before the finish can collapse it, so at 4,096 V4-Flash rows 2 x 134 MB are read for 34 MB
written (at most 55 % of the copy bandwidth counted on one read, even were both kernels at the copy bandwidth).
Here a cluster of `cluster` CTAs takes `block_m` rows; CTA r of the cluster loads, and keeps in shared memory, its
H / cluster columns of each of the N streams (64 KB at the defaults). Then:

1. The partial mixing products of its columns on wgmma, the GEMM transposed against `hc_mixes_sm90`'s: A is the
   mixing weights split in shared memory into hi = bf16(f) and lo = bf16(f - hi) rows (2 * MIX <= 64 rows, exact
   to 2^-18 relative per product as there), B the stream tile [block_m, 64] (wgmma N = block_m), fp32
   accumulation. The sums of squares on the CUDA cores from the same tiles. A producer warpgroup issues every
   stream tile's TMA copy at once (each its own barrier) and streams the weights through a ring of `stages`.
2. Row i's partials (MIX products and the sum of squares) go into the shared memory of its owner, CTA
   i // (block_m / cluster), over the cluster's distributed shared memory; cluster barrier.
3. The owner sums the cluster's partials in rank order (deterministic), and runs the tail on one warp: 16 lanes a
   row (N = 4), one comb element a lane, row and column sums through shuffles (the reference's order: left to
   right), the softmax and Sinkhorn as `hc_mixes.mixes_body`'s tail; stores post and comb; sends the pre mix to
   every CTA of the cluster; cluster barrier.
4. Every CTA collapses its own columns of the block_m rows from shared memory and stores them. The norm form first
   exchanges each row's partial sum of squares of its columns (bf16-rounded, as `rms_norm` reads them; a third
   cluster barrier) and stores the row normalized with the weight.

Not batch invariant against the decode form (other column partition and order than `hc_mixes_sm90`'s split
partials): `hc_pre.run` launches it only outside the batch-invariant mode, above `hc_pre.FUSED_MIN_ROWS` rows.
A row's bits do not depend on the other rows.
"""

from dataclasses import dataclass

from tilekernels.op import require


def remote_store(buf, value, rank, index):
    """buf's element `index` (row-major) in the shared memory of the cluster's CTA `rank` = value (a
    distributed-shared-memory store; ordered for the peer by the next cluster barrier)."""
    from tvm import tirx  # TileLang's TVM (importable once tilelang is)

    return tirx.call_intrin("handle", tirx.op.Op.get("tl.ptx_cluster_store"), buf.access_ptr("w"), value, rank, index)


@dataclass(frozen=True)
class Tune:
    """`cluster` CTAs per row tile (each holds H / cluster columns of every stream), `block_m` rows per tile
    (wgmma N; a multiple of `cluster` / 1 ... : each CTA owns block_m / cluster rows' tails), `block_k` columns per
    GEMM step, `stages` weight tiles in flight, `min_blocks` CTAs per SM the registers must allow."""

    cluster: int = 16
    block_m: int = 32
    block_k: int = 64
    stages: int = 3
    sq_lanes: int = 16
    min_blocks: int = 2


TUNE = Tune()
# The peers store into a CTA's exchange buffers whenever they reach that step, also while the CTA itself is still
# in its GEMM: TileLang's reuse of shared memory between buffers of disjoint lifetimes would overlay them on the
# weight ring
PASS_CONFIGS = {"tl.disable_shared_memory_reuse": True}
THREADS = 256  # a consumer warpgroup (wgmma m64), then a producer warpgroup (the TMA copies)


def fits(v, tune: Tune = TUNE) -> bool:
    """bf16 streams of N = 4 (16 lanes a comb matrix), H a whole number of `block_k` steps per CTA."""
    return (v.dtype == "bfloat16" and v.hc == 4 and v.hidden % (tune.cluster * tune.block_k) == 0
            and 2 * (2 + v.hc) * v.hc <= 64)


def smem_bytes(v, tune: Tune = TUNE) -> int:
    """Shared memory of one CTA: the stream tiles, the weight ring and its split operand, the exchanges (no two
    buffers share memory: `PASS_CONFIGS`; the norm form collapses in place of stream 0)."""
    N, H = v.hc, v.hidden
    MIX, C, BM, BK = (2 + N) * N, tune.cluster, tune.block_m, tune.block_k
    HC = H // C
    streams = N * HC * BM * 2
    weights = tune.stages * MIX * BK * 4 + 64 * BK * 2
    acc = 64 * BM * 4
    xch = (2 * BM * 32 + (BM // C) * N + BM * N + ((1 + C) * BM if v.norm else 0)) * 4
    return streams + weights + acc + xch


def body(P, v, cfg=None, tune: Tune | None = None):
    """`hc_pre_fused` on sm_90a: S [M, N*H] bf16, Fn [MIX, N*H] fp32, Base [MIX], Scale [3] -> Post [M, N],
    Comb [M, N*N], Out [M, H] (normalized with Wn [H] in the norm form); one cluster per `block_m` rows."""
    tune = tune or TUNE
    T = P.T
    require(fits(v, tune), "hc_pre", f"the sm_90a one-pass pre-block takes bf16, N = 4, H a multiple of "
            f"{tune.cluster * tune.block_k}; got {v}")
    C, BM, BK, ST, SL = tune.cluster, tune.block_m, tune.block_k, tune.stages, tune.sq_lanes
    require(BM % C == 0 and BM % 8 == 0 and BM <= 64 and (BM // C) % 2 == 0 and 16 * (BM // C) <= 128
            and BK % SL == 0, "hc_pre", f"bad tile {tune}: block_m a multiple of 8 and of 2 * cluster (the tail's "
            f"lanes fill whole warps), at most 64 rows")
    R = BM // C
    require((C * R * 32) % THREADS == 0 and C * R * v.hc <= THREADS and (C * R * v.hc) % 32 == 0, "hc_pre",
            f"bad tile {tune}: the exchanges need cluster * rows per CTA * 32 a multiple of {THREADS} and cluster * "
            f"rows per CTA * N a whole number of warps up to {THREADS}")
    smem = smem_bytes(v, tune)
    require(smem <= 227 * 1024, "hc_pre", f"tile {tune} needs {smem} B of shared memory (227 KB per CTA)")
    N, H, dtype, NORM = v.hc, v.hidden, v.dtype, v.norm
    KN, MIX, E = N * H, (2 + N) * N, N * N
    HC = H // C  # columns of each stream per CTA
    KB = HC // BK  # GEMM steps per stream
    KT = N * KB  # GEMM steps per CTA
    R = BM // C  # rows whose tail a CTA runs
    NL = THREADS // BM  # lanes a row of the norm's sums of squares
    WP = 32  # a row's partials (the MIX products, then the sum of squares) padded: the exchange's C * R * WP
    # stores are whole rounds of the threads
    F32 = "float32"
    M = T.dynamic("M")

    def ordered(vals):  # left to right, as the reference's row and column sums
        total = vals[0]
        for x in vals[1:]:
            total = total + x
        return total

    def row_total(c, i):  # lanes of a row are 16-lane segments: element (i, k) is lane i N + k
        return ordered([T.shfl_sync(c, i * N + k, 16) for k in range(N)])

    def col_total(c, j):
        return ordered([T.shfl_sync(c, k * N + j, 16) for k in range(N)])

    def row_max(x, i):
        best = T.shfl_sync(x, i * N, 16)
        for k in range(1, N):
            best = T.max(best, T.shfl_sync(x, i * N + k, 16))
        return best

    def norm_total(nx, ii):
        return ordered([nx[q, ii] for q in range(C)])

    @T.macro
    def tail(xch, pre_l, Base, Scale, Post, Comb, ss, d, c, m0, r, tx, hc_eps, norm_eps):
        """Lanes tx < 16 R: row tx // 16 of this CTA's R, comb element e = tx % 16 = (i, j); ss, d [3] (the summed
        products: comb (i, j), then pre e and post e for e < N) and c: the lane's registers."""
        e = tx % 16
        i = e // N
        j = e % N
        row = r * R + tx // 16  # within the tile
        ss[0] = xch[0, tx // 16, MIX]
        d[0] = xch[0, tx // 16, 2 * N + e]
        d[1] = xch[0, tx // 16, T.min(e, N - 1)]
        d[2] = xch[0, tx // 16, N + T.min(e, N - 1)]
        for q in T.serial(1, C):  # the cluster's parts in rank order
            ss[0] = ss[0] + xch[q, tx // 16, MIX]
            d[0] = d[0] + xch[q, tx // 16, 2 * N + e]
            d[1] = d[1] + xch[q, tx // 16, T.min(e, N - 1)]
            d[2] = d[2] + xch[q, tx // 16, N + T.min(e, N - 1)]
        rs = T.rsqrt(ss[0] / KN + norm_eps)
        if e < N:
            pre_l[tx // 16, e] = 1.0 / (1.0 + T.exp(-(d[1] * rs * Scale[0] + Base[e]))) + hc_eps
            if m0 + row < M:
                Post[m0 + row, e] = 2.0 / (1.0 + T.exp(-(d[2] * rs * Scale[1] + Base[N + e])))
        logit = d[0] * rs * Scale[2] + Base[2 * N + e]
        c[0] = T.exp(logit - row_max(logit, i))
        c[0] = c[0] / row_total(c[0], i) + hc_eps
        c[0] = c[0] / (col_total(c[0], j) + hc_eps)
        for _ in T.serial(v.iters - 1):
            c[0] = c[0] / (row_total(c[0], i) + hc_eps)
            c[0] = c[0] / (col_total(c[0], j) + hc_eps)
        if m0 + row < M:
            Comb[m0 + row, e] = c[0]

    @T.macro
    def add_squares(s_all, kk, sq):
        for ii, l in T.Parallel(BM, SL):
            for jj in T.serial(BK // SL):
                x = T.cast(s_all[kk, ii, jj * SL + l], F32)
                sq[ii, l] = sq[ii, l] + x * x

    def collapsed(pre_s, s_all, ii, col):  # hc_collapse's sum, in its order
        b, jj = col // BK, col % BK
        total = pre_s[ii, 0] * T.cast(s_all[b, ii, jj], F32)
        for n in range(1, N):
            total = total + pre_s[ii, n] * T.cast(s_all[n * KB + b, ii, jj], F32)
        return total

    Tn = T.Tensor

    @T.macro
    def kernel_body(S, Fn, Base, Scale, Post, Comb, Out, Wn, hc_eps, norm_eps):
        with T.Kernel(T.ceildiv(M, BM) * C, threads=THREADS, cluster_dims=(C, 1, 1)) as bx:
            T.annotate_min_blocks_per_sm(tune.min_blocks)
            T.disable_warp_group_reg_alloc()
            s_all = T.alloc_shared((KT, BM, BK), dtype)
            f_s = T.alloc_shared((ST, MIX, BK), F32)
            a_f = T.alloc_shared((64, BK), dtype)  # one: each step's wgmma is waited for before the next split
            d_s = T.alloc_shared((64, BM), F32)
            x_l = T.alloc_shared((BM, WP), F32)  # this CTA's partials of the tile's rows
            xch = T.alloc_shared((C, R, WP), F32)  # the cluster's partials of this CTA's R rows, by rank
            pre_l = T.alloc_shared((R, N), F32)
            pre_s = T.alloc_shared((BM, N), F32)
            s_full = T.alloc_barrier([128] * KT)
            f_full = T.alloc_barrier([128] * ST)
            f_empty = T.alloc_barrier([128] * ST)
            acc = T.alloc_fragment((64, BM), F32)
            sq = T.alloc_fragment((BM, SL), F32)
            ss = T.alloc_fragment((BM,), F32)
            t_ss = T.alloc_local((1,), F32)
            t_d = T.alloc_local((3,), F32)
            t_c = T.alloc_local((1,), F32)
            if NORM:
                nsq = T.alloc_shared((BM,), F32)
                nx = T.alloc_shared((C, BM), F32)
                part = T.alloc_fragment((BM, NL), F32)
                rows = T.alloc_fragment((BM,), F32)
            tx = T.get_thread_binding()
            r = bx % C
            m0 = bx // C * BM
            T.cluster_arrive_relaxed()  # waited for before the first remote store: every peer has started
            if tx >= 128:  # the first weight tiles, every stream tile, then the weights as the ring frees
                for kk in T.serial(T.min(ST, KT)):
                    col = kk // KB * H + r * HC + kk % KB * BK
                    T.tma_copy(Fn[0:MIX, col:col + BK], f_s[kk, :, :], barrier=f_full[kk])
                    T.mbarrier_arrive(f_full[kk])
                for kk in T.serial(KT):
                    col = kk // KB * H + r * HC + kk % KB * BK
                    T.tma_copy(S[m0:m0 + BM, col:col + BK], s_all[kk, :, :], barrier=s_full[kk])
                    T.mbarrier_arrive(s_full[kk])
                for kk in T.serial(ST, KT):
                    col = kk // KB * H + r * HC + kk % KB * BK
                    T.mbarrier_wait_parity(f_empty[kk % ST], (kk // ST) % 2 ^ 1)
                    T.tma_copy(Fn[0:MIX, col:col + BK], f_s[kk % ST, :, :], barrier=f_full[kk % ST])
                    T.mbarrier_arrive(f_full[kk % ST])
            else:
                T.clear(acc)
                T.clear(sq)
                for kk in T.serial(KT):
                    T.mbarrier_wait_parity(f_full[kk % ST], (kk // ST) % 2)
                    for o, jj in T.Parallel(64, BK):  # hi rows, lo rows, then zeros
                        f = T.if_then_else(o < 2 * MIX, f_s[kk % ST, o % MIX, jj], 0.0)
                        hi = T.cast(f, dtype)
                        a_f[o, jj] = T.if_then_else(o < MIX, hi, T.cast(f - T.cast(hi, F32), dtype))
                    T.mbarrier_arrive(f_empty[kk % ST])
                    T.fence_proxy_async()
                    T.sync_threads(1, 128)
                    T.mbarrier_wait_parity(s_full[kk], 0)
                    T.wgmma_gemm(a_f, s_all[kk, :, :], acc, transpose_B=True,
                                 policy=T.GemmWarpPolicy.FullRow)
                    add_squares(s_all, kk, sq)
                    T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc, num_regs=64 * BM // 128)
                T.reduce_sum(sq, ss, dim=1)
                T.copy(acc, d_s)
                for ii in T.Parallel(BM):
                    x_l[ii, MIX] = ss[ii]
            T.sync_threads()
            for ii, o in T.Parallel(BM, MIX):
                x_l[ii, o] = d_s[o, ii] + d_s[MIX + o, ii]
            T.cluster_wait()
            T.sync_threads()
            for it in T.serial(C * R * WP // THREADS):  # rows q R ... of the tile to their owner q, at rank r
                q = (it * THREADS + tx) // (R * WP)
                k = (it * THREADS + tx) % (R * WP)
                remote_store(xch, x_l[q * R + k // WP, k % WP], q, r * R * WP + k)
            T.cluster_sync()
            if tx < 16 * R:
                tail(xch, pre_l, Base, Scale, Post, Comb, t_ss, t_d, t_c, m0, r, tx, hc_eps, norm_eps)
            T.sync_threads()
            if tx < C * R * N:  # this CTA's rows' pre mix to every CTA
                remote_store(pre_s, pre_l[tx % (R * N) // N, tx % N], tx // (R * N), r * R * N + tx % (R * N))
            T.cluster_sync()
            if NORM:
                for ii, col in T.Parallel(BM, HC):
                    # in place of stream 0's value (each element read and written by one thread)
                    s_all[col // BK, ii, col % BK] = T.cast(collapsed(pre_s, s_all, ii, col), dtype)
                for ii, l in T.Parallel(BM, NL):  # NL lanes a row, each over every NL-th column
                    part[ii, l] = 0.0
                    for jj in T.serial(HC // NL):
                        x = T.cast(s_all[(jj * NL + l) // BK, ii, (jj * NL + l) % BK], F32)
                        part[ii, l] = part[ii, l] + x * x
                T.reduce_sum(part, rows, dim=1)
                T.copy(rows, nsq)
                T.sync_threads()
                for it in T.serial(-(-C * BM // THREADS)):  # the rows' partial sums of squares to every CTA
                    if it * THREADS + tx < C * BM:
                        remote_store(nx, nsq[(it * THREADS + tx) % BM], (it * THREADS + tx) // BM,
                                     r * BM + (it * THREADS + tx) % BM)
                T.cluster_sync()
                for ii, col in T.Parallel(BM, HC):
                    if m0 + ii < M:
                        Out[m0 + ii, r * HC + col] = T.cast(
                            T.cast(s_all[col // BK, ii, col % BK], F32) * T.rsqrt(norm_total(nx, ii) / H + norm_eps)
                            * Wn[r * HC + col], dtype)
            else:
                for ii, col in T.Parallel(BM, HC):
                    if m0 + ii < M:
                        Out[m0 + ii, r * HC + col] = T.cast(collapsed(pre_s, s_all, ii, col), dtype)

    if NORM:
        @T.prim_func
        def kernel(S: Tn((M, KN), dtype), Fn: Tn((MIX, KN), F32), Base: Tn((MIX,), F32), Scale: Tn((3,), F32),
                   Post: Tn((M, N), F32), Comb: Tn((M, E), F32), Out: Tn((M, H), dtype), Wn: Tn((H,), F32),
                   hc_eps: T.float32, norm_eps: T.float32):
            kernel_body(S, Fn, Base, Scale, Post, Comb, Out, Wn, hc_eps, norm_eps)
    else:
        @T.prim_func
        def kernel(S: Tn((M, KN), dtype), Fn: Tn((MIX, KN), F32), Base: Tn((MIX,), F32), Scale: Tn((3,), F32),
                   Post: Tn((M, N), F32), Comb: Tn((M, E), F32), Out: Tn((M, H), dtype), hc_eps: T.float32,
                   norm_eps: T.float32):
            kernel_body(S, Fn, Base, Scale, Post, Comb, Out, None, hc_eps, norm_eps)
    return kernel


def trial_request(op: str, kernel: str, variant):
    """Build request of a tune trial: "hc_pre_fused@<field=value,...>" is this kernel with those Tune fields
    (benchmark sweeps on the GPU; module level so that build workers import it), anything else the op's own."""
    from tilekernels.kernels import tune_request

    return tune_request(op, kernel, variant, body, TUNE, PASS_CONFIGS)
