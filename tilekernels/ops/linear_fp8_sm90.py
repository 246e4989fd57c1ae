"""sm90 variants of the block-scaled FP8 GEMM (`linear_fp8`), chosen by fields of `linear_fp8.Config`; the
default config never reaches this file (`linear_fp8.body_native` keeps today's kernel). Compile-checked only
here (lowered for sm_90a and built with nvcc); `benchmarks/tune_fp8.py` measures them and checks their results
against the fp32 emulation on the H200.

Wider tiles (`slices`, `body_sliced`): a 128x128 tile streams 256 bytes from L2 per 32 K-flops, so at 1.5
PFLOP/s the SMs together would pull ~12 TB/s from L2 (an estimate, not measured); a 128x256 tile needs a third
less per flop. What stopped 128x256 before: one m64n256 wgmma per warpgroup wants a 128-register partial next to
the 128-register running sum (spills). Here the tile's columns are cut into `slices` of one weight scale block
each: each slice is its own m64n(BN/slices) wgmma into one shared partial accumulator, promoted into that
slice's own running sum (each running sum gets the partial's register layout and one scalar weight scale).
Registers per consumer thread at 128x256: 64 partial + 128 running = 192.

Explicit warp specialisation (`ws`, `body_ws`): see its docstring; optionally persistent (`programs`) and in
clusters of two CTAs that share the A tile by TMA multicast (`cluster`: the same third less L2 traffic as
128x256 tiles, at 128x128 registers).
"""

from tilekernels.op import require
from tilekernels.ops.linear_sm90 import staged_store

# The short-K prefill shapes' config (`Config.short_k`): 128x128 tiles, the ws body in chains of 8 K blocks, a
# persistent grid of one program per SM (132 on the H100 / H200). On the H200 (`benchmarks/tune_fp8.py`, BENCHMARKS.md
# "Native FP8 / FP4 weights, third round") it beat the 128x256 sliced tile where K is 1,024-2,048 (q_b 734 against 685
# TFLOP/s, the shared experts' down 888 against 806) and lost where K is 8,192 (o_b 1,031 against 1,135); on the H100
# with V4's exponent-byte scales (`tune_fp8.py --ue8m0`, "Twelfth round") q_b 693 against 600, down 797 against 776.
# It also serves the middle row bucket (65-511 rows, not narrow): q_b at 128 rows 0.0255 against 0.0282 ms, at 256
# 0.0431 against 0.0451 (`kernels.py`, H100). Since the twentieth round its output rows are staged in shared memory and
# stored by TMA without a wait (`tma_store`), in chains of 4: on the H100 at 4,096 rows (TFLOP/s against the 128x256
# sliced tile) q_b 853 against 588, q_a 933 against 874, shared gate_up 1,050 against 963, shared down 974 against 764,
# so `short_k` now reaches K = 4,096; o_b (K = 8,192) keeps the sliced tile (1,107 against 1,068).
SHORT_K = dict(block_n=128, stages=4, slices=0, ws=True, chain=4, programs=132, tma_store=True)


def body(P, v, cfg):
    """The variant `cfg` asks for (`ws`, else `slices`), or `linear_fp8.body_native` without these fields where
    the variant does not fit it (tiles that would straddle weight scale blocks, rows that are not whole 64-row
    warpgroups): so a config with these fields can serve every variant `linear` asks for."""
    from dataclasses import replace

    from tilekernels.ops import linear_fp8 as lf

    tma_ok = v.k % 16 == 0  # body_ws's explicit TMA copies need 16-byte row strides (odd K: a tiny config's)
    if cfg.short_k and v.k <= cfg.short_k and not v.narrow and v.split_k == 1 and v.groups == 1 \
            and v.block[0] % SHORT_K["block_n"] == 0 and tma_ok:
        cfg = replace(cfg, short_k=0, **SHORT_K)
    BM, BN, NT, BK, KT, KB, out_dtype, threads = lf._geometry(v, cfg)
    groups_ok = v.groups == 1 or v.n % v.block[0] == 0  # no tile straddles two groups' scale blocks
    if cfg.ws and tma_ok and groups_ok and v.block[0] % BN == 0 and threads % 128 == 0 \
            and BM == 64 * (threads // 128):
        return body_ws(P, v, cfg)
    S = cfg.slices
    measured = not v.narrow and v.split_k == 1  # the shapes benchmarks/tune_fp8.py measured (prefill rows)
    if not cfg.ws and S and measured and groups_ok and BN % S == 0 and v.block[0] % (BN // S) == 0 \
            and (BN // S) % 16 == 0:
        return body_sliced(P, v, cfg)
    plain = replace(cfg, ws=False, slices=0, programs=0, cluster=0,
                    block_n=cfg.block_n // S if S and not cfg.ws else cfg.block_n)
    return lf.body_native(P, v, plain)


def body_sliced(P, v, cfg):
    """128 x (S * 128) tiles, the promotion done per 128-column slice (see the module's docstring)."""
    from tilekernels.ops import linear_fp8 as lf

    T = P.T
    BM, BN, NT, BK, KT, KB, out_dtype, threads = lf._geometry(v, cfg)
    S = cfg.slices
    BS = BN // S  # inside one weight scale block (`body` checks): one scalar weight scale per slice
    G, SK, K, N = v.groups, v.split_k, v.k, v.n
    M = T.dynamic("M")
    a_shape, sa_shape, w_shape, sw_shape, c_shape = lf._signature(T, v, M)
    e4m3 = "float8_e4m3fn"
    sdt = lf._scale_dtype(v)
    policy = T.GemmWarpPolicy.FullRow if cfg.full_rows else T.GemmWarpPolicy.Square
    require(S in (1, 2, 3, 4), "linear", f"FP8 GEMM slices: 1-4 supported, got {S}")

    @T.macro
    def promote(part, total, sa_s, w):
        for i, j in T.Parallel(BM, BS):
            total[i, j] += part[i, j] * (sa_s[i] * lf._scale_value(T, v, w))

    @T.macro
    def slice_step(a_s, b_s, part, total, sa_s, ws, s: int):
        T.gemm(a_s, b_s[s * BS:(s + 1) * BS, :], part, transpose_B=True, clear_accum=True, policy=policy)
        promote(part, total, sa_s, ws[s])

    @T.prim_func
    def kernel(A: T.Tensor(a_shape, "uint8"), SA: T.Tensor(sa_shape, "float32"), W: T.Tensor(w_shape, "uint8"),
               SW: T.Tensor(sw_shape, sdt), C: T.Tensor(c_shape, out_dtype)):
        MT = T.ceildiv(M, BM)
        with T.Kernel(MT * NT * G * SK, threads=threads) as pid:
            Af = T.view(A, dtype=e4m3)
            Wf = T.view(W, dtype=e4m3)
            a_s = T.alloc_shared((BM, BK), e4m3)
            b_s = T.alloc_shared((BN, BK), e4m3)
            sa_s = T.alloc_fragment((BM,), "float32")
            ws = T.alloc_local((S,), sdt)
            part = T.alloc_fragment((BM, BS), "float32")
            t0 = T.alloc_fragment((BM, BS), "float32")
            t1 = T.alloc_fragment((BM, BS), "float32") if S > 1 else t0
            t2 = T.alloc_fragment((BM, BS), "float32") if S > 2 else t0
            t3 = T.alloc_fragment((BM, BS), "float32") if S > 3 else t0
            ks, g, m0, n0 = lf._tile(pid, v, NT, BM, BN)
            T.clear(t0)
            if S > 1:
                T.clear(t1)
            if S > 2:
                T.clear(t2)
            if S > 3:
                T.clear(t3)
            for kk in T.Pipelined(KT, num_stages=cfg.stages):
                kb = ks * KT + kk
                T.copy(Af[m0, g * K + kb * BK], a_s)
                T.copy(Wf[g * N + n0, kb * BK], b_s)
                for i in T.Parallel(BM):
                    sa_s[i] = SA[T.min(m0 + i, M - 1), g * KB + kb]
                for s in T.unroll(S):
                    ws[s] = lf._weight_scale_raw(T, v, SW, g, n0 + s * BS, kb)
                slice_step(a_s, b_s, part, t0, sa_s, ws, 0)
                if S > 1:
                    slice_step(a_s, b_s, part, t1, sa_s, ws, 1)
                if S > 2:
                    slice_step(a_s, b_s, part, t2, sa_s, ws, 2)
                if S > 3:
                    slice_step(a_s, b_s, part, t3, sa_s, ws, 3)
            if SK > 1:
                T.copy(t0, C[ks, m0, g * N + n0])
                if S > 1:
                    T.copy(t1, C[ks, m0, g * N + n0 + BS])
                if S > 2:
                    T.copy(t2, C[ks, m0, g * N + n0 + 2 * BS])
                if S > 3:
                    T.copy(t3, C[ks, m0, g * N + n0 + 3 * BS])
            else:
                T.copy(t0, C[m0, g * N + n0])
                if S > 1:
                    T.copy(t1, C[m0, g * N + n0 + BS])
                if S > 2:
                    T.copy(t2, C[m0, g * N + n0 + 2 * BS])
                if S > 3:
                    T.copy(t3, C[m0, g * N + n0 + 3 * BS])

    return kernel


def body_ws(P, v, cfg):
    """Explicitly warp-specialised: a producer warpgroup (TMA into `stages` slots, own full/empty mbarriers) and
    `threads` consumer threads that keep two K blocks' wgmmas in flight: block k's wgmma is issued into one of
    two partial accumulators, then block k-1's is waited for (`wait_wgmma(1)`), its slot released and its
    partial promoted while block k runs on the tensor cores. With `programs` > 0 the grid is persistent: each
    program walks tiles pid, pid + programs, ..., and its producer loads the next tile while the consumers store
    the last one (slot parities count K blocks over all the program's tiles)."""
    from tilekernels.ops import linear_fp8 as lf

    T = P.T
    BM, BN, NT, BK, KT, KB, out_dtype, threads = lf._geometry(v, cfg)
    G, SK, K, N, ST = v.groups, v.split_k, v.k, v.n, cfg.stages
    M = T.dynamic("M")
    a_shape, sa_shape, w_shape, sw_shape, c_shape = lf._signature(T, v, M)
    e4m3 = "float8_e4m3fn"
    sdt = lf._scale_dtype(v)
    policy = T.GemmWarpPolicy.FullRow if cfg.full_rows else T.GemmWarpPolicy.Square
    grid = cfg.programs
    U = min(cfg.chain, KT)
    CL = 2 if cfg.cluster == 2 and SK == 1 and NT % 2 == 0 else 1  # else no cluster (pairs share no A tile)
    require(grid % CL == 0, "linear", f"FP8 GEMM (ws): a persistent grid of {grid} programs in clusters of {CL}")

    def tile_of(t):
        # clusters: the pair (t even, t + 1) shares its rows and group (the multicast A tile); N tiles fastest
        if CL > 1:
            return 0, t // NT % G, t // (NT * G) * BM, t % NT * BN
        return lf._tile(t, v, NT, BM, BN)
    places = {n: list(range(n)) for n in range(1, U + 1)}
    staged = cfg.tma_store and SK == 1 and BM == 128 and threads == 256 and cfg.full_rows  # two 64-row warpgroups
    store_staged = staged_store(T, BN)

    @T.macro
    def promote(part, total, sa, w):
        for i, j in T.Parallel(BM, BN):
            total[i, j] += part[i, j] * (sa[i] * lf._scale_value(T, v, w[0]))

    @T.macro
    def load_scales(SA, SW, sa, w, g, m0, n0, kb):
        for i in T.Parallel(BM):
            sa[i] = SA[T.min(m0 + i, M - 1), g * KB + kb]
        w[0] = lf._weight_scale_raw(T, v, SW, g, n0, kb)

    @T.macro
    def release(empty, slot, tx):
        # cluster: both CTAs' consumers free a slot before either producer refills it (rank 0 writes A into both):
        # lane l of every consumer warp arrives at rank l's barrier
        if CL > 1:
            if tx % 32 < CL:
                T.mbarrier_arrive(empty[slot], cta_id=tx % 32)
        else:
            T.mbarrier_arrive(empty[slot])

    @T.macro
    def step(SA, SW, a_s, b_s, full, empty, parts, sas, ws, total, g, m0, n0, ks, kk, it, tx, u: int):
        # kk: the K block within this tile, it: the program's running K block count (slot and parity); u: its
        # place in the chain (static: picks the partial accumulator; the first has nothing to promote yet)
        load_scales(SA, SW, sas[u % 2], ws[u % 2], g, m0, n0, ks * KT + kk)
        T.mbarrier_wait_parity(full[it % ST], (it // ST) % 2)
        T.wgmma_gemm(a_s[it % ST, :, :], b_s[it % ST, :, :], parts[u % 2], transpose_B=True, clear_accum=True,
                     policy=policy)
        if u > 0:
            T.wait_wgmma(1)
            T.warpgroup_fence_operand(parts[1 - u % 2], num_regs=BM * BN // threads)  # read after the wait only
            release(empty, (it - 1) % ST, tx)
            promote(parts[1 - u % 2], total, sas[1 - u % 2], ws[1 - u % 2])

    @T.macro
    def chain(SA, SW, a_s, b_s, full, empty, parts, sas, ws, total, g, m0, n0, ks, k0, it0, tx, length: int):
        # `length` K blocks from k0 unrolled, each block's wgmma in flight while the previous one is promoted;
        # drained at the end (ptxas serialises all wgmmas when one is still in flight across a loop's back edge)
        for u in places[length]:  # a Python list: unrolled while the IR is built
            step(SA, SW, a_s, b_s, full, empty, parts, sas, ws, total, g, m0, n0, ks, k0 + u, it0 + u, tx, u)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(parts[(length - 1) % 2], num_regs=BM * BN // threads)
        release(empty, (it0 + length - 1) % ST, tx)
        promote(parts[(length - 1) % 2], total, sas[(length - 1) % 2], ws[(length - 1) % 2])

    @T.prim_func
    def kernel(A: T.Tensor(a_shape, "uint8"), SA: T.Tensor(sa_shape, "float32"), W: T.Tensor(w_shape, "uint8"),
               SW: T.Tensor(sw_shape, sdt), C: T.Tensor(c_shape, out_dtype)):
        MT = T.ceildiv(M, BM)
        tiles = MT * NT * G * SK
        with T.Kernel(T.min(tiles, grid) if grid else tiles, threads=threads + 128,
                      cluster_dims=(CL, 1, 1) if CL > 1 else None) as pid:
            Af = T.view(A, dtype=e4m3)
            Wf = T.view(W, dtype=e4m3)
            a_s = T.alloc_shared((ST, BM, BK), e4m3)
            b_s = T.alloc_shared((ST, BN, BK), e4m3)
            full = T.alloc_barrier([128] * ST)
            if CL > 1:
                empty = T.alloc_cluster_barrier([CL * threads // 32] * ST)
            else:
                empty = T.alloc_barrier([threads] * ST)
            p0 = T.alloc_fragment((BM, BN), "float32")
            p1 = T.alloc_fragment((BM, BN), "float32")
            total = T.alloc_fragment((BM, BN), "float32")
            sa0 = T.alloc_fragment((BM,), "float32")
            sa1 = T.alloc_fragment((BM,), "float32")
            w0 = T.alloc_local((1,), sdt)
            w1 = T.alloc_local((1,), sdt)
            c_s = T.alloc_shared((2, 64, BN), out_dtype) if staged else None  # each warpgroup's rows
            tx = T.get_thread_binding()
            count = T.ceildiv(tiles - pid, grid) if grid else 1
            if CL > 1:
                T.cluster_sync()  # the peer's barriers are initialised before anything arrives at them
            if tx >= threads:
                T.dec_max_nreg(24)
                for r in T.serial(count):
                    ks, g, m0, n0 = tile_of(pid + r * grid)
                    for kk in T.serial(KT):
                        it = r * KT + kk
                        kb = ks * KT + kk
                        T.mbarrier_wait_parity(empty[it % ST], (it // ST) % 2 ^ 1)
                        T.tma_copy(Af[m0:m0 + BM, g * K + kb * BK:g * K + kb * BK + BK], a_s[it % ST, :, :],
                                   barrier=full[it % ST], cluster_mask=(1 << CL) - 1 if CL > 1 else None)
                        T.tma_copy(Wf[g * N + n0:g * N + n0 + BN, kb * BK:kb * BK + BK], b_s[it % ST, :, :],
                                   barrier=full[it % ST])
                        T.mbarrier_arrive(full[it % ST])
            else:
                T.inc_max_nreg(240)
                for r in T.serial(count):
                    ks, g, m0, n0 = tile_of(pid + r * grid)
                    T.clear(total)
                    for c in T.serial(KT // U):
                        chain(SA, SW, a_s, b_s, full, empty, (p0, p1), (sa0, sa1), (w0, w1), total, g, m0, n0, ks,
                              c * U, r * KT + c * U, tx, U)
                    if KT % U:
                        chain(SA, SW, a_s, b_s, full, empty, (p0, p1), (sa0, sa1), (w0, w1), total, g, m0, n0, ks,
                              KT - KT % U, r * KT + KT - KT % U, tx, KT % U)
                    if SK > 1:
                        T.copy(total, C[ks, m0, g * N + n0])
                    elif staged:
                        store_staged(total, c_s, C, m0, g * N + n0, tx)
                    else:
                        T.copy(total, C[m0, g * N + n0])
                if staged and tx % 128 < 32:
                    T.tma_store_wait(0)  # the shared memory stays valid until the last store has read it

            if CL > 1:
                T.cluster_sync()  # no CTA exits while its peer may still arrive at its barriers

    return kernel
