"""The V4 clipped SwiGLU: silu(min(gate, L)) * clamp(up, -L, L) over a fused [gate | up] input."""

import torch

from tilekernels.op import OpDecl


def reference(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] (gate = first I, up = second I) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


OP = OpDecl("swiglu", "clipped SwiGLU activation", reference)
