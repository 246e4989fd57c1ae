"""The FP4 expert op on the K-permuted layout (`moe_fp4.REPACKED` switched on within each test) on the H200 at
V4-Flash widths, decode and prefill token counts, both decoders, against the reference on the same (plain)
weights; the load-time repack of `BlockQuantized.to`; a CUDA-graph replay. Run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

import backends
from tilekernels.ops import DECLARED, moe_experts, moe_fp4
from tilekernels.quant import BlockQuantized

pytestmark = pytest.mark.gpu

FLASH = moe_experts.Variant(4096, 4096, 256, "bfloat16", fp4=True)  # hidden 4096, intermediate 2048, 256 experts


@pytest.fixture
def repacked(monkeypatch):
    monkeypatch.setattr(moe_fp4, "REPACKED", True)  # undone after the test


def close(got, want):
    atol, rtol = DECLARED["moe_experts"].tolerance["bfloat16"]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def raise_one_exponent(w: BlockQuantized) -> BlockQuantized:
    """`w` with one block of expert 0 scaled by 2^8 past 2 (exponent byte > 128): the exact "kperm" decoder."""
    scales = w.scales.clone()
    scales[0, 0, 0] = 131
    return BlockQuantized(w.values, scales, w.block, w.format)


@pytest.mark.parametrize("decode", ["kperm1", "kperm"])
@pytest.mark.parametrize("tokens", [1, 8, 64, 65, 700, 4096])  # 16-row tiles up to DECODE_TOKENS, 64-row above
def test_fp4_experts_on_the_repacked_layout_at_v4_flash_widths(repacked, cuda, sm90_ops, tokens, decode):
    torch.manual_seed(0)
    x, weights, indices, gate_up, down, limit = moe_experts.example(FLASH, tokens, cuda)
    if decode == "kperm":
        gate_up, down = raise_one_exponent(gate_up), raise_one_exponent(down)
        indices[0, 0] = 0  # a row through the raised blocks
    sm90 = backends.get("sm90")
    up_r, down_r = moe_experts.kernel_layout(gate_up, sm90), moe_experts.kernel_layout(down, sm90)
    assert up_r.layout == down_r.layout == decode
    got = sm90_ops.moe_experts(x, weights, indices, up_r, down_r, limit)
    close(got, moe_experts.reference(x, weights, indices, gate_up, down, limit))
    assert torch.equal(up_r.plain().values, gate_up.values) and torch.equal(down_r.plain().scales, down.scales)


def test_the_load_time_repack_follows_the_switch_and_moving_alone_never_repacks(monkeypatch, cuda):
    torch.manual_seed(0)
    v = moe_experts.Variant(1024, 512, 8, "bfloat16", fp4=True)
    _, _, _, gate_up, _, _ = moe_experts.example(v, 4, torch.device("cpu"))
    sm90, moved = backends.get("sm90"), gate_up.to(cuda)
    assert moved.layout == "plain"
    monkeypatch.setattr(moe_fp4, "REPACKED", False)
    assert moe_experts.kernel_layout(moved, sm90) is moved
    monkeypatch.setattr(moe_fp4, "REPACKED", True)
    repacked = moe_experts.kernel_layout(moved, sm90)
    assert repacked.layout == "kperm1" and repacked.device.type == cuda.type
    assert torch.equal(repacked.plain().values.cpu(), gate_up.values)


def test_the_repacked_op_replays_from_a_cuda_graph(repacked, cuda, sm90_ops):
    torch.manual_seed(0)
    x, weights, indices, gate_up, down, limit = moe_experts.example(FLASH, 8, cuda)
    sm90 = backends.get("sm90")
    up_r, down_r = moe_experts.kernel_layout(gate_up, sm90), moe_experts.kernel_layout(down, sm90)
    sm90_ops.moe_experts(x, weights, indices, up_r, down_r, limit)  # loads the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sm90_ops.moe_experts(x, weights, indices, up_r, down_r, limit)
    x.copy_(torch.randn_like(x.float()).to(x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    close(out, moe_experts.reference(x, weights, indices, gate_up, down, limit))
