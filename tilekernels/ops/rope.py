"""Partial interleaved RoPE on the trailing `2 * len(inv_freq)` channels, and its inverse.

Pairs are (0,1), (2,3), ... of the rotated slice; the leading channels pass through. cos/sin are computed
from the absolute positions in fp32, cast to x's dtype, and the rotation runs in fp32. `inverse=True` rotates
by the negative angle (used on the attention output, whose value half carries the keys' rotation).

`inplace=True` lets the op return x itself with its rotated channels overwritten (the caller gives up x; the
reference returns a new tensor, which is as good): the kernel then reads and writes the rotated channels only
(V4's queries rotate 64 of 512 channels: 1/8 of the bytes of the copying form). `norm_eps` normalises each row
first (V4's per-head query norm) in the same in-place pass: one read and one write of the queries.
"""

from dataclasses import dataclass, field

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require


def reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
    inverse: bool = False,
    inplace: bool = False,
    norm_eps: float | None = None,
) -> torch.Tensor:
    """x [N, ..., D], positions [N] int, inv_freq [r/2] fp32 -> x with its last r channels rotated (`inplace`: the
    kernel may reuse x's storage for the result; the reference never does). `norm_eps`: x first normalised by the
    unweighted RMSNorm of each row of D (`rms_norm_unweighted`, V4's per-head query norm), in the same pass."""
    if norm_eps is not None:
        x = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + norm_eps).to(x.dtype)
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [N, r/2]
    cos = (freqs.cos() * attention_factor).to(x.dtype)
    sin = (freqs.sin() * attention_factor).to(x.dtype)
    if inverse:
        sin = -sin
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    cos = cos.repeat_interleave(2, dim=-1).view(view)
    sin = sin.repeat_interleave(2, dim=-1).view(view)
    r = cos.shape[-1]
    nope, rot = x[..., :-r], x[..., -r:]
    rot_half = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rot.float() * cos + rot_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


@dataclass(frozen=True)
class Variant:
    heads: int  # rows per token (1 for a single K=V head)
    dim: int  # D
    rope_dim: int  # r: the rotated trailing channels
    dtype: str
    inverse: bool = False
    inplace: bool = False  # the rotated channels written back into x (no output tensor)
    norm: bool = False  # in place, each row first RMS-normalised (unweighted): every channel read and written


@dataclass(frozen=True)
class Config:
    threads: int = 128
    pass_configs: dict = field(default_factory=dict, hash=False, compare=False)


# sm90 / sm100: plain vector copies (a tile is a few KB; a TMA store of the normalising form's staged rows had
# TileLang synchronise inside the staging loop)
_NO_TMA = Config(pass_configs={"tl.disable_tma_lower": True})


def body(P, v: Variant, cfg: Config):
    if v.norm:
        return body_norm(P, v, cfg)
    if v.inplace:
        return body_inplace(P, v, cfg)
    T = P.T
    H, D, R, dtype = v.heads, v.dim, v.rope_dim, v.dtype
    NOPE = D - R
    sign = -1.0 if v.inverse else 1.0
    M = T.dynamic("M")

    @T.prim_func
    def kernel(X: T.Tensor((M, H, D), dtype), Pos: T.Tensor((M,), "int32"), F: T.Tensor((R // 2,), "float32"),
               Y: T.Tensor((M, H, D), dtype), factor: T.float32):
        with P.kernel(M * H, cfg.threads) as pid:
            x_io = P.alloc_io((D,), dtype)
            y_io = P.alloc_io((D,), dtype)
            f_io = P.alloc_io((R // 2,), "float32")
            T.copy(F[0 : R // 2], f_io)
            for t in P.tiles(M * H, pid):
                row = t // H
                head = t % H
                T.copy(X[row, head, 0:D], x_io)
                with P.vector(cfg.threads):
                    for j in T.Parallel(D):
                        k = T.max(j - NOPE, 0)
                        angle = T.cast(Pos[row], "float32") * f_io[k // 2]
                        c = T.cast(T.cast(T.cos(angle) * factor, dtype), "float32")
                        s = T.cast(T.cast(T.sin(angle) * (factor * sign), dtype), "float32")
                        mate = T.if_then_else(k % 2 == 0, -T.cast(x_io[T.min(j + 1, D - 1)], "float32"),
                                              T.cast(x_io[T.max(j - 1, 0)], "float32"))
                        y_io[j] = T.if_then_else(j < NOPE, x_io[j],
                                                 T.cast(T.cast(x_io[j], "float32") * c + mate * s, dtype))
                T.copy(y_io, Y[row, head, 0:D])

    return kernel


def heads_per_tile(heads: int, rope_dim: int, threads: int) -> int:
    """The in-place form's heads per tile: the most that divide `heads` with at most 4 rotated channels per thread
    (V4's queries: 8 heads of 64, 8 tiles for a decode token, 131K for a 16K-token prefill chunk)."""
    return max(g for g in range(1, heads + 1) if heads % g == 0 and (g == 1 or g * rope_dim <= 4 * threads))


def body_inplace(P, v: Variant, cfg: Config):
    """The in-place form: one tile per (token, group of heads), the group's rotated channels read into one vector,
    rotated and written back."""
    T = P.T
    H, D, R, dtype = v.heads, v.dim, v.rope_dim, v.dtype
    G = heads_per_tile(H, R, cfg.threads)
    HG, GR = H // G, G * R
    NOPE = D - R
    sign = -1.0 if v.inverse else 1.0
    M = T.dynamic("M")

    @T.prim_func
    def kernel(X: T.Tensor((M, H, D), dtype), Pos: T.Tensor((M,), "int32"), F: T.Tensor((R // 2,), "float32"),
               factor: T.float32):
        with P.kernel(M * HG, cfg.threads) as pid:
            x_io = P.alloc_io((GR,), dtype)
            y_io = P.alloc_io((GR,), dtype)
            f_io = P.alloc_io((R // 2,), "float32")
            T.copy(F[0 : R // 2], f_io)
            for t in P.tiles(M * HG, pid):
                row = t // HG
                h0 = t % HG * G
                for g in T.serial(G):
                    T.copy(X[row, h0 + g, NOPE:D], x_io[g * R : g * R + R])
                with P.vector(cfg.threads):
                    for j in T.Parallel(GR):
                        k = j % R  # the channel within its head's rotated slice; its pair mate is in the same head
                        angle = T.cast(Pos[row], "float32") * f_io[k // 2]
                        c = T.cast(T.cast(T.cos(angle) * factor, dtype), "float32")
                        s = T.cast(T.cast(T.sin(angle) * (factor * sign), dtype), "float32")
                        mate = T.if_then_else(k % 2 == 0, -T.cast(x_io[T.min(j + 1, GR - 1)], "float32"),
                                              T.cast(x_io[T.max(j - 1, 0)], "float32"))
                        y_io[j] = T.cast(T.cast(x_io[j], "float32") * c + mate * s, dtype)
                for g in T.serial(G):
                    T.copy(y_io[g * R : g * R + R], X[row, h0 + g, NOPE:D])

    return kernel


def norm_heads_per_tile(heads: int, dim: int, threads: int) -> int:
    """The normalising form's heads per tile: the most that divide `heads` with at most 16 channels per thread
    (V4's queries: 4 heads of 512 with 128 threads)."""
    return max(g for g in range(1, heads + 1) if heads % g == 0 and (g == 1 or g * dim <= 16 * threads))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def body_norm(P, v: Variant, cfg: Config):
    """The normalising in-place form: one tile per (token, group of heads); each head's row normalised in fp32 and
    rounded to x's dtype (the rms_norm kernel's arithmetic), its trailing channels then rotated from those rounded
    values (the rope kernel's), the whole rows written back: one read and one write of x instead of two each."""
    T = P.T
    H, D, R, dtype = v.heads, v.dim, v.rope_dim, v.dtype
    G = norm_heads_per_tile(H, D, cfg.threads)
    HG = H // G
    NOPE = D - R
    sign = -1.0 if v.inverse else 1.0
    M = T.dynamic("M")
    F32 = "float32"

    DP = P.padded(D, cfg.threads)
    # one reduction over [G, D] where the threads split it into whole power-of-two groups a row (the reduction's
    # butterfly needs that); otherwise one reduction a head over the padded width
    ROWWISE = G * D % cfg.threads == 0 and _pow2(cfg.threads // G) and (G * D // cfg.threads) <= D and cfg.threads > 1

    def square(x_io, g, j):  # x[g, j]^2 in fp32, 0 in the padding
        if DP == D:
            return T.cast(x_io[g, j], F32) * T.cast(x_io[g, j], F32)
        return T.if_then_else(j < D, T.cast(x_io[g, T.min(j, D - 1)], F32) * T.cast(x_io[g, T.min(j, D - 1)], F32),
                              0.0)

    def normed(x_io, r_io, g, j):  # channel j of head g normalised, rounded to x's dtype, back in fp32
        return T.cast(T.cast(T.cast(x_io[g, j], F32) * r_io[g], dtype), F32)

    @T.prim_func
    def kernel(X: T.Tensor((M, H, D), dtype), Pos: T.Tensor((M,), "int32"), F: T.Tensor((R // 2,), F32),
               factor: T.float32, eps: T.float32):
        with P.kernel(M * HG, cfg.threads) as pid:
            x_io = P.alloc_io((G, D), dtype)
            y_io = P.alloc_io((G, D), dtype)
            r_io = P.alloc_io((G,), F32)  # each head's 1 / rms
            f_io = P.alloc_io((R // 2,), F32)
            T.copy(F[0 : R // 2], f_io)
            for t in P.tiles(M * HG, pid):
                row = t // HG
                h0 = t % HG * G
                T.copy(X[row, h0 : h0 + G, 0:D], x_io)
                if ROWWISE:  # every head's sum of squares in one reduction (a warp's lanes a row at V4's widths)
                    with P.vector(cfg.threads):
                        sq2 = P.alloc_reg((G, D), F32)
                        ss2 = P.alloc_reg((G,), F32)
                        for g, j in T.Parallel(G, D):
                            sq2[g, j] = T.cast(x_io[g, j], F32) * T.cast(x_io[g, j], F32)
                        T.reduce_sum(sq2, ss2, dim=1)
                        for g in T.Parallel(G):
                            r_io[g] = T.rsqrt(ss2[g] / D + eps)
                else:
                    for g in T.serial(G):  # one reduction a head, over DP (the threads' width: see rms_norm)
                        with P.vector(cfg.threads):
                            sq = P.alloc_reg((DP,), F32)
                            ss = P.alloc_reg((1,), F32)
                            for j in T.Parallel(DP):
                                sq[j] = square(x_io, g, j)
                            T.reduce_sum(sq, ss, dim=0)
                            r_io[g] = T.rsqrt(ss[0] / D + eps)
                with P.vector(cfg.threads):  # every channel normalised (the rotated ones overwritten next)
                    for g, j in T.Parallel(G, D):
                        y_io[g, j] = T.cast(normed(x_io, r_io, g, j), dtype)
                with P.vector(cfg.threads):
                    for g, k in T.Parallel(G, R):  # k: the channel within the rotated slice
                        angle = T.cast(Pos[row], F32) * f_io[k // 2]
                        c = T.cast(T.cast(T.cos(angle) * factor, dtype), F32)
                        s = T.cast(T.cast(T.sin(angle) * (factor * sign), dtype), F32)
                        mate = T.if_then_else(k % 2 == 0, -normed(x_io, r_io, g, NOPE + T.min(k + 1, R - 1)),
                                              normed(x_io, r_io, g, NOPE + T.max(k - 1, 0)))
                        y_io[g, NOPE + k] = T.cast(normed(x_io, r_io, g, NOPE + k) * c + mate * s, dtype)
                T.copy(y_io, X[row, h0 : h0 + G, 0:D])

    return kernel


KERNEL = Kernel("rope", body, configs={"default": Config(), "sm90": _NO_TMA, "sm100": _NO_TMA, "c": Config(threads=1)})


def variant(x: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False, inplace: bool = False,
            norm: bool = False) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    heads = 1 if x.dim() == 2 else x.shape[-2]
    v = Variant(heads=heads, dim=x.shape[-1], rope_dim=2 * inv_freq.shape[0], dtype=dtypes.name(x.dtype),
                inverse=inverse, inplace=inplace or norm, norm=norm)
    require(v.rope_dim <= v.dim, "rope", f"the rotated width {v.rope_dim} exceeds the head dim {v.dim}")
    return v


def run(launch, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0,
        inverse: bool = False, inplace: bool = False, norm_eps: float | None = None) -> torch.Tensor:
    if norm_eps is not None:  # normalised in place: into x, or into a contiguous copy of a strided x (not x)
        if not (inplace and x.is_contiguous()):
            x = x.clone(memory_format=torch.contiguous_format)
        v = variant(x, inv_freq, inverse, norm=True)
        launch("rope", v)(x.view(-1, v.heads, v.dim), positions.to(torch.int32), inv_freq.float().contiguous(),
                          float(attention_factor), float(norm_eps))
        return x
    v = variant(x, inv_freq, inverse, inplace and x.is_contiguous())  # a strided x: the copying form
    if v.inplace:
        launch("rope", v)(x.view(-1, v.heads, v.dim), positions.to(torch.int32), inv_freq.float().contiguous(),
                          float(attention_factor))
        return x
    rows = x.reshape(-1, v.heads, v.dim).contiguous()
    y = torch.empty_like(rows)
    launch("rope", v)(rows, positions.to(torch.int32), inv_freq.float().contiguous(), y, float(attention_factor))
    return y.view(x.shape)


def example(v: Variant, rows: int, device) -> tuple:
    shape = (rows, v.dim) if v.heads == 1 else (rows, v.heads, v.dim)  # a single K=V head comes as [N, D]
    x = torch.randn(*shape, device=device).to(dtypes.torch_dtype(v.dtype))
    pos = torch.randint(0, 65536, (rows,), device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, v.rope_dim, 2, device=device).float() / v.rope_dim))
    return (x, pos, inv, 1.0, v.inverse) + ((True,) if v.inplace or v.norm else ()) + ((1e-6,) if v.norm else ())


OP = OpDecl(
    "rope", "partial interleaved RoPE on the trailing dims (and its inverse)", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (3e-2, 2e-2)},
    run=run, example=example,
)
