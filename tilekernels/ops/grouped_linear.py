"""Grouped (block-diagonal) output projection `o_a_proj`: each of g head groups is projected on its own
(the linear kernel with `groups` = g)."""

import torch

from tilekernels.op import OpDecl, require
from tilekernels.ops import linear


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, g, Din], weight [g * Dout, Din] (group-major rows) -> [N, g, Dout]."""
    n, groups, din = x.shape
    w = weight.view(groups, -1, din).transpose(1, 2)  # [g, Din, Dout]
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def run(launch, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    n, groups, din = x.shape
    require(weight.shape[1] == din and weight.shape[0] % groups == 0, "grouped_linear",
            f"weight must be [g * Dout, {din}] with g={groups}, got {list(weight.shape)}")
    dout = weight.shape[0] // groups
    y = linear.launch_gemm(launch.op("linear"), x.reshape(n, groups * din).contiguous(), weight.contiguous(),
                           dout, din, groups)
    return y.view(n, groups, dout)


OP = OpDecl("grouped_linear", "block-diagonal per-group projection", reference,
            tolerance=linear.OP.tolerance, run=run, uses=("linear",))
