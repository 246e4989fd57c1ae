"""The routed experts' decode bookkeeping kernels (tilekernels/ops/moe_decode.py) on the CPU `c` target: `moe_route`
gives exactly `moe_experts.layout`'s rows and tiles, `moe_combine` the fp32 slot-order weighted sum, and the op
launches them where it should."""

import pytest
import torch

from tilekernels.kernels import Recorder, kernel_launcher
from tilekernels.ops import moe_decode, moe_experts


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    return kernel_launcher("c", tmp_path_factory.mktemp("moe-decode")).for_op("moe_experts")


@pytest.mark.parametrize("tokens, top_k, experts, bm", [(1, 6, 256, 16), (8, 6, 256, 16), (64, 6, 256, 16),
                                                        (33, 2, 5, 16), (64, 3, 4, 64), (1, 1, 2, 16)])
def test_route_equals_the_layout(tokens, top_k, experts, bm, launch):
    torch.manual_seed(tokens + experts)
    for skew in (False, True):
        scores = torch.rand(tokens, experts)
        if skew:  # everyone routes to the same few experts: experts get several tiles
            scores[:, :top_k] += 1
        idx = scores.topk(top_k, dim=-1).indices
        want_dest, want_tiles = moe_experts.layout(idx, experts, bm)
        dest, tiles = moe_decode.route(launch, idx, experts, bm, moe_experts.DECODE_TOKENS * top_k)
        assert dest.dtype == torch.int64 and tiles.dtype == torch.int32
        assert torch.equal(dest, want_dest) and torch.equal(tiles, want_tiles.to(torch.int32))


@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 6, 96), (5, 2, 700), (3, 1, 64)])
def test_combine_is_the_weighted_slot_sum(tokens, top_k, hidden, launch):
    torch.manual_seed(tokens)
    y = torch.randn(tokens * top_k + 7, hidden)
    dest = torch.randperm(y.shape[0])[: tokens * top_k]
    w = torch.rand(tokens, top_k)
    want = (y[dest].view(tokens, top_k, hidden) * w[..., None]).sum(1)
    torch.testing.assert_close(moe_decode.combine(launch, y, dest, w, "float32"), want, atol=1e-5, rtol=1e-5)


def test_the_op_routes_by_kernel_up_to_the_decode_tokens():
    def kernels(tokens):
        rec = Recorder()
        moe_experts.run(rec.for_op("moe_experts"), *moe_experts.example(moe_experts.Variant(64, 32, 16, "float32"),
                                                                        tokens, "meta"))
        return {kernel for _, kernel, _ in rec.seen}

    assert {"moe_route", "moe_combine"} <= kernels(moe_experts.DECODE_TOKENS)
    assert "moe_route" not in kernels(moe_experts.DECODE_TOKENS + 1)
    assert "moe_combine" in kernels(moe_experts.DECODE_TOKENS + 1)


def test_no_rows_launch_nothing():
    rec = Recorder()
    args = moe_experts.example(moe_experts.Variant(64, 32, 16, "float32"), 0, "cpu")
    out = moe_experts.run(rec.for_op("moe_experts"), *args)
    assert out.shape == (0, 32) and not rec.seen
