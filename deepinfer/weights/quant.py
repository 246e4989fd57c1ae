"""DeepSeek-V4's quantized checkpoint tensors, checked and either kept in their own precision (`as_quantized`:
a `tilekernels.quant.BlockQuantized` the ops take) or dequantized once at load (`dequantize`).

- Dense linears: FP8 e4m3 values with one scale per 128x128 block (the block comes from the config's
  `quantization_config.weight_block_size`).
- Routed experts: FP4 e2m1, two values per byte (low nibble first, K halved), with one scale per 1x32 block.
Scales are `weight_scale_inv` multipliers: fp32, ue8m0 (`float8_e8m0fnu`), or raw e8m0 exponent bytes (uint8).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from deepinfer.errors import WeightsError
from tilekernels.quant import FP4_BLOCK, BlockQuantized, grid, is_exponent_bytes

FP8_BLOCK = (128, 128)
# Which canonical tensors a V4 checkpoint stores quantized (the rest: bf16, norms/mHC fp32)
# (the MTP layers' alike, and their input projections e_proj / h_proj; DSpark's main_proj)
FP8_WEIGHTS = re.compile(r"\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)\.weight$|"
                         r"\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$|"
                         r"^mtp\.\d+\.(e_proj|h_proj|main_proj)\.weight$")
EXPERTS = re.compile(r"^((?:layers|mtp)\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP4_DTYPES = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, getattr(torch, "float8_e8m0fnu", None))


def stored_form(weight: torch.Tensor) -> str | None:
    """"fp8" or "fp4" for a checkpoint tensor stored quantized (told by its dtype), None for a plain one."""
    return "fp8" if weight.dtype in _FP8_DTYPES else "fp4" if weight.dtype in _FP4_DTYPES else None


def is_quantized(weight: torch.Tensor) -> bool:
    return stored_form(weight) is not None


def as_quantized(name: str, weight: torch.Tensor, scale: torch.Tensor,
                 fp8_block: tuple[int, int] = FP8_BLOCK) -> BlockQuantized:
    """`weight` ([..., N, K] FP8, or [..., N, K/2] packed FP4) with its block scales, checked: a WeightsError names
    the tensor when its dtype is not a quantized one, the scale's dtype is not a scale's, or the scale grid does
    not match the weight."""
    if weight.dtype in _FP8_DTYPES:
        fmt, block, cols = "fp8", fp8_block, weight.shape[-1]
        values = weight.to(torch.float8_e4m3fn) if weight.dtype != torch.float8_e4m3fn else weight
    elif weight.dtype in _FP4_DTYPES:
        fmt, block, cols = "fp4", FP4_BLOCK, 2 * weight.shape[-1]
        values = weight.contiguous().view(torch.uint8)
    else:
        raise WeightsError(f"tensor {name} has a scale but dtype {weight.dtype}; expected FP8 e4m3 or packed FP4 "
                           f"(int8/uint8 bytes)")
    if scale.dtype not in _SCALE_DTYPES:
        raise WeightsError(f"the scale of tensor {name} has dtype {scale.dtype}; expected fp32, bf16, ue8m0 "
                           f"(float8_e8m0fnu) or e8m0 exponent bytes (uint8)")
    rows = weight.shape[-2]
    want = tuple(weight.shape[:-2]) + grid(rows, cols, block)
    if tuple(scale.shape) != want:
        raise WeightsError(
            f"tensor {name}: scale shape {list(scale.shape)} does not match the {block[0]}x{block[1]} block grid "
            f"{list(want)} of its {rows}x{cols} weight"
        )
    if scale.dtype in (torch.bfloat16, torch.float16):
        scale = scale.to(torch.float32)
    return BlockQuantized(values, scale, block, fmt)


def for_kernels(name: str, q: BlockQuantized) -> BlockQuantized:
    """A quantized tensor kept for the kernels: FP4 scales as the exponent bytes the FP4 kernels read (fp32 ones
    converted once, at load, not per call); those must be powers of two. (With `moe_fp4.REPACKED`, stacked FP4
    experts are then K-permuted as they reach a device whose kernels read that layout: `BlockQuantized.to`.)"""
    if q.format != "fp4" or is_exponent_bytes(q.scales):
        return q
    mantissa, _ = torch.frexp(q.scales)
    if not bool(((mantissa == 0.5) & (q.scales > 0)).all()):
        raise WeightsError(f"tensor {name}: FP4 scales must be powers of two (ue8m0), as DeepSeek's checkpoints "
                           f"store them; this one has others (load it with --quantization none to dequantize it)")
    return q.with_exponent_bytes()


def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               fp8_block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """Dequantize `weight` with its block scales (checked as `as_quantized` does). Leading dims (stacked experts)
    are dequantized one slice at a time to bound the fp32 scratch."""
    q = as_quantized(name, weight, scale, fp8_block)
    if q.values.dim() == 2:
        return q.dequantize(dtype)
    out = torch.empty(q.shape, dtype=dtype, device=weight.device)
    flat = out.view(-1, *q.shape[-2:])
    values = q.values.reshape(-1, *q.values.shape[-2:])
    scales = q.scales.reshape(-1, *q.scales.shape[-2:])
    for i in range(flat.shape[0]):
        flat[i] = BlockQuantized(values[i], scales[i], q.block, q.format).dequantize(dtype)
    return out


def checkpoint_format(name: str, quantization_config: Mapping[str, Any] | None) -> tuple[str, tuple[int, int], bool] | None:
    """(format, block, ue8m0 scales) of canonical tensor `name` in a checkpoint with this `quantization_config`
    (None: not quantized): FP8 dense projections with the config's `weight_block_size`, FP4 routed experts when
    `expert_dtype` is fp4 (FP8 with the dense block otherwise). What the compile plan traces without the files."""
    if not quantization_config:
        return None
    block = tuple(quantization_config.get("weight_block_size") or FP8_BLOCK)
    ue8m0 = quantization_config.get("scale_fmt") == "ue8m0"
    if FP8_WEIGHTS.search(name):
        return "fp8", block, ue8m0
    if EXPERTS.match(name):
        fp4 = quantization_config.get("expert_dtype", "fp4") == "fp4"
        return ("fp4", FP4_BLOCK, True) if fp4 else ("fp8", block, ue8m0)
    return None
