"""The FP8 path on the H200: act_quant and the block-scaled FP8 GEMM (sm90 override: FP8 wgmma) at V4-Flash
projection shapes, decode to prefill sizes, against their fp32 emulation and the model's reference. Run with
`pytest -m gpu` on the GPU host."""

from __future__ import annotations

import pytest
import torch

from codegen.driver import record_run
from tilekernels.ops import act_quant, grouped_linear, linear, linear_fp8

pytestmark = pytest.mark.gpu

# (name, n per group, k, groups): V4-Flash's FP8 projections (o_a_proj: 8 groups of 1024 from 4096)
SHAPES = [("q_a", 1024, 4096, 1), ("q_b", 32768, 1024, 1), ("kv", 512, 4096, 1), ("o_a", 1024, 4096, 8),
          ("o_b", 4096, 8192, 1), ("shared_gate_up", 4096, 4096, 1), ("shared_down", 4096, 2048, 1)]
TOKENS = (1, 64, 300, 1000, 4096)  # 300, 1000: the short-K body's ragged last tiles
FORMAT_TOKENS = (3, 512)  # the other scale formats' row counts
ACT_ROWS, ACT_WIDTHS = (33, 300), (4096, 1024, 8192)  # act_quant: portable body / row-tile override; V4's widths
GRAPH_TOKENS = 8  # the CUDA-graph replay's rows


def check(got, x, w, groups):
    """Against the emulation (the same quantized activations, fp32 math, not rounded): within the bf16 output's
    rounding (2^-8 relative; 2^-7 allowed) plus 1e-3 of the largest output for the fp32 accumulation order and
    the rare e4m3 code a GPU division rounds the other way. Against the reference (unquantized activations):
    within the activations' e4m3 rounding, per value at most 2^-4 of it (normal codes) or 2^-10 of its group's
    scale (subnormal codes), times |w|, plus the same bf16 term."""
    emu = linear_fp8.emulated(x, w, groups, torch.float32)
    ref = (grouped_linear if groups > 1 else linear).reference(x.float(), w).float()
    got = got.float()
    scale = emu.abs().max()
    tol = emu.abs() / 128 + 1e-3 * scale
    if not linear_fp8.weight_operands(w)[2]:  # fp32 scales: x / s is not exact, a few codes may round apart
        wmax = w.dequantize(torch.float32).abs().amax(-1)  # each flip moves an output by <= 2^-3 |x_k w_k|
        tol = tol + (x.float().abs().amax(-1, keepdim=True) * (wmax.view(groups, -1) if groups > 1 else wmax)) / 2
    assert ((got - emu).abs() <= tol).all(), (got - emu).abs().max().item()
    k = x.shape[-1]
    _, act_scales = act_quant.reference(x.reshape(-1, k), w.block[1], linear_fp8.weight_operands(w)[2])
    per_value = (x.float().abs() / 16 + (act_scales / 1024).repeat_interleave(w.block[1], 1)[:, :k].view(x.shape))
    wd = w.dequantize(torch.float32).abs()
    bound = (torch.einsum("mgk,gnk->mgn", per_value, wd.view(groups, -1, k)) if groups > 1 else per_value @ wd.T)
    assert ((got - ref).abs() <= bound + ref.abs() / 128 + 1e-3 * scale).all(), ((got - ref).abs() - bound).max().item()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name, n, k, groups", SHAPES, ids=[s[0] for s in SHAPES])
def test_fp8_projection_at_v4_flash_shapes(name, n, k, groups, tokens, sm90_ops, cuda, cache_dir):
    torch.manual_seed(tokens + n)
    v = linear_fp8.Variant(n, k, "bfloat16", (128, 128), groups, ue8m0=True)  # V4's ue8m0 block scales
    op = grouped_linear if groups > 1 else linear
    x, w = op.example(v, tokens, cuda)
    got = getattr(sm90_ops, op.OP.name)(x, w)
    check(got, x, w, groups)
    record_run(cache_dir, op.OP.name, "sm90", f"H200 FP8 {name} {tokens} tokens: matched emulation and reference")


@pytest.mark.parametrize("block, ue8m0", [((128, 128), False), ((32, 32), True)], ids=["fp32-scales", "v41-32x32"])
def test_fp8_other_scale_formats(block, ue8m0, sm90_ops, cuda):
    torch.manual_seed(3)
    for tokens in FORMAT_TOKENS:
        v = linear_fp8.Variant(2048, 1024, "bfloat16", block, ue8m0=ue8m0)
        x, w = linear.example(v, tokens, cuda)
        check(sm90_ops.linear(x, w), x, w, 1)


@pytest.mark.parametrize("rows", ACT_ROWS, ids=["decode-rows", "prefill-rows"])
def test_act_quant_bytes_equal_torch_at_v4_widths(rows, sm90_ops, cuda):
    torch.manual_seed(0)
    for k in ACT_WIDTHS:
        for pow2 in (True, False):
            args = act_quant.example(act_quant.Variant(k, 128, "bfloat16", pow2), rows, cuda)
            codes, scales = sm90_ops.act_quant(*args)
            want_codes, want_scales = act_quant.reference(*args)
            torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
            same = codes.view(torch.uint8) == want_codes.view(torch.uint8)
            if pow2:  # power-of-two scales divide exactly: every byte equal
                assert same.all()
            else:  # a GPU division may round the other way at a code boundary: one code step at most, rarely
                assert same.float().mean() > 0.999
                step = (codes.float() - want_codes.float()).abs() / want_codes.float().abs().clamp(min=2**-9)
                assert (step[~same] <= 0.126).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_act_quant_row_tiles_at_v41_groups_and_the_first_wide_row_count(dtype, sm90_ops, cuda):
    """The row-tile override at V4.1's groups of 32 (ue8m0) and 129 rows (one row past WIDE_ROWS: a last tile of one
    row): bytes and scales equal torch's."""
    torch.manual_seed(1)
    args = act_quant.example(act_quant.Variant(1024, 32, dtype, True), act_quant.WIDE_ROWS + 1, cuda)
    codes, scales = sm90_ops.act_quant(*args)
    want_codes, want_scales = act_quant.reference(*args)
    torch.testing.assert_close(scales, want_scales, rtol=0, atol=0)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def test_fp8_projection_replays_from_a_cuda_graph(sm90_ops, cuda):
    torch.manual_seed(5)
    v = linear_fp8.Variant(1024, 4096, "bfloat16", (128, 128), ue8m0=True)
    x, w = linear.example(v, GRAPH_TOKENS, cuda)
    sm90_ops.linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sm90_ops.linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check(out, x, w, 1)
