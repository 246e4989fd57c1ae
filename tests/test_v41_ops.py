"""The ops V4.1 added to the op library, each against an independent formulation: the FP4 rounding against
the fixture harness's own stand-in for DeepSeek's kernel (tools/v41_reference/cpu_kernels.py, project code
written from the kernel's call sites and checked by its own tests), candidate blocks and the top-k tie rule
on cases worked by hand, the mHC split (V4's hc_pre = hc_mixes + hc_collapse), the Engram gate and lookup."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tilekernels.ops import (candidate_blocks, engram_gate, engram_lookup, fp4_act_qdq, hc_collapse, hc_mixes, hc_pre,
                             indexer_topk)
from tilekernels.quant import quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "v41_reference"))
import cpu_kernels  # noqa: E402  (the harness's stand-in for kernel.py)

INF = float("inf")


@pytest.mark.parametrize("group,fmt,scale_dtype",
                         [(32, "ue8m0", torch.float8_e8m0fnu), (16, "e4m3", torch.float8_e4m3fn)])
def test_fp4_rounding_equals_the_kernel_stand_in(group, fmt, scale_dtype):
    x = torch.randn(64, 128) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x[0, :group] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (group // 8))  # e2m1 ties, amax 6
    x[1] = 0.0  # an all-zero group: the amax floor
    x[2, :group] = 2.0**-130  # below the ue8m0 floor
    want = cpu_kernels.fp4_act_quant(x.clone(), group, True, scale_dtype=scale_dtype)
    got = fp4_act_qdq.reference(x, group, fmt)
    assert torch.equal(got, want)
    assert torch.equal(got[0, :8], torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]))  # ties to even codes
    assert (got != x).float().mean() > 0.5  # it does round


def test_fp4_rounding_rejects_a_ragged_group_or_unknown_format():
    with pytest.raises(ValueError, match="multiple of the FP4 group 16"):
        fp4_act_qdq.reference(torch.zeros(2, 24), 16, "e4m3")
    with pytest.raises(ValueError, match="'fp8' is not one of"):
        fp4_act_qdq.reference(torch.zeros(2, 32), 32, "fp8")


def test_candidate_blocks_keep_the_best_blocks_and_the_newest():
    # 10 positions in blocks of 4 (the last one padded); query 0 sees 9, query 1 sees 4, query 2 sees none
    s = torch.tensor([[5.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.0, -INF],
                      [0.1, 0.2, 9.0, 0.3, -INF, -INF, -INF, -INF, -INF, -INF],
                      [-INF] * 10])
    keep = candidate_blocks.reference(s, torch.tensor([9, 4, 0]), 2, 4)
    # query 0: block 0 (best 5.0) and block 2 (the newest, position 8, forced); not block 1 (0.7)
    assert keep[0].tolist() == [True] * 4 + [False] * 4 + [True] * 2
    # query 1: only block 0 is reachable; the second pick is -inf and dropped
    assert keep[1].tolist() == [True] * 4 + [False] * 6
    assert not keep[2].any()


def test_indexer_topk_breaks_ties_toward_the_lower_entry_whatever_lies_past_the_visible_ones():
    scores = torch.tensor([[0.0, 3.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    for width in (6, 7, 8):  # more entries past what the query sees (a longer prefill chunk) change nothing
        picks = indexer_topk.reference(scores[:, :width], torch.tensor([6]), 4)
        assert sorted(picks[0].tolist()) == [0, 1, 2, 4]
    assert indexer_topk.reference(scores, torch.tensor([2]), 4)[0].tolist() == [1, 0, -1, -1]


def test_hc_pre_is_the_mixes_then_the_collapse():
    streams = torch.randn(5, 4, 32)
    fn, base, scale = 0.1 * torch.randn(24, 128), torch.randn(24), 1 + torch.rand(3)
    pre, post, comb = hc_mixes.reference(streams, fn, base, scale, 20, 1e-6, 1e-20)
    want_post, want_comb, want_x = hc_pre.reference(streams, fn, base, scale, 20, 1e-6, 1e-20)
    assert torch.equal(post, want_post) and torch.equal(comb, want_comb)
    assert torch.equal(hc_collapse.reference(streams, pre), want_x)
    assert torch.allclose(comb.sum(-2), torch.ones(5, 4), atol=1e-5)  # Sinkhorn: columns sum to 1
    # a one-hot pre collapses to that copy (V4.1's first layer)
    one_hot = torch.zeros(5, 4)
    one_hot[:, 2] = 1
    assert torch.equal(hc_collapse.reference(streams, one_hot), streams[:, 2])


def test_engram_gate_is_a_signed_sqrt_sigmoid_of_the_normalized_dot():
    t, n, d = 3, 2, 8
    h, key, value = torch.randn(t, n, d), torch.randn(t, n, d), torch.randn(t, d)
    qw, kw = 1 + 0.1 * torch.randn(n, d), 1 + 0.1 * torch.randn(n, d)
    out = engram_gate.reference(h, key, value, qw, kw, 1e-20)
    for i in range(t):
        for c in range(n):
            hn = h[i, c] / h[i, c].pow(2).mean().sqrt()
            kn = key[i, c] / key[i, c].pow(2).mean().sqrt()
            dot = float((hn * qw[c] * kw[c] * kn).sum()) / d**0.5
            gate = torch.sigmoid(torch.tensor(dot).abs().sqrt() * (1 if dot >= 0 else -1))
            assert torch.allclose(out[i, c], h[i, c] + gate * value[i], atol=1e-5)
    # a zero dot gates at sigmoid(+-1e-3), not sigmoid(0) +- nothing: the floor under the square root
    zero = engram_gate.reference(torch.ones(1, 1, d), torch.zeros(1, 1, d), torch.ones(1, d), torch.ones(1, d),
                                 torch.ones(1, d), 1e-20)
    assert torch.allclose(zero - 1, torch.full((1, 1, d), float(torch.sigmoid(torch.tensor(1e-3)))))


def test_engram_lookup_dequantizes_the_rows_it_reads():
    table = torch.randn(50, 64)
    q = quantize(table, "fp8", (1, 32))
    rows = torch.tensor([[3, 49, 0], [7, 7, 1]])
    got = engram_lookup.reference(rows, q, torch.bfloat16)
    want = q.dequantize(torch.float32)[rows].flatten(1)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3 * 64)
    assert torch.equal(got.float(), want)  # FP8 x power-of-two scale is exact in bf16
    with pytest.raises(ValueError, match="1 x b scale blocks"):
        engram_lookup.reference(rows, quantize(table, "fp8", (32, 32)), torch.float32)
