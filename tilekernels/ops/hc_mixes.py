"""mHC mixes: from the N residual streams, the pre/post/comb coefficients (comb projected onto doubly
stochastic matrices by Sinkhorn-Knopp), without collapsing. V4's `hc_pre` is these mixes plus `hc_collapse`
with its own pre; V4.1's "single pass" collapses each sublayer's input with the pre its predecessor computed.

The kernel bodies here are also `hc_pre`'s: `mixes_body(..., collapse=True)` stores the collapsed streams
instead of the pre mix. All math in fp32. Two kernels at every row count (split K): tiles (token, part) write partial
mixing products and sums of squares to fp32 workspaces, and a finishing kernel per token sums them in part order
(deterministic) and runs the tail (`split_for`, `partials`). On sm_90a the partials stage of bf16 streams is a
tensor-core GEMM over 64-token tiles (`hc_mixes_sm90`). (A finish running each token's tail in one thread's
registers, the collapse by the whole CTA, measured slower on the H200: 0.22 against 0.14 ms for the pre-block at
4096 tokens, 0.041 against 0.022 ms at one: the serial tail of a thread is the longer path.)"""

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, Override, require
from tilekernels.ops import hc_mixes_sm90


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
    split: int = 1  # column parts per token of the partials kernel (split K, `split_for`)


@dataclass(frozen=True)
class Config:
    chunk: int = 512  # stream columns per step of the mixing matvec
    threads: int = 128
    pass_configs: dict = field(default_factory=dict, hash=False, compare=False)


CONFIGS = {"default": Config(), "c": Config(chunk=64, threads=1)}
# The finishing kernel on sm90 / sm100 stores with plain vector stores: TileLang lowers its staged stores (post, comb,
# each collapse chunk) to TMA stores, each waited for before the staging tile is reused (10 waits a token)
_NO_TMA = Config(pass_configs={"tl.disable_tma_lower": True})
FINISH_CONFIGS = {**CONFIGS, "sm90": _NO_TMA, "sm100": _NO_TMA}
# The mixing matvec is split in parts at every row count (one variant per layer: the plan needs no row boundary):
# one tile per token would stream all of fn (2 MB at V4.1) in 40 serial chunks, while M * split portable tiles of 2
# chunks fill the GPU at decode, and at prefill the sm_90a GEMM's (64 tokens, part) tiles do (a pass per token
# re-read all of fn from L2 for every token: 2 ms for 4096 V4-Flash tokens on the H200)
SPLIT_COLUMNS = 512  # parts cover whole multiples of the GPU chunk (the c target's 64 divides it)
MAX_SPLIT = 32  # at most this many parts per token: V4.1's 40 chunks in 20 parts of 2, V4's 32 in 32 (one chunk
# each: at one token the sm_90a partials were a chain of 16 pipeline steps, 11.3 of the pre-block's 19 us)


def split_for(columns: int) -> int:
    """Parts per token of the mixing matvec over `columns` (N*H), whatever the row count: the fewest parts of
    equally many SPLIT_COLUMNS chunks (but the last) that keeps to MAX_SPLIT (1 up to SPLIT_COLUMNS columns)."""
    units = -(-columns // SPLIT_COLUMNS)
    per_part = -(-units // MAX_SPLIT)
    return -(-units // per_part)


def mixes_body(P, v, cfg, collapse: bool, stage: str = "split"):
    """The mixes kernel of `stage`: "split" the partial mixing dot products and sums of squares of tiles
    (token, part) over each part's contiguous chunks into fp32 workspaces [M, split * MIX] and [M, split];
    "finish" per token: the partials summed in part order, then the tail, storing with `collapse` the streams
    collapsed with the pre mix just computed (`hc_pre`) instead of the pre mix itself (`hc_mixes`); with `v.norm`
    (`hc_pre`'s norm form) that collapse RMS-normalized with the weight Wn [H] at `norm_eps`, as `rms_norm`."""
    T = P.T
    N, H, dtype, SP = v.hc, v.hidden, v.dtype, v.split
    KN, MIX = N * H, (2 + N) * N
    BC = min(cfg.chunk, P.padded(KN, cfg.threads))  # stream columns per step, a multiple of the threads
    NC = -(-KN // BC)
    CPP = -(-NC // SP)  # chunks per part
    MASKED = KN % BC != 0 or CPP * SP != NC  # a partial last chunk or chunks past the last: loads masked to 0
    BH = min(cfg.chunk, H)  # collapse columns per step; a partial last step stores predicated
    NH = -(-H // BH)
    NORM = collapse and getattr(v, "norm", False)  # the collapse stored RMS-normalized (`hc_pre`'s norm form)
    NP = P.padded(NH * BH, cfg.threads)  # the norm's register width
    M = T.dynamic("M")

    def staged(s_io, c, j):  # the chunk's stream columns staged in s_io (zero-filled past the end)
        return T.cast(s_io[j], "float32")

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

    def matvec_step(masked, value):
        """One chunk c of the mixing matvec added to acc [MIX] and ss [1]; `value(s_io, c, j)` the fp32 stream."""
        @T.macro
        def step(Fn, s_io, f_io, acc, ss, c):
            if masked:
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
                    prod[o, j] = f_io[o, j] * value(s_io, c, j)
                T.reduce_sum(prod, part, dim=1)
                for j in T.Parallel(BC):
                    sq[j] = value(s_io, c, j) * value(s_io, c, j)
                T.reduce_sum(sq, tot, dim=0)
                for o in T.Parallel(MIX):
                    acc[o] = acc[o] + part[o]
                ss[0] = ss[0] + tot[0]
        return step

    @T.macro
    def tail(row, acc, ss, s_io, mix_io, pre_io, post_io, comb_io, alt_io, red_io, o_io, Scale, Base, Pre, Post, Comb,
             Out, Wn, hc_eps, norm_eps):
        """From a token's mixing dot products acc [MIX] and sum of squares ss [1]: normalize, the sigmoids, the comb
        softmax and Sinkhorn, then store post, comb and pre (or the streams s_io collapsed with pre)."""
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
            # Sinkhorn-Knopp: rows, then columns; each element sums its own row (column) from the other buffer, so
            # an iteration is two dependent steps (not four: sums, then quotients, twice), the same sums in order
            for _ in T.serial(v.iters - 1):
                for i, j in T.Parallel(N, N):
                    alt_io[i * N + j] = comb_io[i * N + j] / (row_sum(comb_io, i) + hc_eps)
                for i, j in T.Parallel(N, N):
                    comb_io[i * N + j] = alt_io[i * N + j] / (col_sum(alt_io, j) + hc_eps)
        T.copy(post_io, Post[row, 0:N])
        T.copy(comb_io, Comb[row, 0 : N * N])
        if not collapse:
            T.copy(pre_io, Pre[row, 0:N])
        elif NORM:  # the whole collapsed row in o_io, then its RMSNorm (rms_norm's arithmetic) stored chunk by chunk
            for hb in T.serial(NH):
                with P.vector(cfg.threads):
                    for j in T.Parallel(BH):
                        if H % BH == 0:
                            o_io[hb * BH + j] = T.cast(weighted(pre_io, s_io, hb * BH + j), dtype)
                        else:  # past H: 0, adding nothing to the sum of squares
                            o_io[hb * BH + j] = T.cast(T.if_then_else(
                                hb * BH + j < H, weighted(pre_io, s_io, T.min(hb * BH + j, H - 1)), 0.0), dtype)
            with P.vector(cfg.threads):  # over the row padded to the threads (layout inference): 0 past it
                xf = P.alloc_reg((NP,), "float32")
                sq = P.alloc_reg((NP,), "float32")
                tot = P.alloc_reg((1,), "float32")
                for j in T.Parallel(NP):
                    xf[j] = T.if_then_else(j < NH * BH, T.cast(o_io[T.min(j, NH * BH - 1)], "float32"), 0.0)
                    sq[j] = xf[j] * xf[j]
                T.reduce_sum(sq, tot, dim=0)
                for j in T.Parallel(NP):
                    if j < NH * BH:
                        o_io[j] = T.cast(xf[j] * T.rsqrt(tot[0] / H + norm_eps) * Wn[T.min(j, H - 1)], dtype)
            for hb in T.serial(NH):
                if H % BH == 0:
                    T.copy(o_io[hb * BH : (hb + 1) * BH], Out[row, hb * BH : (hb + 1) * BH])
                else:
                    with P.vector(cfg.threads):
                        for j in T.Parallel(BH):
                            if hb * BH + j < H:
                                Out[row, hb * BH + j] = o_io[hb * BH + j]
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

    def sum_parts(buf, i, stride):
        total = buf[i]
        for p in range(1, SP):
            total = total + buf[p * stride + i]
        return total

    split_step = matvec_step(MASKED, staged)

    @T.macro
    def partials(S, Fn, Dots, Sq):
        with P.kernel(M * SP, cfg.threads) as pid:
            s_io = P.alloc_io((BC,), "float32" if MASKED else dtype)
            f_io = P.alloc_io((MIX, BC), "float32")
            d_io = P.alloc_io((MIX,), "float32")
            q_io = P.alloc_io((1,), "float32")
            acc = P.alloc_vec((MIX,), "float32")
            ss = P.alloc_vec((1,), "float32")
            for t in P.tiles(M * SP, pid):
                with P.vector(cfg.threads):
                    for o in T.Parallel(MIX):
                        acc[o] = 0.0
                    ss[0] = 0.0
                for cc in T.serial(CPP):
                    c = t % SP * CPP + cc
                    if MASKED:
                        with P.vector(cfg.threads):
                            for j in T.Parallel(BC):
                                s_io[j] = T.if_then_else(c * BC + j < KN,
                                                         T.cast(S[t // SP, T.min(c * BC + j, KN - 1)], "float32"), 0.0)
                    else:
                        T.copy(S[t // SP, c * BC : (c + 1) * BC], s_io)
                    split_step(Fn, s_io, f_io, acc, ss, c)
                with P.vector(cfg.threads):
                    for o in T.Parallel(MIX):
                        d_io[o] = acc[o]
                    q_io[0] = ss[0]
                T.copy(d_io, Dots[t // SP, t % SP * MIX : (t % SP + 1) * MIX])
                T.copy(q_io, Sq[t // SP, t % SP : t % SP + 1])

    @T.macro
    def finish(S, Dots, Sq, Base, Scale, Pre, Post, Comb, Out, Wn, hc_eps, norm_eps):
        with P.kernel(M, cfg.threads) as pid:
            s_io = P.alloc_io((KN,), dtype) if collapse else None
            d_io = P.alloc_io((SP * MIX,), "float32")
            q_io = P.alloc_io((SP,), "float32")
            mix_io = P.alloc_io((MIX,), "float32")
            pre_io = P.alloc_io((N,), "float32")
            post_io = P.alloc_io((N,), "float32")
            comb_io = P.alloc_io((N * N,), "float32")
            alt_io = P.alloc_io((N * N,), "float32")
            red_io = P.alloc_io((N,), "float32")
            o_io = P.alloc_io((NH * BH if NORM else BH,), dtype) if collapse else None
            acc = P.alloc_vec((MIX,), "float32")
            ss = P.alloc_vec((1,), "float32")
            for row in P.tiles(M, pid):
                if collapse:
                    T.copy(S[row, 0:KN], s_io)
                T.copy(Dots[row, 0 : SP * MIX], d_io)
                T.copy(Sq[row, 0:SP], q_io)
                with P.vector(cfg.threads):  # the parts in order: the same sums every run
                    for o in T.Parallel(MIX):
                        acc[o] = sum_parts(d_io, o, MIX)
                    ss[0] = sum_parts(q_io, 0, 1)
                tail(row, acc, ss, s_io, mix_io, pre_io, post_io, comb_io, alt_io, red_io, o_io, Scale, Base, Pre, Post,
                     Comb, Out, Wn, hc_eps, norm_eps)

    Tn, F32 = T.Tensor, "float32"
    if stage == "split":
        @T.prim_func
        def kernel(S: Tn((M, KN), dtype), Fn: Tn((MIX, KN), F32), Dots: Tn((M, SP * MIX), F32), Sq: Tn((M, SP), F32)):
            partials(S, Fn, Dots, Sq)
    elif stage == "finish" and NORM:
        @T.prim_func
        def kernel(S: Tn((M, KN), dtype), Dots: Tn((M, SP * MIX), F32), Sq: Tn((M, SP), F32), Base: Tn((MIX,), F32),
                   Scale: Tn((3,), F32), Post: Tn((M, N), F32), Comb: Tn((M, N * N), F32), Out: Tn((M, H), dtype),
                   Wn: Tn((H,), F32), hc_eps: T.float32, norm_eps: T.float32):
            finish(S, Dots, Sq, Base, Scale, None, Post, Comb, Out, Wn, hc_eps, norm_eps)
    elif stage == "finish" and collapse:
        @T.prim_func
        def kernel(S: Tn((M, KN), dtype), Dots: Tn((M, SP * MIX), F32), Sq: Tn((M, SP), F32), Base: Tn((MIX,), F32),
                   Scale: Tn((3,), F32), Post: Tn((M, N), F32), Comb: Tn((M, N * N), F32), Out: Tn((M, H), dtype),
                   hc_eps: T.float32, norm_eps: T.float32):
            finish(S, Dots, Sq, Base, Scale, None, Post, Comb, Out, None, hc_eps, norm_eps)
    elif stage == "finish":
        @T.prim_func
        def kernel(Dots: Tn((M, SP * MIX), F32), Sq: Tn((M, SP), F32), Base: Tn((MIX,), F32), Scale: Tn((3,), F32),
                   Pre: Tn((M, N), F32), Post: Tn((M, N), F32), Comb: Tn((M, N * N), F32), hc_eps: T.float32,
                   norm_eps: T.float32):
            finish(None, Dots, Sq, Base, Scale, Pre, Post, Comb, None, None, hc_eps, norm_eps)
    else:
        raise ValueError(f"unknown mixes stage {stage!r} (split, finish)")
    return kernel


def kernels(name: str, collapse: bool) -> tuple[Kernel, ...]:
    """The op's kernels: `name`_split (partials of (token, part) tiles; on sm_90a the bf16 tensor-core GEMM of
    `hc_mixes_sm90`) and `name`_finish (per token: the sum of the parts, the tail and the stores)."""
    split = Kernel(name + "_split", functools.partial(mixes_body, collapse=collapse, stage="split"), configs=CONFIGS,
                   overrides=(Override("sm90", hc_mixes_sm90.fits, hc_mixes_sm90.body),))
    return split, Kernel(name + "_finish", functools.partial(mixes_body, collapse=collapse, stage="finish"),
                         configs=FINISH_CONFIGS)


def partials(launch, name: str, v, s: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`name`_split for variant `v` on the streams s [M, N*H]: the fp32 workspaces of partial dot products
    [M, split * MIX] and sums of squares [M, split] that the finishing kernel reads."""
    m, mix = s.shape[0], (2 + v.hc) * v.hc
    dots = torch.empty(m, v.split * mix, dtype=torch.float32, device=s.device)
    sq = torch.empty(m, v.split, dtype=torch.float32, device=s.device)
    split = dataclasses.replace(v, norm=False) if getattr(v, "norm", False) else v  # the partials know no norm
    launch(name + "_split", split)(s, fn.float().contiguous(), dots, sq)
    return dots, sq


KERNELS = kernels("hc_mixes", collapse=False)


def variant(streams: torch.Tensor, sinkhorn_iters: int) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    _, n, h = streams.shape
    return Variant(hc=n, hidden=h, iters=sinkhorn_iters, dtype=dtypes.name(streams.dtype), split=split_for(n * h))


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
    v = variant(streams, sinkhorn_iters)
    dots, sq = partials(launch, "hc_mixes", v, streams.reshape(m, n * h).contiguous(), fn)
    launch("hc_mixes_finish", v)(dots, sq, base.float().contiguous(), scale.float().contiguous(), pre, post, comb,
                                 float(hc_eps), float(norm_eps))
    return pre, post, comb.view(m, n, n)


def example(v: Variant, rows: int, device) -> tuple:
    mix = (2 + v.hc) * v.hc
    streams = torch.randn(rows, v.hc, v.hidden, device=device).to(dtypes.torch_dtype(v.dtype))
    fn = 0.02 * torch.randn(mix, v.hc * v.hidden, device=device)
    return (streams, fn, 0.5 * torch.randn(mix, device=device), 1 + 0.1 * torch.randn(3, device=device), v.iters, 1e-6, 1e-6)


OP = OpDecl(
    "hc_mixes", "mHC pre/post/comb mixes with Sinkhorn (no collapse)", reference,
    kernels=KERNELS,
    # fp32 outputs whatever the streams' dtype: sums in another order (hc_pre's 2e-2 is for its bf16 collapse)
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (1e-4, 1e-4)},
    run=run, example=example,
)
