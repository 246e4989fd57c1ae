"""Dequantization of DeepSeek-V4's quantized checkpoint tensors (on the CPU reference path every weight is
dequantized once at load time).

- Dense linears: FP8 e4m3 values with one scale per 128x128 block (the block comes from the config's
  `quantization_config.weight_block_size`).
- Routed experts: FP4 e2m1, two values per byte (low nibble first, K halved), with one scale per 1x32 block.
Scales are `weight_scale_inv` multipliers: fp32, ue8m0 (`float8_e8m0fnu`), or raw e8m0 exponent bytes (uint8).
"""

from __future__ import annotations

import torch

from deepinfer.errors import WeightsError

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_BLOCK = (128, 128)
FP4_BLOCK = (1, 32)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP4_DTYPES = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)


def is_quantized(weight: torch.Tensor) -> bool:
    return weight.dtype in _FP8_DTYPES or weight.dtype in _FP4_DTYPES


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:  # raw e8m0 exponents
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes holding two e2m1 values each (low nibble first) -> fp32 [..., K]."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    values = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize(
    name: str, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fp8_block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """Dequantize `weight` ([..., N, K] FP8, or [..., N, K/2] packed FP4) with its block scales.

    Leading dims (stacked experts) are dequantized one slice at a time to bound the fp32 scratch."""
    if weight.dtype in _FP8_DTYPES:
        block, cols = fp8_block, weight.shape[-1]
    elif weight.dtype in _FP4_DTYPES:
        block, cols = FP4_BLOCK, 2 * weight.shape[-1]
    else:
        raise WeightsError(f"tensor {name} has a scale but dtype {weight.dtype}; expected FP8 e4m3 or packed FP4")
    rows = weight.shape[-2]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape[-2:]) != grid or scale.shape[:-2] != weight.shape[:-2]:
        raise WeightsError(
            f"tensor {name}: scale shape {list(scale.shape)} does not match the {block[0]}x{block[1]} block grid "
            f"{list(weight.shape[:-2]) + list(grid)} of its {rows}x{cols} weight"
        )
    out = torch.empty(*weight.shape[:-2], rows, cols, dtype=dtype, device=weight.device)
    flat_w, flat_s, flat_o = weight.reshape(-1, *weight.shape[-2:]), scale.reshape(-1, *grid), out.view(-1, rows, cols)
    for i in range(flat_w.shape[0]):
        w = flat_w[i]
        values = w.to(torch.float32) if w.dtype in _FP8_DTYPES else unpack_fp4(w)
        s = scale_to_float(flat_s[i]).repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
        flat_o[i] = (values * s[:rows, :cols]).to(dtype)
    return out
