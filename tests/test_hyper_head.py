"""The HyperHead laid out as a pre-block (`deepinfer.model.hyper_head`): `hc_pre` with the head's padded weights
gives the HyperHead's collapse (`hc_head`'s reference), in fp32 and in bf16 streams."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.hyper_head import HeadAsPre, collapse
from deepinfer.model.weights import HyperConnection
from tilekernels import reference_table
from tilekernels.ops import hc_head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,h", [(4, 64), (2, 48)])
def test_the_head_as_a_pre_block_collapses_as_the_head(dtype, n, h):
    gen = torch.Generator().manual_seed(n * h)
    streams = torch.randn(5, n, h, generator=gen).to(dtype)
    hc = HyperConnection(fn=0.1 * torch.randn(n, n * h, generator=gen), base=0.5 * torch.randn(n, generator=gen),
                         scale=1 + 0.1 * torch.randn(1, generator=gen))
    head = HeadAsPre.of(hc)
    assert head.fn.shape == ((2 + n) * n, n * h) and not head.fn[n:].any() and head.scale.tolist()[1:] == [1.0, 1.0]
    got = collapse(reference_table(), streams, head, iters=20, hc_eps=1e-6, norm_eps=1e-6)
    want = hc_head.reference(streams, hc.fn, hc.base, hc.scale, 1e-6, 1e-6)
    assert got.dtype == dtype
    # the same math; only the mixing matmul's row count differs (its fp32 sums may round apart in the last bit)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
