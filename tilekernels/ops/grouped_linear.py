"""Grouped (block-diagonal) output projection `o_a_proj`: each of g head groups is projected on its own."""

import torch

from tilekernels.op import OpDecl


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, g, Din], weight [g * Dout, Din] (group-major rows) -> [N, g, Dout]."""
    n, groups, din = x.shape
    w = weight.view(groups, -1, din).transpose(1, 2)  # [g, Din, Dout]
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


OP = OpDecl("grouped_linear", "block-diagonal per-group projection", reference)
