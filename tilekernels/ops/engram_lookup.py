"""Engram table lookup: the rows a position's n-gram hashes name, gathered from an FP8 table with one ue8m0
scale per 32 columns (kept quantized: the real tables are 384M rows) and dequantized, concatenated per
position. A dequantized FP8 value times a power-of-two scale is exact in bf16, the dtype V4.1's reference
feeds the Engram projection with.

Not much of a kernel: a row gather (what `torch.nn.functional.embedding` does) plus the dequantization. It has
one anyway, so the lookup is one launch on every target and never materializes fp32 rows: one tile per
gathered row, its FP8 bytes decoded with `fp8.decode` (exact), times its scale, stored in fp32 and cast to the
asked dtype by torch (the same round-to-nearest-even; the c target has no bf16 at all, and the cast costs
little next to the Engram projection it feeds). Plain (unquantized) tables, as small test checkpoints have, take
the same kernel without the scales."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes, fp8
from tilekernels.op import Kernel, OpDecl, require
from tilekernels.quant import BlockQuantized, is_exponent_bytes, scale_to_float


def reference(rows: torch.Tensor, table: BlockQuantized | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [T, C] int64 (row ids), table [R, d] (block-quantized with 1 x b blocks, or plain) -> [T, C * d]."""
    t, c = rows.shape
    flat = rows.reshape(-1)
    if isinstance(table, BlockQuantized):
        if table.format != "fp8" or table.block[0] != 1:
            raise ValueError(f"an Engram table is FP8 with 1 x b scale blocks, got {table.format} "
                             f"{table.block[0]}x{table.block[1]}")
        values = table.values[flat].float().unflatten(-1, (-1, table.block[1]))
        values = (values * scale_to_float(table.scales[flat]).unsqueeze(-1)).flatten(-2)
    else:
        values = table[flat].float()
    return values.to(dtype).view(t, c * values.shape[-1])


@dataclass(frozen=True)
class Variant:
    dim: int  # d: columns of a table row
    block: int  # columns per scale (0: no scales)
    scales: str  # "ue8m0" (exponent bytes), "fp32", or "none" (a plain table)
    table: str  # "fp8" (e4m3 bytes) or the plain table's dtype


@dataclass(frozen=True)
class Config:
    threads: int = 128


def body(P, v: Variant, cfg: Config):
    T = P.T
    D, B = v.dim, v.block
    NS = D // B if B else 1
    fp8_table = v.table == "fp8"
    vdtype = "uint8" if fp8_table else v.table
    sdtype = "uint8" if v.scales == "ue8m0" else "float32"
    R = T.dynamic("R")  # gathered rows
    NR = T.dynamic("NR")  # table rows (384M: offsets are int64, from the int64 row ids)

    def value(v_io, s_io, j):
        x = fp8.decode(T, v_io[j]) if fp8_table else T.cast(v_io[j], "float32")
        if v.scales == "ue8m0":
            return x * fp8.pow2(T, T.cast(s_io[j // B], "int32") - 127)
        if v.scales == "fp32":
            return x * s_io[j // B]
        return x

    @T.prim_func
    def kernel(Rows: T.Tensor((R,), "int64"), V: T.Tensor((NR, D), vdtype), S: T.Tensor((NR, NS), sdtype),
               Out: T.Tensor((R, D), "float32")):
        with P.kernel(R, cfg.threads) as pid:
            v_io = P.alloc_io((D,), vdtype)
            s_io = P.alloc_io((NS,), sdtype)
            for r in P.tiles(R, pid):
                T.copy(V[Rows[r], 0:D], v_io)
                if v.scales != "none":
                    T.copy(S[Rows[r], 0:NS], s_io)
                with P.vector(cfg.threads):
                    for j in T.Parallel(D):
                        Out[r, j] = value(v_io, s_io, j)

    return kernel


KERNEL = Kernel("engram_lookup", body, configs={"default": Config(), "c": Config(threads=1)})


def variant(table: BlockQuantized | torch.Tensor) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    if isinstance(table, BlockQuantized):
        scales = "ue8m0" if is_exponent_bytes(table.scales) else "fp32"
        return Variant(table.shape[-1], table.block[1], scales, "fp8")
    return Variant(table.shape[-1], 0, "none", dtypes.name(table.dtype))


def run(launch, rows: torch.Tensor, table: BlockQuantized | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    require(rows.dim() == 2, "engram_lookup", f"rows must be [T, C], got {list(rows.shape)}")
    require(table.dim() == 2, "engram_lookup", f"the table must be [R, d], got {list(table.shape)}")
    t, c = rows.shape
    v = variant(table)
    if isinstance(table, BlockQuantized):
        require(table.format == "fp8" and table.block[0] == 1, "engram_lookup",
                f"an Engram table is FP8 with 1 x b scale blocks, got {table.format} {table.block[0]}x{table.block[1]}")
        require(v.dim % v.block == 0, "engram_lookup", f"the row width {v.dim} must be a multiple of the scale block "
                f"{v.block}")
        values = table.values.view(torch.uint8)
        scales = table.scales.view(torch.uint8) if v.scales == "ue8m0" else table.scales.float()
    else:
        values, scales = table.contiguous(), torch.empty(table.shape[0], 1, dtype=torch.float32, device=table.device)
    out = torch.empty(t * c, v.dim, dtype=torch.float32, device=table.device)
    if t * c:
        launch("engram_lookup", v)(rows.reshape(-1).long().contiguous(), values.contiguous(), scales.contiguous(), out)
    return out.to(dtype).view(t, c * v.dim)


def example(v: Variant, rows: int, device) -> tuple:
    """Three row ids per position (repeats included) into a table of 64 rows, FP8 values of every magnitude;
    bf16 out of an FP8 table (as V4.1 asks), the table's dtype out of a plain one."""
    from tilekernels.quant import quantize

    ids = torch.randint(0, 64, (rows, 3), device=device)
    ids[0] = ids[0, 0]
    if v.scales == "none":
        dtype = dtypes.torch_dtype(v.table)
        return (ids, torch.randn(64, v.dim, device=device).to(dtype), dtype)
    table = quantize(torch.randn(64, v.dim, device=device) * torch.logspace(-3, 3, 64, device=device)[:, None], "fp8",
                     (1, v.block), pow2_scales=v.scales == "ue8m0")
    if v.scales == "ue8m0":
        table = table.with_exponent_bytes()
    return (ids, table, torch.bfloat16)


OP = OpDecl(
    "engram_lookup", "Engram FP8 table row gather and dequantization", reference,
    kernels=(KERNEL,),
    # ue8m0: e4m3 times a power of two is exact in fp32 and bf16; fp32 scales: one fp32 product, then the cast
    tolerance={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0)},
    run=run, example=example,
)
