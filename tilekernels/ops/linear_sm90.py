"""The sm90 (Hopper) override of the bf16 `linear` GEMM at prefill sizes: TMA-fed shared tiles, warp-specialised
wgmma (TileLang adds a producer warpgroup), a 3-stage pipeline, a swizzled block order (`T.use_swizzle`: `panel`
row tiles visit the N tiles together, so the W tiles they share stay in L2) and the output tile staged in shared
memory for one coalesced (TMA) store.

It takes the variants `linear.variant` gives for more than `linear.ROW_BUCKETS[1]` rows (one group, 16-bit
operands, no split K); decode (narrow) and split-K variants keep the portable body, whose fp32 partials
`linear.gemm` sums. The tiles come from `benchmarks/tune_linear.py` on the H200 (BENCHMARKS.md)."""

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
    programs: int = 0  # > 0: the persistent ping-pong form (`body_pingpong`) on this many programs
    chain: int = 8  # body_pingpong: K blocks a consumer issues unrolled, one wgmma kept in flight


def supports(v) -> bool:
    """The variants this override takes: prefill rows (not narrow), one group, 16-bit operands, no split K."""
    return not v.narrow and v.split_k == 1 and v.groups == 1 and v.dtype in ("bfloat16", "float16")


def body(P, v, cfg, tiles: Tiles | None = None):
    """C [M, N] = A [M, K] @ W [N, K]^T with `tiles` (default: the target config's `large`)."""
    from tilekernels.ops.linear import edge_tile

    T = P.T
    t = tiles or cfg.large
    if t.programs:
        return body_pingpong(P, v, t)
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


def body_pingpong(P, v, t: Tiles):
    """The persistent ping-pong form (a `benchmarks/tune_linear.py` candidate, BENCHMARKS.md "Eighteenth round"):
    `t.programs` programs walk the output tiles (groups of `t.panel` row tiles); a producer warpgroup loads each K block
    of each tile by TMA into one ring of `t.stages` slots, in tile order; two consumer warpgroups take alternate tiles,
    each with its own `block_m` x `block_n` accumulator, so one stores its tile from registers while the other's K
    loop runs on the tensor cores (an order barrier starts a K loop only after the other warpgroup's previous one). A consumer keeps one wgmma in flight
    (block k issued, block k-1 waited for and its slot released) in unrolled chains of `t.chain` blocks."""
    from tilekernels.ops.linear import edge_tile

    T = P.T
    N, K, dtype = v.n, v.k, v.dtype
    BN, NT = edge_tile(N, t.block_n)
    BK, KT = edge_tile(K, t.block_k)
    BM, ST, GM, grid = t.block_m, t.stages, max(t.panel, 1), t.programs
    U = min(t.chain, KT)
    M = T.dynamic("M")

    def tile_of(i, MT):
        # groups of GM row tiles (the last one shorter); within a group the row tile moves fastest
        group = i // (GM * NT)
        rows = T.min(GM, MT - group * GM)
        within = i - group * GM * NT
        return (group * GM + within % rows) * BM, within // rows * BN

    @T.macro
    def chain(a_s, b_s, acc, full, empty, it0, first, length: int):
        for u in list(range(length)):  # unrolled while the IR is built
            it = it0 + u
            T.mbarrier_wait_parity(full[it % ST], (it // ST) % 2)
            T.wgmma_gemm(a_s[it % ST, :, :], b_s[it % ST, :, :], acc, transpose_B=True,
                         clear_accum=first if u == 0 else False, policy=T.GemmWarpPolicy.FullRow)
            if u > 0:
                T.wait_wgmma(1)
                T.mbarrier_arrive(empty[(it - 1) % ST])
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc, num_regs=BM * BN // 128)
        T.mbarrier_arrive(empty[(it0 + length - 1) % ST])

    @T.macro
    def consume(a_s, b_s, acc, full, empty, order, C, q, MT, pid, w: int):
        # warpgroup w's tile q of the program (global tile pid + q * grid), its K blocks ring positions q * KT ...
        # Its K loop starts once the other warpgroup's tile q - 1 has left the tensor cores (`order`): the shared
        # ring's full barriers are then past every phase before q's, so the parity waits cannot match an older one.
        m0, n0 = tile_of(pid + q * grid, MT)
        if q > 0:
            T.mbarrier_wait_parity(order[1 - w], (q - 1) // 2 % 2)
        for c in T.serial(KT // U):
            chain(a_s, b_s, acc, full, empty, q * KT + c * U, c == 0, U)
        if KT % U:
            chain(a_s, b_s, acc, full, empty, q * KT + KT - KT % U, KT < U, KT % U)
        T.mbarrier_arrive(order[w])
        T.copy(acc, C[m0, n0])

    @T.prim_func
    def kernel(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), C: T.Tensor((M, N), dtype)):
        MT = T.ceildiv(M, BM)
        tiles = MT * NT
        with T.Kernel(T.min(tiles, grid), threads=384) as pid:
            a_s = T.alloc_shared((ST, BM, BK), dtype)
            b_s = T.alloc_shared((ST, BN, BK), dtype)
            full = T.alloc_barrier([128] * ST)
            empty = T.alloc_barrier([128] * ST)  # one consumer warpgroup frees each slot
            order = T.alloc_barrier([128, 128])  # warpgroup w's K loop of its latest tile done
            acc0 = T.alloc_fragment((BM, BN), "float32")
            acc1 = T.alloc_fragment((BM, BN), "float32")
            tx = T.get_thread_binding()
            count = T.ceildiv(tiles - pid, grid)
            if tx >= 256:
                T.dec_max_nreg(40)
                for q in T.serial(count):
                    m0, n0 = tile_of(pid + q * grid, MT)
                    for kk in T.serial(KT):
                        it = q * KT + kk
                        T.mbarrier_wait_parity(empty[it % ST], (it // ST) % 2 ^ 1)
                        T.tma_copy(A[m0:m0 + BM, kk * BK:kk * BK + BK], a_s[it % ST, :, :], barrier=full[it % ST])
                        T.tma_copy(W[n0:n0 + BN, kk * BK:kk * BK + BK], b_s[it % ST, :, :], barrier=full[it % ST])
                        T.mbarrier_arrive(full[it % ST])
            elif tx < 128:
                T.inc_max_nreg(232)
                for r in T.serial(T.ceildiv(count, 2)):
                    consume(a_s, b_s, acc0, full, empty, order, C, 2 * r, MT, pid, 0)
            else:
                T.inc_max_nreg(232)
                for r in T.serial(count // 2):
                    consume(a_s, b_s, acc1, full, empty, order, C, 2 * r + 1, MT, pid, 1)

    return kernel
