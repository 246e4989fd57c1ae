"""Rows of FP4-packed storage (`fp4_pack`'s codes and scale bytes) gathered by index and dequantized: how
DeepSeek-V4.1 reads its cached compressed latents and index keys (paged: `rows` are the storage rows of the
entries wanted, found through a block table).

The kernel: one tile per `values // K` output rows (at least one), each row's code bytes and scale bytes copied
into staging by its storage row id (int64: caches can pass 2^31 bytes), the scales decoded once per group (ue8m0:
2^(b - 127) built from its exponent bits; e4m3: `fp8.decode`), then every value decoded from its nibble (bit 3
the sign, magnitude m * 0.5 below code 4, else 2, 3, 4, 6) times its scale, in integer and fp32 arithmetic (one
body for every target, the CPU `c` target included). e2m1 * scale has at most 2 + 4 significant bits, so it is
exact in fp32 and in bf16: the kernel matches the reference bit for bit (zero tolerance).
"""

from dataclasses import dataclass

import torch

from tilekernels import dtypes, fp8
from tilekernels.op import Kernel, OpDecl, require
from tilekernels.ops.fp4_act_qdq import GROUPS, SCALE_FORMATS
from tilekernels.quant import unpack_fp4


def reference(codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, scale_format: str,
              dtype: torch.dtype) -> torch.Tensor:
    """codes uint8 [N, K / 2], scales uint8 [N, K / group], rows int64 [...] (each in [0, N)) -> [..., K] in
    `dtype`: value = e2m1 code * scale."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale format {scale_format!r} is not one of {SCALE_FORMATS}")
    c, s = codes[rows.flatten()], scales[rows.flatten()]
    if scale_format == "ue8m0":
        sv = (s.float() - 127.0).exp2()
    else:
        sv = s.view(torch.float8_e4m3fn).float()
    groups = s.shape[-1]
    v = unpack_fp4(c).unflatten(-1, (groups, -1)) * sv.unsqueeze(-1)
    return v.flatten(-2).to(dtype).view(*rows.shape, 2 * codes.shape[-1])


@dataclass(frozen=True)
class Variant:
    k: int  # values per row (2 per code byte)
    group: int  # values per scale
    scale_format: str  # "ue8m0" or "e4m3"
    dtype: str  # the output's dtype


@dataclass(frozen=True)
class Config:
    values: int = 512  # values per tile: rows per tile = max(1, values // K)
    threads: int = 128


def body(P, v: Variant, cfg: Config):
    T = P.T
    K, G, dtype = v.k, v.group, v.dtype
    KH, KS = K // 2, K // G  # code bytes, scale bytes per row
    RT = max(1, cfg.values // K)  # output rows per tile
    N = T.dynamic("N")  # storage rows
    M = T.dynamic("M")  # gathered rows
    NT = (M + RT - 1) // RT

    def scale_value(byte):
        b = T.cast(byte, "int32")
        if v.scale_format == "ue8m0":  # 2^(b - 127): byte 0 is the subnormal 2^-127, byte 255 +inf (as exp2 gives)
            return fp8.pow2(T, T.max(b - 127, -126)) * T.if_then_else(b == 0, 0.5, 1.0)
        return fp8.decode(T, b)

    def magnitude(m):  # e2m1 magnitude of code bits 0-2: 0, 0.5, 1, 1.5, then 2, 3, 4, 6
        return T.if_then_else(m < 4, T.cast(m, "float32") * 0.5, T.if_then_else(m == 7, 6.0, T.cast(m - 2, "float32")))

    def value(c_io, s_io, i, j):
        code = T.bitwise_and(T.shift_right(T.cast(c_io[i, j // 2], "int32"), (j % 2) * 4), 15)  # low nibble: even j
        sign = T.if_then_else(T.bitwise_and(code, 8) != 0, -1.0, 1.0)  # x -1: exact, and -0 for code 8
        return magnitude(T.bitwise_and(code, 7)) * s_io[i, j // G] * sign

    @T.prim_func
    def kernel(Codes: T.Tensor((N, KH), "uint8"), Scales: T.Tensor((N, KS), "uint8"), Rows: T.Tensor((M,), "int64"),
               Out: T.Tensor((M, K), dtype)):
        with P.kernel(NT, cfg.threads) as pid:
            c_io = P.alloc_io((RT, KH), "uint8")
            b_io = P.alloc_io((RT, KS), "uint8")
            s_io = P.alloc_io((RT, KS), "float32")
            o_io = P.alloc_io((RT, K), dtype)
            for t in P.tiles(NT, pid):
                for i in range(RT):  # a row past M (the last tile) reloads row M - 1; it is not stored
                    T.copy(Codes[Rows[T.min(t * RT + i, M - 1)], 0:KH], c_io[i, 0:KH])
                    T.copy(Scales[Rows[T.min(t * RT + i, M - 1)], 0:KS], b_io[i, 0:KS])
                with P.vector(cfg.threads):
                    for i, g in T.Parallel(RT, KS):
                        s_io[i, g] = scale_value(b_io[i, g])
                with P.vector(cfg.threads):
                    for i, j in T.Parallel(RT, K):
                        o_io[i, j] = T.cast(value(c_io, s_io, i, j), dtype)
                if RT == 1:
                    T.copy(o_io[0, 0:K], Out[t, 0:K])
                else:
                    with P.vector(cfg.threads):
                        for i, j in T.Parallel(RT, K):
                            if t * RT + i < M:
                                Out[t * RT + i, j] = o_io[i, j]

    return kernel


KERNEL = Kernel("fp4_gather", body, configs={"default": Config(), "c": Config(values=128, threads=1)})


def variant(codes: torch.Tensor, scales: torch.Tensor, scale_format: str, dtype: torch.dtype) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    k = 2 * codes.shape[-1]
    return Variant(k, k // max(1, scales.shape[-1]), scale_format, dtypes.name(dtype))


def run(launch, codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, scale_format: str,
        dtype: torch.dtype) -> torch.Tensor:
    op = "fp4_gather"
    require(scale_format in SCALE_FORMATS, op, f"scale format {scale_format!r} is not one of {SCALE_FORMATS}")
    require(codes.dtype == torch.uint8 and scales.dtype == torch.uint8, op,
            f"codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    require(codes.dim() == 2 and scales.dim() == 2 and codes.shape[0] == scales.shape[0], op,
            f"codes and scales must be [N, K / 2] and [N, K / group], got {list(codes.shape)} and {list(scales.shape)}")
    require(scales.shape[1] > 0 and codes.shape[1] % scales.shape[1] == 0, op,
            f"the code bytes per row {codes.shape[1]} (K / 2) must be a multiple of the scales per row "
            f"{scales.shape[1]}: K a multiple of the group, group / 2 bytes per scale")
    require(rows.dtype in (torch.int64, torch.int32), op, f"rows must be int64 (or int32), got {rows.dtype}")
    require(dtype in dtypes.NAMES, op, f"dtype must be one of {', '.join(dtypes.NAMES.values())}, got {dtype}")
    v = variant(codes, scales, scale_format, dtype)
    require(v.group in GROUPS, op, f"group (K / scales per row = {v.k} / {scales.shape[1]}) must be one of {GROUPS}")
    flat = rows.reshape(-1).long().contiguous()
    out = torch.empty(flat.shape[0], v.k, dtype=dtype, device=codes.device)
    if flat.shape[0]:
        launch("fp4_gather", v)(codes.contiguous(), scales.contiguous(), flat, out)
    return out.view(*rows.shape, v.k)


def example(v: Variant, rows: int, device) -> tuple:
    """`rows` gathers (repeated and out of order) from a store of 2 * rows + 3 rows of random code bytes (every
    nibble) and scale bytes (e4m3: every finite byte, negative ones too; ue8m0: 2^-40 .. 2^40), out in v.dtype."""
    n = 2 * rows + 3
    codes = torch.randint(0, 256, (n, v.k // 2), dtype=torch.uint8, device=device)
    if v.scale_format == "e4m3":
        scales = torch.randint(0, 127, (n, v.k // v.group), dtype=torch.uint8, device=device)
        scales |= (torch.rand(scales.shape, device=device) < 0.25).to(torch.uint8) << 7  # finite: never 0x7F, 0xFF
    else:
        scales = torch.randint(127 - 40, 127 + 41, (n, v.k // v.group), dtype=torch.uint8, device=device)
    ids = torch.randperm(n, device=device)[:rows]
    ids[rows // 2 :: 3] = ids[0]  # repeats
    return (codes, scales, ids, v.scale_format, dtypes.torch_dtype(v.dtype))


OP = OpDecl(
    "fp4_gather", "gather FP4-packed rows by index and dequantize them", reference,
    kernels=(KERNEL,),
    # exact products (fp16: the same fp32 -> fp16 rounding as the reference), see the module docstring
    tolerance={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0), "float16": (0.0, 0.0)},
    run=run, example=example,
)
