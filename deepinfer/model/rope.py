"""RoPE inverse frequencies for V4's two flavours: plain ('main') and YaRN-scaled ('compress').

Matches HF transformers' default and YaRN initialisers (the correction range is always truncated, as HF does).
"""

from __future__ import annotations

import math

import torch

from deepinfer.config import RopeConfig


def inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim / 2] fp32 inverse frequencies for a rotary slice of `dim` channels."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    if rope.rope_type == "default":
        return 1.0 / (rope.theta**exponents)
    pos_freqs = rope.theta**exponents
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    low, high = _correction_range(rope, dim)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low = math.floor(correction_dim(rope.beta_fast))
    high = math.ceil(correction_dim(rope.beta_slow))
    return max(low, 0), min(high, dim - 1)
