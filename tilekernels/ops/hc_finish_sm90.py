"""sm_90a override of the mHC mixes' finishing stage (`hc_pre_finish`, `hc_mixes_finish`): the same signature and
arithmetic as the portable finish (`hc_mixes.mixes_body(stage="finish")`), laid out for many tokens.

The portable finish runs one CTA per token: its threads share the 4x4 Sinkhorn iterations through shared memory
(about 85 barriers per token) and, for `hc_pre`, stage the token's whole row (N*H values) before collapsing it.
Here a CTA takes `tokens` tokens: phase 1, one thread per token sums its parts (in part order), normalizes, and
runs the sigmoids, the comb softmax and Sinkhorn in its own registers (no barrier); phase 2 (`hc_pre` only), all
threads collapse the CTA's rows straight from global memory, `block_h` columns per step (coalesced, no staging).
Per token the same operations in the same order as the portable body: the results agree to rounding (the
compiler may fuse a multiply-add differently)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    tokens: int = 8  # tokens per CTA: one thread each runs a token's tail
    threads: int = 256
    block_h: int = 1024  # collapse columns per step


TILE = Tile()


def fits(v) -> bool:
    """bf16 streams (what the sm_90a partials GEMM takes; fp32 keeps the portable pair)."""
    return v.dtype == "bfloat16"


def body(P, v, cfg, collapse: bool, tile: Tile = TILE):
    T = P.T
    N, H, SP, dtype = v.hc, v.hidden, v.split, v.dtype
    KN, MIX, NN = N * H, (2 + N) * N, N * N
    BT, BH = tile.tokens, min(tile.block_h, H)
    NH = -(-H // BH)
    F32 = "float32"
    M = T.dynamic("M")

    def parts(buf, m, o, stride):  # the parts of column o summed in part order
        total = buf[m, o]
        for p in range(1, SP):
            total = total + buf[m, p * stride + o]
        return total

    def logit(mix, Scale, Base, i, j):
        return mix[2 * N + i * N + j] * Scale[2] + Base[2 * N + i * N + j]

    def row_max(mix, Scale, Base, i):
        best = logit(mix, Scale, Base, i, 0)
        for j in range(1, N):
            best = T.max(best, logit(mix, Scale, Base, i, j))
        return best

    def row_sum(c, i):
        total = c[i * N]
        for j in range(1, N):
            total = total + c[i * N + j]
        return total

    def col_sum(c, j):
        total = c[j]
        for i in range(1, N):
            total = total + c[i * N + j]
        return total

    @T.macro
    def tail(m, t, Dots, Sq, Base, Scale, Pre, Post, Comb, pre_s, mix, c, red, hc_eps, norm_eps):
        """Token m's tail in this thread's registers; its pre mix into pre_s[t] (and Pre, without collapse)."""
        r = T.rsqrt(parts(Sq, m, 0, 1) / KN + norm_eps)
        for o in T.unroll(MIX):
            mix[o] = parts(Dots, m, o, MIX) * r
        for i in T.unroll(N):
            pre_s[t, i] = 1.0 / (1.0 + T.exp(-(mix[i] * Scale[0] + Base[i]))) + hc_eps
            Post[m, i] = 2.0 / (1.0 + T.exp(-(mix[N + i] * Scale[1] + Base[N + i])))
            if not collapse:
                Pre[m, i] = pre_s[t, i]
        for i in T.unroll(N):  # row softmax of the comb logits
            red[i] = row_max(mix, Scale, Base, i)
        for i, j in T.grid(N, N):
            c[i * N + j] = T.exp(logit(mix, Scale, Base, i, j) - red[i])
        for i in T.unroll(N):
            red[i] = row_sum(c, i)
        for i, j in T.grid(N, N):
            c[i * N + j] = c[i * N + j] / red[i] + hc_eps
        for j in T.unroll(N):
            red[j] = col_sum(c, j)
        for i, j in T.grid(N, N):
            c[i * N + j] = c[i * N + j] / (red[j] + hc_eps)
        for _ in T.serial(v.iters - 1):  # Sinkhorn-Knopp: rows, then columns
            for i in T.unroll(N):
                red[i] = row_sum(c, i)
            for i, j in T.grid(N, N):
                c[i * N + j] = c[i * N + j] / (red[i] + hc_eps)
            for j in T.unroll(N):
                red[j] = col_sum(c, j)
            for i, j in T.grid(N, N):
                c[i * N + j] = c[i * N + j] / (red[j] + hc_eps)
        for k in T.unroll(NN):
            Comb[m, k] = c[k]

    def weighted(S, pre_s, i, row, h):
        total = pre_s[i, 0] * T.cast(S[row, h], F32)
        for n in range(1, N):
            total = total + pre_s[i, n] * T.cast(S[row, n * H + h], F32)
        return total

    @T.macro
    def finish(S, Dots, Sq, Base, Scale, Pre, Post, Comb, Out, hc_eps, norm_eps):
        with T.Kernel(T.ceildiv(M, BT), threads=tile.threads) as bt:
            pre_s = T.alloc_shared((BT, N), F32)
            mix = T.alloc_local((MIX,), F32)
            c = T.alloc_local((NN,), F32)
            red = T.alloc_local((N,), F32)
            tx = T.get_thread_binding()
            m0 = bt * BT
            if tx < BT:
                if m0 + tx < M:
                    tail(m0 + tx, tx, Dots, Sq, Base, Scale, Pre, Post, Comb, pre_s, mix, c, red, hc_eps, norm_eps)
            if collapse:
                T.sync_threads()
                for hb in T.serial(NH):
                    for i, j in T.Parallel(BT, BH):
                        if m0 + i < M and hb * BH + j < H:
                            Out[m0 + i, hb * BH + j] = T.cast(weighted(S, pre_s, i, m0 + i, hb * BH + j), dtype)

    Tn = T.Tensor
    if collapse:
        @T.prim_func
        def kernel(S: Tn((M, KN), dtype), Dots: Tn((M, SP * MIX), F32), Sq: Tn((M, SP), F32), Base: Tn((MIX,), F32),
                   Scale: Tn((3,), F32), Post: Tn((M, N), F32), Comb: Tn((M, NN), F32), Out: Tn((M, H), dtype),
                   hc_eps: T.float32, norm_eps: T.float32):
            finish(S, Dots, Sq, Base, Scale, None, Post, Comb, Out, hc_eps, norm_eps)
    else:
        @T.prim_func
        def kernel(Dots: Tn((M, SP * MIX), F32), Sq: Tn((M, SP), F32), Base: Tn((MIX,), F32), Scale: Tn((3,), F32),
                   Pre: Tn((M, N), F32), Post: Tn((M, N), F32), Comb: Tn((M, NN), F32), hc_eps: T.float32,
                   norm_eps: T.float32):
            finish(None, Dots, Sq, Base, Scale, Pre, Post, Comb, None, hc_eps, norm_eps)
    return kernel
