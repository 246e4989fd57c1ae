"""Grouped (block-diagonal) output projection `o_a_proj`: each of g head groups is projected on its own
(the linear kernel with `groups` = g, on 3-D views so that a ragged tile edge stays inside its group)."""

import torch

from tilekernels import dtypes
from tilekernels.op import OpDecl, require
from tilekernels.ops import linear, linear_fp8
from tilekernels.quant import BlockQuantized, dense


def reference(x: torch.Tensor, weight: torch.Tensor | BlockQuantized) -> torch.Tensor:
    """x [N, g, Din], weight [g * Dout, Din] (group-major rows; block-quantized: dequantized) -> [N, g, Dout]."""
    n, groups, din = x.shape
    w = dense(weight, x.dtype).view(groups, -1, din).transpose(1, 2)  # [g, Din, Dout]
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def run(launch, x: torch.Tensor, weight: torch.Tensor | BlockQuantized) -> torch.Tensor:
    n, groups, din = x.shape
    if isinstance(weight, BlockQuantized):  # FP8 checkpoint weight: the W8A8 GEMM with a group grid axis
        require(weight.shape[1] == din and weight.shape[0] % groups == 0, "grouped_linear",
                f"weight must be [g * Dout, {din}] with g={groups}, got {list(weight.shape)}")
        if groups == 1:
            return linear_fp8.gemm(launch.op("linear"), x.reshape(n, din), weight).view(n, 1, -1)
        return linear_fp8.gemm(launch.op("linear"), x.contiguous(), weight, groups)
    require(weight.shape[1] == din and weight.shape[0] % groups == 0, "grouped_linear",
            f"weight must be [g * Dout, {din}] with g={groups}, got {list(weight.shape)}")
    require(x.dtype == weight.dtype, "grouped_linear", f"x is {x.dtype} but weight is {weight.dtype}")
    dout = weight.shape[0] // groups
    v = linear.variant(n, dout, din, groups, dtypes.name(x.dtype), getattr(launch, "invariant", False))
    if groups == 1:  # the plain 2-D kernel
        return linear.gemm(launch.op("linear"), x.reshape(n, din).contiguous(), weight.contiguous(), v).view(n, 1, dout)
    return linear.gemm(launch.op("linear"), x.contiguous(), weight.contiguous().view(groups, dout, din), v)


def example(v: linear.Variant | linear_fp8.Variant, rows: int, device) -> tuple:
    """Reference args for a grouped `linear` variant: x [rows, g, k], weight [g * n, k] (FP8 for an FP8 variant)."""
    dtype = dtypes.torch_dtype(v.dtype)
    x = torch.randn(rows, v.groups, v.k, device=device).to(dtype)
    if isinstance(v, linear_fp8.Variant):
        return (x, linear_fp8.example_weight(v, v.groups * v.n, device))
    return (x, (torch.randn(v.groups * v.n, v.k, device=device) / v.k**0.5).to(dtype))


OP = OpDecl("grouped_linear", "block-diagonal per-group projection", reference,
            tolerance=linear.OP.tolerance, run=run, example=example, uses=("linear", "act_quant"),
            row_samples=linear.OP.row_samples)
