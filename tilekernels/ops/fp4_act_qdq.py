"""FP4 (e2m1) quantize-dequantize of activations along the last dim, as DeepSeek-V4.1 stores its compressed
state: the values come back in the input's dtype, rounded to what the FP4 storage holds.

Two scale formats, one scale per `group` values:
- `ue8m0` (V4.1's index queries and keys, groups of 32): s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), exact
  (frexp, not log2: a value just above a power of two must round up);
- `e4m3` (V4.1's compressed KV latents, groups of 16): s = e4m3(max(amax, 6 * 2^-9) / 6), round to nearest even.
The codes are e2m1(clamp(x / s, -6, 6)) rounded to nearest, ties to the even code; the result is code * s.
"""

import torch

from tilekernels.op import OpDecl
from tilekernels.quant import FP4_MAX, FP8_MAX

SCALE_FORMATS = ("ue8m0", "e4m3")
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 codes 0..7; even codes win ties


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] -> the nearest e2m1 value (ties to the even code), fp32."""
    mags = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=v.device)
    a = v.abs().unsqueeze(-1)
    mids = (mags[1:] + mags[:-1]) / 2
    tie_up = torch.arange(1, 8, device=v.device) % 2 == 0  # at a midpoint, round up only to an even code
    code = (a > mids).sum(-1) + ((a == mids) & tie_up).sum(-1)
    return torch.copysign(mags[code], v)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive fp32 x, exactly (from the binary exponent)."""
    mantissa, exponent = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), torch.where(mantissa == 0.5, exponent - 1, exponent))


def reference(x: torch.Tensor, group: int, scale_format: str) -> torch.Tensor:
    """x [..., K] with K a multiple of `group` -> x rounded through FP4 storage, in x's dtype."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale format {scale_format!r} is not one of {SCALE_FORMATS}")
    if x.shape[-1] % group:
        raise ValueError(f"the last dim {x.shape[-1]} is not a multiple of the FP4 group {group}")
    xg = x.float().unflatten(-1, (-1, group))
    amax = xg.abs().amax(-1, keepdim=True)
    if scale_format == "ue8m0":
        s = pow2_ceil(amax.clamp(min=FP4_MAX * 2.0**-126) * torch.tensor(1 / FP4_MAX, dtype=torch.float32))
    else:
        s = (amax.clamp(min=FP4_MAX * 2.0**-9) / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    return (e2m1_round((xg / s).clamp(-FP4_MAX, FP4_MAX)) * s).flatten(-2).to(x.dtype)


OP = OpDecl("fp4_act_qdq", "FP4 e2m1 quantize-dequantize per group (ue8m0 or e4m3 scales)", reference)
