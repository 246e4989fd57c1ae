"""FP4 (e2m1) quantize-dequantize of activations along the last dim, as DeepSeek-V4.1 stores its compressed
state: the values come back in the input's dtype, rounded to what the FP4 storage holds.

Two scale formats, one scale per `group` values:
- `ue8m0` (V4.1's index queries and keys, groups of 32): s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), exact
  (frexp, not log2: a value just above a power of two must round up);
- `e4m3` (V4.1's compressed KV latents, groups of 16): s = e4m3(max(amax, 6 * 2^-9) / 6), round to nearest even.
The codes are e2m1(clamp(x / s, -6, 6)) rounded to nearest, ties to the even code; the result is code * s.

The kernel computes the same bits with integer and fp32 arithmetic only (the scales through `fp8`, the e2m1
rounding as a round-half-even at the code's step: 0.5 below 2, 1 below 4, 2 up to 6), so one body runs on
every target, the CPU `c` target included. code * s is exact in fp32 and in bf16 (at most 2 + 4 significant
bits), so the kernel matches the reference bit for bit: zero tolerance. One tile per (row, `width` columns).
"""

from dataclasses import dataclass

import torch

from tilekernels import dtypes, fp8
from tilekernels.op import Kernel, OpDecl, require
from tilekernels.quant import FP4_MAX, FP8_MAX

SCALE_FORMATS = ("ue8m0", "e4m3")
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 codes 0..7; even codes win ties


def e2m1_code(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] -> the code of the nearest e2m1 value (ties to the even code), int64 in [0, 16):
    bits 0-2 the magnitude's index in `_MAGNITUDES`, bit 3 the sign (set for -0 too)."""
    mags = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=v.device)
    a = v.abs().unsqueeze(-1)
    mids = (mags[1:] + mags[:-1]) / 2
    tie_up = torch.arange(1, 8, device=v.device) % 2 == 0  # at a midpoint, round up only to an even code
    code = (a > mids).sum(-1) + ((a == mids) & tie_up).sum(-1)
    return code + 8 * torch.signbit(v).long()


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] -> the nearest e2m1 value (ties to the even code), fp32."""
    mags = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=v.device)
    return torch.copysign(mags[e2m1_code(v) % 8], v)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive fp32 x, exactly (from the binary exponent)."""
    mantissa, exponent = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), torch.where(mantissa == 0.5, exponent - 1, exponent))


def fp4_scales(xg: torch.Tensor, scale_format: str) -> torch.Tensor:
    """fp32 groups [..., G, group] -> their fp32 scales [..., G, 1]."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale format {scale_format!r} is not one of {SCALE_FORMATS}")
    amax = xg.abs().amax(-1, keepdim=True)
    if scale_format == "ue8m0":
        return pow2_ceil(amax.clamp(min=FP4_MAX * 2.0**-126) * torch.tensor(1 / FP4_MAX, dtype=torch.float32))
    return (amax.clamp(min=FP4_MAX * 2.0**-9) / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()


def reference(x: torch.Tensor, group: int, scale_format: str) -> torch.Tensor:
    """x [..., K] with K a multiple of `group` -> x rounded through FP4 storage, in x's dtype."""
    if x.shape[-1] % group:
        raise ValueError(f"the last dim {x.shape[-1]} is not a multiple of the FP4 group {group}")
    xg = x.float().unflatten(-1, (-1, group))
    s = fp4_scales(xg, scale_format)
    return (e2m1_round((xg / s).clamp(-FP4_MAX, FP4_MAX)) * s).flatten(-2).to(x.dtype)


GROUPS = (2, 4, 8, 16, 32, 64, 128)  # group widths the kernel takes: they divide the GPU thread count
UE8M0_FLOOR = FP4_MAX * 2.0**-126


@dataclass(frozen=True)
class Variant:
    k: int  # columns (a multiple of the group)
    group: int
    scale_format: str  # "ue8m0" or "e4m3"
    dtype: str


@dataclass(frozen=True)
class Config:
    width: int = 256  # columns per tile (whole groups)
    threads: int = 128


def tiling(P, v: Variant, cfg: Config) -> tuple[int, int, int, int, bool]:
    """(groups per row, groups per tile, tiles per row, register rows, whether no tile has a masked edge)."""
    kb = v.k // v.group
    cg = max(1, min(kb, cfg.width // v.group))
    nt = -(-kb // cg)  # the last tile is partial when cg does not divide kb
    cgp = P.padded(cg * v.group, cfg.threads) // v.group  # padded so the threads divide the tile
    return kb, cg, nt, cgp, kb % cg == 0 and cgp == cg


def body(P, v: Variant, cfg: Config):
    T = P.T
    K, G, dtype = v.k, v.group, v.dtype
    KB, CG, NT, CGP, FULL = tiling(P, v, cfg)
    M = T.dynamic("M")

    def scale(amax, sixth, floor):  # ue8m0: the scale; e4m3: the scale's e4m3 byte (decoded once stored)
        if v.scale_format == "ue8m0":  # 1/6 and the floor are arguments: C prints fp32 literals with 7 digits
            return fp8.pow2_ceil(T, T.max(amax, floor) * sixth)
        return T.cast(fp8.encode(T, T.max(amax, FP4_MAX * 2.0**-9) / FP4_MAX), "float32")

    def step(a):  # the e2m1 spacing around |y| = a
        return T.if_then_else(a < 2.0, 0.5, T.if_then_else(a < 4.0, 1.0, 2.0))

    def even(r, t):  # round-half-even of t from r = floor(t + 0.5): a tie rounded to an odd integer goes down
        return T.if_then_else(T.And(r - t == 0.5, T.bitwise_and(T.cast(r, "int32"), 1) == 1), r - 1.0, r)

    @T.prim_func
    def kernel(X: T.Tensor((M, K), dtype), Y: T.Tensor((M, K), dtype), sixth: T.float32, floor: T.float32):
        with P.kernel(M * NT, cfg.threads) as pid:
            x_io = P.alloc_io((CGP * G,), dtype)
            s_io = P.alloc_io((CGP,), "float32")
            for t in P.tiles(M * NT, pid):
                row = t // NT
                k0 = (t % NT) * CG * G
                if FULL:
                    T.copy(X[row, k0 : k0 + CG * G], x_io)
                else:  # columns past the row (a partial last tile, the thread padding) load as 0
                    with P.vector(cfg.threads):
                        for e in T.Parallel(CGP * G):
                            x_io[e] = T.if_then_else(T.And(e < CG * G, k0 + e < K), X[row, T.min(k0 + e, K - 1)],
                                                     T.cast(0.0, dtype))
                with P.vector(cfg.threads):  # each step into a buffer: nested expressions would grow exponentially
                    y = P.alloc_reg((CGP, G), "float32")
                    a = P.alloc_reg((CGP, G), "float32")
                    r = P.alloc_reg((CGP, G), "float32")
                    amax = P.alloc_reg((CGP,), "float32")
                    for i, j in T.Parallel(CGP, G):
                        y[i, j] = T.cast(x_io[i * G + j], "float32")
                        a[i, j] = T.max(y[i, j], -y[i, j])
                    T.reduce_max(a, amax, dim=1)
                    for i in T.Parallel(CGP):
                        s_io[i] = scale(amax[i], sixth, floor)
                    if v.scale_format == "e4m3":
                        for i in T.Parallel(CGP):
                            s_io[i] = fp8.decode(T, T.cast(s_io[i], "int32"))
                    for i, j in T.Parallel(CGP, G):  # e2m1(clamp(x / s, -6, 6)), ties to the even code
                        y[i, j] = T.cast(x_io[i * G + j], "float32") / s_io[i]
                        a[i, j] = T.min(T.max(y[i, j], -y[i, j]), FP4_MAX)
                        r[i, j] = a[i, j] / step(a[i, j])  # exact: the step is a power of two
                        r[i, j] = even(T.floor(r[i, j] + 0.5), r[i, j]) * step(a[i, j])
                        x_io[i * G + j] = T.cast(T.if_then_else(T.reinterpret(y[i, j], "int32") < 0, -r[i, j], r[i, j])
                                                 * s_io[i], dtype)  # the sign bit: -0 included
                if FULL:
                    T.copy(x_io, Y[row, k0 : k0 + CG * G])
                else:
                    with P.vector(cfg.threads):
                        for e in T.Parallel(CGP * G):
                            if T.And(e < CG * G, k0 + e < K):
                                Y[row, k0 + e] = x_io[e]

    return kernel


KERNEL = Kernel("fp4_act_qdq", body, configs={"default": Config(), "c": Config(width=64, threads=1)})


def variant(x: torch.Tensor, group: int, scale_format: str) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    return Variant(x.shape[-1], group, scale_format, dtypes.name(x.dtype))


def run(launch, x: torch.Tensor, group: int, scale_format: str) -> torch.Tensor:
    require(scale_format in SCALE_FORMATS, "fp4_act_qdq", f"scale format {scale_format!r} is not one of {SCALE_FORMATS}")
    require(group in GROUPS, "fp4_act_qdq", f"group must be one of {GROUPS} columns, got {group}")
    require(x.dim() >= 1 and x.shape[-1] % group == 0, "fp4_act_qdq",
            f"the last dim {list(x.shape)[-1:]} must be a multiple of the FP4 group {group}")
    v = variant(x, group, scale_format)
    rows = x.reshape(-1, v.k).contiguous()
    y = torch.empty_like(rows)
    if rows.shape[0]:
        launch("fp4_act_qdq", v)(rows, y, 1 / FP4_MAX, UE8M0_FLOOR)  # as fp32: the reference's
    return y.view(x.shape)


def example(v: Variant, rows: int, device) -> tuple:
    """Groups of mixed magnitudes (tiny ones reach the scale floors, one is all zero), exact e2m1 ties of both
    signs (-0.25 rounds to a negative zero: packed as code 8) and small negatives that round to zero."""
    x = torch.randn(rows, v.k, device=device) * torch.logspace(-12, 3, rows, device=device)[:, None]
    x[0, : v.group] = 0.0
    x[0, v.group :] *= torch.where(torch.rand(v.k - v.group, device=device) < 0.25, 1e-3, 1.0)
    x[-1, : v.group] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * (v.group // 8 or 1),
                                    device=device)[: v.group] * (-1) ** torch.arange(v.group, device=device)
    return (x.to(dtypes.torch_dtype(v.dtype)), v.group, v.scale_format)


OP = OpDecl(
    "fp4_act_qdq", "FP4 e2m1 quantize-dequantize per group (ue8m0 or e4m3 scales)", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0)},  # bit-exact, see the module docstring
    run=run, example=example,
)
