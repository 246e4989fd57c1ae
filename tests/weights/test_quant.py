"""FP8 / FP4 dequantization against a small element-by-element reference on synthetic tensors."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import WeightsError
from deepinfer.weights.quant import dequantize

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def naive_fp4(packed: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    rows, half = packed.shape
    out = torch.zeros(rows, 2 * half)
    for r in range(rows):
        for c in range(2 * half):
            byte = int(packed[r, c // 2]) & 0xFF
            nibble = byte & 0xF if c % 2 == 0 else byte >> 4
            out[r, c] = E2M1[nibble] * 2.0 ** (int(exponents[r, c // 32]) - 127)
    return out


def naive_fp8(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = torch.zeros(values.shape)
    for r in range(values.shape[0]):
        for c in range(values.shape[1]):
            out[r, c] = float(values[r, c].float()) * float(scales[r // block[0], c // block[1]])
    return out


def test_fp4_e2m1_with_ue8m0_scales():
    packed = torch.randint(-128, 128, (6, 48), dtype=torch.int8)  # 6 x 96 values
    exponents = torch.randint(120, 135, (6, 3), dtype=torch.uint8)
    expected = naive_fp4(packed, exponents)
    raw = dequantize("w", packed, exponents, torch.float32)  # raw e8m0 bytes
    typed = dequantize("w", packed, exponents.view(torch.float8_e8m0fnu), torch.float32)
    assert torch.equal(raw, expected) and torch.equal(typed, expected)


def test_fp8_e4m3_with_block_scales_and_ragged_edges():
    values = (torch.randn(40, 72) * 4).to(torch.float8_e4m3fn)  # 40x72 with 16x32 blocks: a ragged grid
    scales = torch.rand(3, 3) + 0.5
    expected = naive_fp8(values, scales, (16, 32))
    assert torch.equal(dequantize("w", values, scales, torch.float32, (16, 32)), expected)
    e8 = torch.tensor([[126, 127, 128]] * 3, dtype=torch.uint8)
    expected_e8 = naive_fp8(values, (e8.float() - 127).exp2(), (16, 32))
    assert torch.equal(dequantize("w", values, e8.view(torch.float8_e8m0fnu), torch.float32, (16, 32)), expected_e8)


def test_stacked_experts_dequantize_per_expert():
    packed = torch.randint(-128, 128, (3, 4, 16), dtype=torch.int8)
    exponents = torch.randint(125, 130, (3, 4, 1), dtype=torch.uint8)
    out = dequantize("experts", packed, exponents, torch.bfloat16)
    for e in range(3):
        assert torch.equal(out[e], naive_fp4(packed[e], exponents[e]).to(torch.bfloat16))


def test_scale_grid_mismatch_names_the_tensor():
    with pytest.raises(WeightsError, match="layers.0.x.*block grid"):
        dequantize("layers.0.x", torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.uint8), torch.float32)
