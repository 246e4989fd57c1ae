"""mHC mixes: from the N residual streams, the pre/post/comb coefficients (comb projected onto doubly
stochastic matrices by Sinkhorn-Knopp), without collapsing. V4's `hc_pre` is these mixes plus `hc_collapse`
with its own pre; V4.1's "single pass" collapses each sublayer's input with the pre its predecessor computed.

The kernel body here is also `hc_pre`'s: `mixes_body(..., collapse=True)` stores the collapsed streams
instead of the pre mix (one read of the streams for both). All math in fp32."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require


def reference(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, H], fn [(2+N)N, N*H], base [(2+N)N], scale [3] ->
    (pre [T, N], post [T, N], comb [T, N, N]), all fp32. One RMS statistic per token over all N*H values."""
    t, n, _ = streams.shape
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * s_comb + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


@dataclass(frozen=True)
class Variant:
    hc: int  # N streams
    hidden: int  # H
    iters: int  # Sinkhorn iterations
    dtype: str


@dataclass(frozen=True)
class Config:
    chunk: int = 512  # stream columns per step of the mixing matvec
    threads: int = 128


def mixes_body(P, v, cfg, collapse: bool):
    """The mixes of one token per tile; `collapse`: store the streams collapsed with the pre mix just computed
    (`hc_pre`) instead of the pre mix itself (`hc_mixes`)."""
    T = P.T
    N, H, dtype = v.hc, v.hidden, v.dtype
    KN, MIX = N * H, (2 + N) * N
    BC = min(cfg.chunk, P.padded(KN, cfg.threads))  # stream columns per step, a multiple of the threads
    NC = -(-KN // BC)
    RAGGED = KN % BC != 0  # the last chunk is partial: loads masked to 0 (adds nothing to the sums)
    BH = min(cfg.chunk, H)  # collapse columns per step; a partial last step stores predicated
    NH = -(-H // BH)
    M = T.dynamic("M")

    def stream(s_io, c, j):  # stream column c*BC + j in fp32, 0 past the end
        if not RAGGED:
            return T.cast(s_io[c * BC + j], "float32")
        return T.if_then_else(c * BC + j < KN, T.cast(s_io[T.min(c * BC + j, KN - 1)], "float32"), 0.0)

    def row_max(mix, scale, base, i):
        logit = [mix[2 * N + i * N + j] * scale[2] + base[2 * N + i * N + j] for j in range(N)]
        best = logit[0]
        for x in logit[1:]:
            best = T.max(best, x)
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

    def weighted(pre, s, h):
        total = pre[0] * T.cast(s[h], "float32")
        for n in range(1, N):
            total = total + pre[n] * T.cast(s[n * H + h], "float32")
        return total

    @T.macro
    def mixes(S, Fn, Base, Scale, Pre, Post, Comb, Out, hc_eps, norm_eps):
        with P.kernel(M, cfg.threads) as pid:
            s_io = P.alloc_io((KN,), dtype)
            f_io = P.alloc_io((MIX, BC), "float32")
            mix_io = P.alloc_io((MIX,), "float32")
            pre_io = P.alloc_io((N,), "float32")
            post_io = P.alloc_io((N,), "float32")
            comb_io = P.alloc_io((N * N,), "float32")
            red_io = P.alloc_io((N,), "float32")
            o_io = P.alloc_io((BH,), dtype)
            acc = P.alloc_vec((MIX,), "float32")
            ss = P.alloc_vec((1,), "float32")
            for row in P.tiles(M, pid):
                T.copy(S[row, 0:KN], s_io)
                with P.vector(cfg.threads):
                    for o in T.Parallel(MIX):
                        acc[o] = 0.0
                    ss[0] = 0.0
                for c in T.serial(NC):
                    if RAGGED:
                        with P.vector(cfg.threads):
                            for o, j in T.Parallel(MIX, BC):
                                f_io[o, j] = T.if_then_else(c * BC + j < KN, Fn[o, T.min(c * BC + j, KN - 1)], 0.0)
                    else:
                        T.copy(Fn[0:MIX, c * BC : (c + 1) * BC], f_io)
                    with P.vector(cfg.threads):
                        prod = P.alloc_reg((MIX, BC), "float32")
                        part = P.alloc_reg((MIX,), "float32")
                        sq = P.alloc_reg((BC,), "float32")
                        tot = P.alloc_reg((1,), "float32")
                        for o, j in T.Parallel(MIX, BC):
                            prod[o, j] = f_io[o, j] * stream(s_io, c, j)
                        T.reduce_sum(prod, part, dim=1)
                        for j in T.Parallel(BC):
                            sq[j] = stream(s_io, c, j) * stream(s_io, c, j)
                        T.reduce_sum(sq, tot, dim=0)
                        for o in T.Parallel(MIX):
                            acc[o] = acc[o] + part[o]
                        ss[0] = ss[0] + tot[0]
                with P.vector(cfg.threads):
                    for o in T.Parallel(MIX):
                        mix_io[o] = acc[o] * T.rsqrt(ss[0] / KN + norm_eps)
                with P.vector(cfg.threads):
                    for i in T.Parallel(N):
                        pre_io[i] = 1.0 / (1.0 + T.exp(-(mix_io[i] * Scale[0] + Base[i]))) + hc_eps
                        post_io[i] = 2.0 / (1.0 + T.exp(-(mix_io[N + i] * Scale[1] + Base[N + i])))
                    for i in T.Parallel(N):  # row softmax of the comb logits
                        red_io[i] = row_max(mix_io, Scale, Base, i)
                    for i, j in T.Parallel(N, N):
                        comb_io[i * N + j] = T.exp(mix_io[2 * N + i * N + j] * Scale[2] + Base[2 * N + i * N + j] - red_io[i])
                    for i in T.Parallel(N):
                        red_io[i] = row_sum(comb_io, i)
                    for i, j in T.Parallel(N, N):
                        comb_io[i * N + j] = comb_io[i * N + j] / red_io[i] + hc_eps
                    for j in T.Parallel(N):
                        red_io[j] = col_sum(comb_io, j)
                    for i, j in T.Parallel(N, N):
                        comb_io[i * N + j] = comb_io[i * N + j] / (red_io[j] + hc_eps)
                    for _ in T.serial(v.iters - 1):  # Sinkhorn-Knopp: rows, then columns
                        for i in T.Parallel(N):
                            red_io[i] = row_sum(comb_io, i)
                        for i, j in T.Parallel(N, N):
                            comb_io[i * N + j] = comb_io[i * N + j] / (red_io[i] + hc_eps)
                        for j in T.Parallel(N):
                            red_io[j] = col_sum(comb_io, j)
                        for i, j in T.Parallel(N, N):
                            comb_io[i * N + j] = comb_io[i * N + j] / (red_io[j] + hc_eps)
                T.copy(post_io, Post[row, 0:N])
                T.copy(comb_io, Comb[row, 0 : N * N])
                if not collapse:
                    T.copy(pre_io, Pre[row, 0:N])
                else:
                    for hb in T.serial(NH):
                        if H % BH == 0:
                            with P.vector(cfg.threads):
                                for j in T.Parallel(BH):
                                    o_io[j] = T.cast(weighted(pre_io, s_io, hb * BH + j), dtype)
                            T.copy(o_io, Out[row, hb * BH : (hb + 1) * BH])
                        else:
                            with P.vector(cfg.threads):
                                for j in T.Parallel(BH):
                                    if hb * BH + j < H:
                                        Out[row, hb * BH + j] = T.cast(weighted(pre_io, s_io, hb * BH + j), dtype)

    if collapse:
        @T.prim_func
        def kernel(S: T.Tensor((M, KN), dtype), Fn: T.Tensor((MIX, KN), "float32"), Base: T.Tensor((MIX,), "float32"),
                   Scale: T.Tensor((3,), "float32"), Post: T.Tensor((M, N), "float32"),
                   Comb: T.Tensor((M, N * N), "float32"), Out: T.Tensor((M, H), dtype), hc_eps: T.float32,
                   norm_eps: T.float32):
            mixes(S, Fn, Base, Scale, None, Post, Comb, Out, hc_eps, norm_eps)
    else:
        @T.prim_func
        def kernel(S: T.Tensor((M, KN), dtype), Fn: T.Tensor((MIX, KN), "float32"), Base: T.Tensor((MIX,), "float32"),
                   Scale: T.Tensor((3,), "float32"), Pre: T.Tensor((M, N), "float32"), Post: T.Tensor((M, N), "float32"),
                   Comb: T.Tensor((M, N * N), "float32"), hc_eps: T.float32, norm_eps: T.float32):
            mixes(S, Fn, Base, Scale, Pre, Post, Comb, None, hc_eps, norm_eps)
    return kernel


def body(P, v: Variant, cfg: Config):
    return mixes_body(P, v, cfg, collapse=False)


KERNEL = Kernel("hc_mixes", body, configs={"default": Config(), "c": Config(chunk=64, threads=1)})


def variant(streams: torch.Tensor, sinkhorn_iters: int) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    _, n, h = streams.shape
    return Variant(hc=n, hidden=h, iters=sinkhorn_iters, dtype=dtypes.name(streams.dtype))


def check(op: str, streams, fn, base, scale, sinkhorn_iters) -> None:
    _, n, h = streams.shape
    mix = (2 + n) * n
    require(fn.shape == (mix, n * h) and base.shape == (mix,) and scale.shape == (3,), op,
            f"fn/base/scale must be [{mix}, {n * h}]/[{mix}]/[3], got {list(fn.shape)}/{list(base.shape)}/{list(scale.shape)}")
    require(sinkhorn_iters >= 1, op, f"sinkhorn_iters must be at least 1, got {sinkhorn_iters}")


def run(launch, streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    m, n, h = streams.shape
    check("hc_mixes", streams, fn, base, scale, sinkhorn_iters)
    pre = torch.empty(m, n, dtype=torch.float32, device=streams.device)
    post = torch.empty(m, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(m, n * n, dtype=torch.float32, device=streams.device)
    launch("hc_mixes", variant(streams, sinkhorn_iters))(
        streams.reshape(m, n * h).contiguous(), fn.float().contiguous(), base.float().contiguous(),
        scale.float().contiguous(), pre, post, comb, float(hc_eps), float(norm_eps))
    return pre, post, comb.view(m, n, n)


def example(v: Variant, rows: int, device) -> tuple:
    mix = (2 + v.hc) * v.hc
    streams = torch.randn(rows, v.hc, v.hidden, device=device).to(dtypes.torch_dtype(v.dtype))
    fn = 0.02 * torch.randn(mix, v.hc * v.hidden, device=device)
    return (streams, fn, 0.5 * torch.randn(mix, device=device), 1 + 0.1 * torch.randn(3, device=device), v.iters, 1e-6, 1e-6)


OP = OpDecl(
    "hc_mixes", "mHC pre/post/comb mixes with Sinkhorn (no collapse)", reference,
    kernels=(KERNEL,),
    # fp32 outputs whatever the streams' dtype: sums in another order (hc_pre's 2e-2 is for its bf16 collapse)
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (1e-4, 1e-4)},
    run=run, example=example,
)
