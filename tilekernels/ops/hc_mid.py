"""mHC between two sublayers: one sublayer's post-block (`hc_post`) and the next one's pre-block (`hc_pre`) in one
op, since nothing runs between them. At decode rows the post-block's kernel also writes the pre-block's partial
mixing products of the streams it has just made, so the pre-block's partials kernel (the first of its two) is not
launched: one kernel less a sublayer in a chain of small ones (at one token `hc_pre`'s partials took 6.8 us for 1.5 MB
of mixing weights on the H200, `hc_post` 1.7 us).

- `hc_mid_post` (rows up to `FUSED_ROWS`, not batch invariant): one tile per (token, part) of `part` columns of
  each of the N streams: the new streams' columns (as `hc_post`), stored, then their dot products with the next
  mixing weights' same columns and their sum of squares (fp32, from the stored bf16 values: what `hc_pre` reads)
  into the partials workspaces; `hc_pre`'s finishing kernel sums the parts in order and runs the tail and the
  collapse. Part p covers columns [p * part, (p + 1) * part) of every stream: another partition of K than
  `hc_pre`'s split (the sums' last bits differ from it, as the sm90 GEMM's do from the portable split).
- Otherwise (more rows: prefill; the batch-invariant mode; widths without a fused form) `hc_post`'s kernel, then
  `hc_pre`'s two (their GEMM partials at prefill), unchanged. A decode step and a speculative verify step of up to
  `FUSED_ROWS` rows take the same form, so a row's bits do not depend on which of the two it is in."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require
from tilekernels.ops import hc_mixes, hc_post, hc_pre

FUSED_ROWS = 64  # up to this many rows the fused form (decode batches, speculative verify steps)
PART = 128  # columns of each stream per tile: 32 parts at V4-Flash's 4096 (as hc_pre's split), 48 KB of weights each
THREADS = 128  # the GPU bodies' threads; a tile's N * part values are a multiple of them (no padded lanes)


def reference(streams, out, post, comb, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm=None):
    """streams [T, N, H], out [T, H], post [T, N], comb [T, N, N] and the next pre-block's fn, base, scale (and
    `norm`, as `hc_pre`'s) -> (streams [T, N, H] after the post-block, then the next pre-block's post [T, N], comb
    [T, N, N], collapsed [T, H])."""
    mixed = hc_post.reference(streams, out, post, comb)
    return (mixed, *hc_pre.reference(mixed, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm))


@dataclass(frozen=True)
class Variant:
    hc: int  # N streams
    hidden: int  # H
    dtype: str
    part: int  # columns of each stream per tile (divides H)


@dataclass(frozen=True)
class Config:
    threads: int = THREADS


def part_for(n: int, h: int) -> int:
    """Columns per part of the fused form, 0 where there is none: PART where it divides H, else H whole when the
    tile's N * H values are a multiple of THREADS."""
    if h % PART == 0:
        return PART
    return h if (n * h) % THREADS == 0 else 0


def fused_variant(streams: torch.Tensor, invariant: bool = False) -> Variant | None:
    """The fused form's variant for these streams, None where the op runs `hc_post` and `hc_pre` instead (no tensor
    values are read: meta tensors work)."""
    m, n, h = streams.shape
    part = part_for(n, h)
    if invariant or m > FUSED_ROWS or not part:
        return None
    return Variant(n, h, dtypes.name(streams.dtype), part)


def body(P, v: Variant, cfg: Config):
    T = P.T
    N, H, PW, dtype = v.hc, v.hidden, v.part, v.dtype
    SP, KN, MIX, E = H // PW, N * H, (2 + N) * N, N * v.part
    F32 = "float32"
    M = T.dynamic("M")

    def mixed(post, comb, o, s, n, j):  # hc_post's sum, in its order
        total = post[n] * T.cast(o[j], F32)
        for m in range(N):
            total = total + comb[m * N + n] * T.cast(s[m * PW + j], F32)
        return total

    @T.prim_func
    def kernel(S: T.Tensor((M, KN), dtype), O: T.Tensor((M, H), dtype), Post: T.Tensor((M, N), F32),
               Comb: T.Tensor((M, N * N), F32), Fn: T.Tensor((MIX, KN), F32), Y: T.Tensor((M, KN), dtype),
               Dots: T.Tensor((M, SP * MIX), F32), Sq: T.Tensor((M, SP), F32)):
        with P.kernel(M * SP, cfg.threads) as pid:
            s_io = P.alloc_io((E,), dtype)
            y_io = P.alloc_io((E,), dtype)
            o_io = P.alloc_io((PW,), dtype)
            f_io = P.alloc_io((MIX, E), F32)
            post_io = P.alloc_io((N,), F32)
            comb_io = P.alloc_io((N * N,), F32)
            d_io = P.alloc_io((MIX,), F32)
            q_io = P.alloc_io((1,), F32)
            for t in P.tiles(M * SP, pid):
                row = t // SP
                p = t % SP
                h0 = p * PW
                T.copy(Post[row, 0:N], post_io)
                T.copy(Comb[row, 0 : N * N], comb_io)
                for n in T.serial(N):
                    T.copy(S[row, n * H + h0 : n * H + h0 + PW], s_io[n * PW : (n + 1) * PW])
                T.copy(O[row, h0 : h0 + PW], o_io)
                with P.vector(cfg.threads):  # the part's mixing weights: PW columns of each stream's block
                    for o, e in T.Parallel(MIX, E):
                        f_io[o, e] = Fn[o, e // PW * H + h0 + e % PW]
                with P.vector(cfg.threads):
                    for n, j in T.Parallel(N, PW):
                        y_io[n * PW + j] = T.cast(mixed(post_io, comb_io, o_io, s_io, n, j), dtype)
                with P.vector(cfg.threads):
                    prod = P.alloc_reg((MIX, E), F32)
                    part = P.alloc_reg((MIX,), F32)
                    sq = P.alloc_reg((E,), F32)
                    tot = P.alloc_reg((1,), F32)
                    for o, e in T.Parallel(MIX, E):
                        prod[o, e] = f_io[o, e] * T.cast(y_io[e], F32)
                    T.reduce_sum(prod, part, dim=1)
                    for e in T.Parallel(E):
                        sq[e] = T.cast(y_io[e], F32) * T.cast(y_io[e], F32)
                    T.reduce_sum(sq, tot, dim=0)
                    for o in T.Parallel(MIX):
                        d_io[o] = part[o]
                    q_io[0] = tot[0]
                for n in T.serial(N):
                    T.copy(y_io[n * PW : (n + 1) * PW], Y[row, n * H + h0 : n * H + h0 + PW])
                T.copy(d_io, Dots[row, p * MIX : (p + 1) * MIX])
                T.copy(q_io, Sq[row, p : p + 1])

    return kernel


KERNEL = Kernel("hc_mid_post", body, configs={"default": Config(), "c": Config(threads=1)})


def run(launch, streams, out, post, comb, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm=None):
    m, n, h = streams.shape
    require(out.shape == (m, h) and post.shape == (m, n) and comb.shape == (m, n, n), "hc_mid",
            f"out/post/comb must be [{m}, {h}]/[{m}, {n}]/[{m}, {n}, {n}], got {list(out.shape)}/{list(post.shape)}/"
            f"{list(comb.shape)}")
    hc_mixes.check("hc_mid", streams, fn, base, scale, sinkhorn_iters)
    v = fused_variant(streams, getattr(launch, "invariant", False))
    if v is None:
        mixed = hc_post.run(launch.op("hc_post"), streams, out, post, comb)
        return (mixed, *hc_pre.run(launch.op("hc_pre"), mixed, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps,
                                   norm))
    split, mix = h // v.part, (2 + n) * n
    y = torch.empty(m, n * h, dtype=streams.dtype, device=streams.device)
    dots = torch.empty(m, split * mix, dtype=torch.float32, device=streams.device)
    sq = torch.empty(m, split, dtype=torch.float32, device=streams.device)
    launch("hc_mid_post", v)(streams.reshape(m, n * h).contiguous(), out.contiguous(), post.float().contiguous(),
                             comb.reshape(m, n * n).float().contiguous(), fn.float().contiguous(), y, dots, sq)
    finish = hc_pre.Variant(hc=n, hidden=h, iters=sinkhorn_iters, dtype=v.dtype, split=split, norm=norm is not None)
    return (y.view(m, n, h), *hc_pre.finish(launch.op("hc_pre"), finish, y, dots, sq, base, scale, hc_eps, norm_eps,
                                             norm, "hc_mid"))


def example(v: Variant, rows: int, device) -> tuple:
    """The model's form: the next sublayer's input norm too."""
    streams, out, post, comb = hc_post.example(hc_post.Variant(v.hc, v.hidden, v.dtype), rows, device)
    _, fn, base, scale, iters, hc_eps, norm_eps = hc_mixes.example(
        hc_mixes.Variant(v.hc, v.hidden, 20, v.dtype), rows, device)  # V4's 20 Sinkhorn iterations
    return streams, out, post, comb, fn, base, scale, iters, hc_eps, norm_eps, 1 + 0.1 * torch.randn(v.hidden, device=device)


OP = OpDecl(
    "hc_mid", "mHC post-block, then the next sublayer's pre-block (decode rows: one kernel less)", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (3e-2, 2e-2)},
    run=run, example=example, uses=("hc_post", "hc_pre"), row_samples=(FUSED_ROWS + 1,),
)
