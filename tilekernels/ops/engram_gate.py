"""Engram gated write into the residual copies: per copy c, a normalized dot product of the stream with its
key, `dot = sum(h_c * q_c * k_c * key_c) * rsqrt(mean h_c^2 + eps) * rsqrt(mean key_c^2 + eps) / sqrt(D)`, a
signed square root (|dot| floored at 1e-6), a sigmoid gate, and `h_c += gate_c * value`. All math in fp32."""

import torch

from tilekernels.op import OpDecl

DOT_FLOOR = 1e-6


def reference(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
              k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, N, D], key [T, N, D], value [T, D], q_weight/k_weight [N, D] -> [T, N, D] in streams' dtype."""
    h, k = streams.float(), key.float()
    weight = q_weight.float() * k_weight.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(k.square().mean(-1) + eps)
    dot = (h * weight * k).sum(-1) * rstd * h.shape[-1] ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(DOT_FLOOR).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)


OP = OpDecl("engram_gate", "Engram gated residual update of the mHC copies", reference)
