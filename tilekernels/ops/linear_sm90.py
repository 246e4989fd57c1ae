"""The sm90 (Hopper) override of the bf16 `linear` GEMM at prefill sizes: TMA-fed shared tiles, warp-specialised
wgmma (TileLang adds a producer warpgroup), a 3-stage pipeline, a swizzled block order (`T.use_swizzle`: `panel`
row tiles visit the N tiles together, so the W tiles they share stay in L2) and the output tile staged in shared
memory for one coalesced (TMA) store.

It takes the variants `linear.variant` gives for more than `linear.ROW_BUCKETS[1]` rows (one group, 16-bit
operands, no split K); decode (narrow) and split-K variants keep the portable body, whose fp32 partials
`linear.gemm` sums. The tiles come from `benchmarks/tune_linear.py` on the H200 (BENCHMARKS.md).

Where K is short (`Config.short_k`: q_b's 1,024) the output is as large as the K loop is short, and the pipelined
body's CTAs wait on their own stores: those variants take `body_ws`, persistent, whose stores run under the next
tile's K loop. On the H100 at 4,096 / 16,384 rows q_b went from 0.88x / 0.80x cuBLAS to 0.96x / 0.97x; q_a, o_b
and lm_head were no faster that way (0.90-1.03x against 0.92-0.99x; BENCHMARKS.md "Twentieth round")."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Tiles:
    """The override's tile. `threads`: the consumer threads; `panel`: row tiles per swizzle panel (0: row-major
    block order); `stage_c`: stage the output tile in shared memory (one TMA store) instead of storing from
    registers; `min_blocks`: CTAs each SM must hold (registers capped for that many, no setmaxnreg reallocation
    between the producer and the consumers; 0: the compiler's choice, one CTA; `benchmarks/tune_linear.py`'s two-CTA
    trials, BENCHMARKS.md "Eighteenth round")."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    threads: int = 256
    panel: int = 8
    stage_c: bool = True
    min_blocks: int = 0
    programs: int = 0  # > 0: `body_ws`, a persistent grid of this many programs (0: the pipelined body)


def supports(v) -> bool:
    """The variants this override takes: prefill rows (not narrow), one group, 16-bit operands, no split K."""
    return not v.narrow and v.split_k == 1 and v.groups == 1 and v.dtype in ("bfloat16", "float16")


def body(P, v, cfg, tiles: Tiles | None = None):
    """C [M, N] = A [M, K] @ W [N, K]^T with `tiles` (default: the target config's `large`)."""
    from tilekernels.ops.linear import edge_tile

    T = P.T
    t = tiles or (cfg.short if cfg.short and v.k <= cfg.short_k and ws_fits(v, cfg.short) else cfg.large)
    if t.programs and ws_fits(v, t):
        return body_ws(P, v, t)
    N, K, dtype = v.n, v.k, v.dtype
    BN, NT = edge_tile(N, t.block_n)
    BK, KT = edge_tile(K, t.block_k)
    BM = t.block_m
    M = T.dynamic("M")

    @T.prim_func
    def kernel(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(NT, T.ceildiv(M, BM), threads=t.threads) as (bx, by):
            if t.min_blocks:
                T.annotate_min_blocks_per_sm(t.min_blocks)
                T.disable_warp_group_reg_alloc()
            if t.panel:
                T.use_swizzle(t.panel)
            a_s = T.alloc_shared((BM, BK), dtype)
            b_s = T.alloc_shared((BN, BK), dtype)
            acc = T.alloc_fragment((BM, BN), "float32")
            for kk in T.Pipelined(KT, num_stages=t.stages):
                T.copy(A[by * BM, kk * BK], a_s)
                T.copy(W[bx * BN, kk * BK], b_s)
                T.gemm(a_s, b_s, acc, transpose_B=True, clear_accum=kk == 0, policy=T.GemmWarpPolicy.FullRow)
            if t.stage_c:
                c_s = T.alloc_shared((BM, BN), dtype)
                T.copy(acc, c_s)
                T.copy(c_s, C[by * BM, bx * BN])
            else:
                T.copy(acc, C[by * BM, bx * BN])

    return kernel


def staged_store(T, BN: int):
    """The epilogue of a persistent GEMM whose two consumer warpgroups hold 64 rows each of a 128 x BN fp32 tile
    (`body_ws` here, `linear_fp8_sm90.body_ws`), as a macro (acc, c_s, C, m0, n0, tx): each warpgroup writes its rows
    into its half of `c_s` (2, 64, BN), meets on its own named barrier, and one lane of its first warp issues the TMA
    store into C[m0:m0 + 128, n0:n0 + BN] without waiting for it, so the global write runs under the next tile's K
    loop; that lane first waits for its previous store to have read the staging rows. The kernel waits once more
    before it ends (shared memory must outlive the last store's reads)."""

    @T.macro
    def store(acc, c_s, C, m0, n0, tx):
        if tx % 128 < 32:
            T.tma_store_wait(0)
        T.sync_threads(1 + tx // 128, 128)
        for i, j in T.Parallel(128, BN):
            c_s[i // 64, i % 64, j] = acc[i, j]
        T.fence_proxy_async()
        T.sync_threads(1 + tx // 128, 128)
        if tx // 32 == 0:
            T.tma_copy(c_s[0, :, :], C[m0:m0 + 64, n0:n0 + BN], leader_scope_threads=32)
        if tx // 32 == 4:
            T.tma_copy(c_s[1, :, :], C[m0 + 64:m0 + 128, n0:n0 + BN], leader_scope_threads=32)

    return store


def ws_fits(v, t: Tiles) -> bool:
    """`body_ws` takes whole tiles only (no N or K edge) and 128-row tiles of two consumer warpgroups."""
    return v.n % t.block_n == 0 and v.k % t.block_k == 0 and t.block_m == 128 and t.threads == 256


def body_ws(P, v, t: Tiles):
    """Persistent and explicitly warp-specialised: `t.programs` programs walk the output tiles (in panels of
    `t.panel` row tiles, rows fastest, so a panel's A rows and each W tile stay in L2 while they are shared); a
    producer warpgroup streams the K blocks of all the program's tiles through one ring of `t.stages` slots (own
    full/empty mbarriers), so it loads the next tile while the consumers finish this one; each consumer warpgroup
    stages its 64 output rows in shared memory and stores them by TMA without waiting: the global write runs under
    the next tile's K loop (its staging rows are reused only after that store has read them)."""
    T = P.T
    N, K, dtype = v.n, v.k, v.dtype
    BM, BN, BK, ST, PN, grid = 128, t.block_n, t.block_k, t.stages, max(t.panel, 1), t.programs
    NT, KT = N // BN, K // BK
    M = T.dynamic("M")

    def tile_of(i, MT):
        p = i // (PN * NT)
        rows = T.min(PN, MT - p * PN)  # the last panel may hold fewer row tiles
        rem = i - p * PN * NT
        return (p * PN + rem % rows) * BM, rem // rows * BN

    store = staged_store(T, BN)

    @T.prim_func
    def kernel(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), C: T.Tensor((M, N), dtype)):
        MT = T.ceildiv(M, BM)
        tiles = MT * NT
        with T.Kernel(T.min(tiles, grid), threads=384) as pid:
            a_s = T.alloc_shared((ST, BM, BK), dtype)
            b_s = T.alloc_shared((ST, BN, BK), dtype)
            c_s = T.alloc_shared((2, 64, BN), dtype)  # each consumer warpgroup's rows
            full = T.alloc_barrier([128] * ST)
            empty = T.alloc_barrier([256] * ST)
            acc = T.alloc_fragment((BM, BN), "float32")
            tx = T.get_thread_binding()
            count = T.ceildiv(tiles - pid, grid)
            if tx >= 256:
                T.dec_max_nreg(24)
                for r in T.serial(count):
                    m0, n0 = tile_of(pid + r * grid, MT)
                    for kk in T.serial(KT):
                        it = r * KT + kk
                        T.mbarrier_wait_parity(empty[it % ST], (it // ST) % 2 ^ 1)
                        T.tma_copy(A[m0:m0 + BM, kk * BK:kk * BK + BK], a_s[it % ST, :, :], barrier=full[it % ST])
                        T.tma_copy(W[n0:n0 + BN, kk * BK:kk * BK + BK], b_s[it % ST, :, :], barrier=full[it % ST])
                        T.mbarrier_arrive(full[it % ST])
            else:
                T.inc_max_nreg(240)
                for r in T.serial(count):
                    m0, n0 = tile_of(pid + r * grid, MT)
                    T.clear(acc)
                    for kk in T.serial(KT):
                        it = r * KT + kk
                        T.mbarrier_wait_parity(full[it % ST], (it // ST) % 2)
                        T.wgmma_gemm(a_s[it % ST, :, :], b_s[it % ST, :, :], acc, transpose_B=True,
                                     policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        T.mbarrier_arrive(empty[it % ST])
                    store(acc, c_s, C, m0, n0, tx)
                if tx % 128 < 32:
                    T.tma_store_wait(0)  # the shared memory stays valid until the last store has read it

    return kernel
