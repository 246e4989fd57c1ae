"""Engram table lookup: the rows a position's n-gram hashes name, gathered from an FP8 table with one ue8m0
scale per 32 columns (kept quantized: the real tables are 384M rows) and dequantized, concatenated per
position. A dequantized FP8 value times a power-of-two scale is exact in bf16, the dtype V4.1's reference
feeds the Engram projection with."""

import torch

from tilekernels.op import OpDecl
from tilekernels.quant import BlockQuantized, scale_to_float


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


OP = OpDecl("engram_lookup", "Engram FP8 table row gather and dequantization", reference)
