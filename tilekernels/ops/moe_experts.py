"""Routed experts: for every (token, slot) run expert `indices[t, s]`'s clipped SwiGLU FFN and add it,
scaled by its routing weight (applied after the down projection), into the token's output."""

import torch

from tilekernels.op import OpDecl
from tilekernels.ops import swiglu


def reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x [N, H], weights/indices [N, k], gate_up [E, 2I, H], down [E, H, I] -> [N, H]."""
    out = torch.zeros_like(x)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // indices.shape[1]
    slot_weights = weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tok = tokens[start : start + count]
        h = swiglu.reference(torch.nn.functional.linear(x[tok], gate_up[expert]), limit)
        y = torch.nn.functional.linear(h, down[expert]) * slot_weights[start : start + count, None]
        out.index_add_(0, tok, y.to(out.dtype))
        start += count
    return out


OP = OpDecl("moe_experts", "grouped expert GEMMs (gate_up, clipped SwiGLU, down) with weighted combine", reference)
