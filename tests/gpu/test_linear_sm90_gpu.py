"""The sm90 override of the bf16 `linear` GEMM at prefill rows (tilekernels/ops/linear_sm90.py) on the H200
against the op's PyTorch reference, at V4-Flash shapes and ragged ones, beside the portable decode and split-K
variants it leaves alone. Run with `pytest -m gpu tests/gpu/test_linear_sm90_gpu.py` on the GPU host."""

import pytest
import torch

from tests.gpu.conftest import built_sm90_table
from tilekernels.ops import DECLARED, linear, linear_sm90

pytestmark = pytest.mark.gpu

ROWS = (1, 7, 64, 300, 512, 4096)
SHAPES = [(1024, 4096), (32768, 1024), (4096, 8192),  # q_a, q_b, o_b (N, K)
          (1000, 2048),  # ragged N
          (200, 1000),  # ragged N and K
          (40, 14)]  # rows of 28 bytes: no TMA (cp.async copies), one tile narrower than the config's
TOL = DECLARED["linear"].tolerance["bfloat16"]


@pytest.fixture(scope="module")
def ops(cuda, cache_dir):
    """The sm90 op table, its kernels built up front in parallel."""
    items = list(dict.fromkeys(("linear", "gemm", linear.variant(m, n, k)) for n, k in SHAPES for m in ROWS))
    return built_sm90_table(items, cache_dir)


def inputs(m, n, k, seed=0):
    torch.manual_seed(seed + m + n + k)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    return x, w


def close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[0], rtol=TOL[1])


@pytest.mark.parametrize("n, k", SHAPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_linear_matches_reference(m, n, k, ops):
    x, w = inputs(m, n, k)
    close(ops.linear(x, w), linear.reference(x, w))
    x3 = x.view(1, m, k)  # leading dims are flattened into rows
    close(ops.linear(x3, w), linear.reference(x3, w))


def test_override_takes_the_prefill_rows_only(ops, cache_dir):
    """The prefill variant is built from the override (wgmma, the swizzled block order); decode and split-K
    variants keep the portable body."""
    import backends
    from codegen import Compiler
    from tilekernels.kernels import request

    compiler = Compiler(backends.get("sm90"), cache_dir)
    assert linear_sm90.supports(linear.variant(4096, 1024, 4096))
    assert not linear_sm90.supports(linear.variant(1, 1024, 4096))
    assert not linear_sm90.supports(linear.variant(300, 1024, 4096))
    source = compiler.get(request("linear", "gemm", linear.variant(4096, 1024, 4096))).file("cuda").read_text()
    assert "wgmma" in source and "rasterization2D" in source
