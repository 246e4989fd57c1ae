"""FP4 (e2m1) quantization of activations into their stored form, as DeepSeek-V4.1's caches hold its compressed
latents and index keys: codes packed two per byte (low nibble first, bit 3 the sign: `quant.FP4_E2M1_VALUES`)
and one scale byte per `group` values: the ue8m0 exponent byte (scale 2^(b - 127)) or the e4m3 byte.

The scales and codes are exactly `fp4_act_qdq`'s (the same rounding, ties to the even code): `fp4_gather` of a
packed row gives back, bit for bit, what `fp4_act_qdq` returns for it.

The kernel is `fp4_act_qdq`'s with bytes out: the same integer / fp32 arithmetic (one body for every target, the
CPU `c` target included), the scale's byte kept (ue8m0: the exponent bits of max(amax, floor) / 6 plus one when
its mantissa is not zero; e4m3: `fp8.encode`), and the e2m1 code as the round-half-even count n of code steps
(0.5 below 2, 1 below 4, 2 up to 6) plus the code of the step's first value (0, 2, 4) plus 8 for the sign bit of
x / s (-0 included). A first vector region writes one code per value, a second packs the pairs: zero tolerance.
"""

import torch

from tilekernels import dtypes, fp8
from tilekernels.op import Kernel, OpDecl, require
from tilekernels.ops.fp4_act_qdq import (GROUPS, SCALE_FORMATS, UE8M0_FLOOR, Config, Variant, e2m1_code, example,
                                         fp4_scales, tiling)
from tilekernels.quant import FP4_MAX


def reference(x: torch.Tensor, group: int, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of `group` and of 2) -> (codes uint8 [..., K / 2], scales uint8 [..., K / group])."""
    if x.shape[-1] % group or x.shape[-1] % 2:
        raise ValueError(f"the last dim {x.shape[-1]} is not a multiple of the FP4 group {group} and of 2")
    xg = x.float().unflatten(-1, (-1, group))
    s = fp4_scales(xg, scale_format)
    code = e2m1_code((xg / s).clamp(-FP4_MAX, FP4_MAX)).flatten(-2).to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    if scale_format == "ue8m0":
        byte = (torch.frexp(s)[1] - 1 + 127).to(torch.uint8)  # s = 2^e exactly: frexp gives 0.5 * 2^(e + 1)
    else:
        byte = s.to(torch.float8_e4m3fn).view(torch.uint8)
    return packed, byte.squeeze(-1)


def body(P, v: Variant, cfg: Config):  # Variant and Config: fp4_act_qdq's (the same tiles)
    T = P.T
    K, G, dtype = v.k, v.group, v.dtype
    KB, CG, NT, CGP, FULL = tiling(P, v, cfg)
    H = G // 2  # bytes per group
    M = T.dynamic("M")

    def unrounded(amax, sixth, floor):  # max(amax, floor) / 6: the scale before its rounding to the format
        if v.scale_format == "ue8m0":  # 1/6 and the floor are arguments: C prints fp32 literals with 7 digits
            return T.max(amax, floor) * sixth
        return T.max(amax, FP4_MAX * 2.0**-9) / FP4_MAX  # 6 * 2^-9 prints exactly

    def scale_byte(u):
        if v.scale_format == "ue8m0":  # 2^ceil(log2(u)): u's exponent bits, plus one unless u is a power of two
            bits = T.reinterpret(u, "int32")
            return T.cast(T.shift_right(bits, 23) + T.if_then_else(T.bitwise_and(bits, 0x7FFFFF) != 0, 1, 0), "uint8")
        return fp8.encode(T, u)

    def scale_value(byte):
        if v.scale_format == "ue8m0":
            return fp8.pow2(T, T.cast(byte, "int32") - 127)  # byte >= 1 here: the floor is 2^-126
        return fp8.decode(T, byte)

    def inv_step(a):  # 1 / (the e2m1 spacing around |y| = a): a power of two, so a * inv_step is exact
        return T.if_then_else(a < 2.0, 2.0, T.if_then_else(a < 4.0, 1.0, 0.5))

    def first_code(a):  # the code of the first e2m1 value of a's spacing: 0 (0), 2 (1), 4 (2)
        return T.if_then_else(a < 2.0, 0, T.if_then_else(a < 4.0, 2, 4))

    def even(r, t):  # round-half-even of t from r = floor(t + 0.5): a tie rounded to an odd integer goes down
        return T.if_then_else(T.And(r - t == 0.5, T.bitwise_and(T.cast(r, "int32"), 1) == 1), r - 1.0, r)

    @T.prim_func
    def kernel(X: T.Tensor((M, K), dtype), Q: T.Tensor((M, K // 2), "uint8"), S: T.Tensor((M, KB), "uint8"),
               sixth: T.float32, floor: T.float32):
        with P.kernel(M * NT, cfg.threads) as pid:
            x_io = P.alloc_io((CGP * G,), dtype)
            c_io = P.alloc_io((CGP * G,), "uint8")  # one code per value
            q_io = P.alloc_io((CGP * H,), "uint8")  # the packed pairs
            b_io = P.alloc_io((CGP,), "uint8")  # the scale bytes
            s_io = P.alloc_io((CGP,), "float32")  # their values
            for t in P.tiles(M * NT, pid):
                row = t // NT
                g0 = (t % NT) * CG
                if FULL:
                    T.copy(X[row, g0 * G : g0 * G + CG * G], x_io)
                else:  # columns past the row (a partial last tile, the thread padding) load as 0
                    with P.vector(cfg.threads):
                        for e in T.Parallel(CGP * G):
                            x_io[e] = T.if_then_else(T.And(e < CG * G, g0 * G + e < K),
                                                     X[row, T.min(g0 * G + e, K - 1)], T.cast(0.0, dtype))
                with P.vector(cfg.threads):  # each step into a buffer: nested expressions would grow exponentially
                    y = P.alloc_reg((CGP, G), "float32")
                    a = P.alloc_reg((CGP, G), "float32")
                    r = P.alloc_reg((CGP, G), "float32")
                    amax = P.alloc_reg((CGP,), "float32")
                    for i, j in T.Parallel(CGP, G):
                        y[i, j] = T.cast(x_io[i * G + j], "float32")
                        a[i, j] = T.max(y[i, j], -y[i, j])  # no T.abs: the c target has no fabs lowering
                    T.reduce_max(a, amax, dim=1)
                    for i in T.Parallel(CGP):  # each step into a buffer, as above
                        s_io[i] = unrounded(amax[i], sixth, floor)
                    for i in T.Parallel(CGP):
                        b_io[i] = scale_byte(s_io[i])
                    for i in T.Parallel(CGP):
                        s_io[i] = scale_value(b_io[i])
                    for i, j in T.Parallel(CGP, G):  # e2m1(clamp(x / s, -6, 6)), ties to the even code
                        y[i, j] = T.cast(x_io[i * G + j], "float32") / s_io[i]
                        a[i, j] = T.min(T.max(y[i, j], -y[i, j]), FP4_MAX)
                        r[i, j] = a[i, j] * inv_step(a[i, j])  # steps of the code's spacing
                        r[i, j] = even(T.floor(r[i, j] + 0.5), r[i, j])
                        c_io[i * G + j] = T.cast(T.cast(r[i, j], "int32") + first_code(a[i, j])
                                                 + T.if_then_else(T.reinterpret(y[i, j], "int32") < 0, 8, 0),
                                                 "uint8")  # the sign bit of x / s: -0 included
                with P.vector(cfg.threads):  # low nibble: the even column
                    for e in T.Parallel(CGP * H):
                        q_io[e] = T.cast(T.bitwise_or(T.cast(c_io[2 * e], "int32"),
                                                      T.shift_left(T.cast(c_io[2 * e + 1], "int32"), 4)), "uint8")
                if FULL:
                    T.copy(q_io, Q[row, g0 * H : g0 * H + CG * H])
                    T.copy(b_io, S[row, g0 : g0 + CG])
                else:
                    with P.vector(cfg.threads):
                        for e in T.Parallel(CGP * H):
                            if T.And(e < CG * H, g0 * H + e < K // 2):
                                Q[row, g0 * H + e] = q_io[e]
                        for i in T.Parallel(CGP):
                            if T.And(i < CG, g0 + i < KB):
                                S[row, g0 + i] = b_io[i]

    return kernel


KERNEL = Kernel("fp4_pack", body, configs={"default": Config(), "c": Config(width=64, threads=1)})


def variant(x: torch.Tensor, group: int, scale_format: str) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    return Variant(x.shape[-1], group, scale_format, dtypes.name(x.dtype))


def run(launch, x: torch.Tensor, group: int, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    require(scale_format in SCALE_FORMATS, "fp4_pack", f"scale format {scale_format!r} is not one of {SCALE_FORMATS}")
    require(group in GROUPS, "fp4_pack", f"group must be one of {GROUPS} columns, got {group}")
    require(x.dtype in dtypes.NAMES, "fp4_pack", f"x must be one of {', '.join(dtypes.NAMES.values())}, got {x.dtype}")
    require(x.dim() >= 1 and x.shape[-1] % group == 0, "fp4_pack",
            f"the last dim of x {list(x.shape)} must be a multiple of the FP4 group {group}")
    v = variant(x, group, scale_format)
    rows = x.reshape(-1, v.k).contiguous()
    codes = torch.empty(rows.shape[0], v.k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows.shape[0], v.k // group, dtype=torch.uint8, device=x.device)
    if rows.shape[0]:
        launch("fp4_pack", v)(rows, codes, scales, 1 / FP4_MAX, UE8M0_FLOOR)  # as fp32: the reference's
    return codes.view(*x.shape[:-1], v.k // 2), scales.view(*x.shape[:-1], v.k // group)


OP = OpDecl(
    "fp4_pack", "FP4 e2m1 codes packed two per byte with a scale byte per group (ue8m0 or e4m3)", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0), "float16": (0.0, 0.0)},  # bytes: exact
    run=run, example=example,
)
