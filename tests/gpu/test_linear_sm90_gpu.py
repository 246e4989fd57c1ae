"""The sm90 overrides of the bf16 `linear` GEMM on the H200 against the op's PyTorch reference, at V4-Flash shapes
and ragged ones: prefill rows (tilekernels/ops/linear_sm90.py), a few decode rows of a large weight
(tilekernels/ops/linear_decode_sm90.py, swapped operands, split K or not), beside the portable narrow and split-K
variants they leave alone. Run with `pytest -m gpu tests/gpu/test_linear_sm90_gpu.py` on the GPU host."""

import pytest
import torch

from tests.gpu.conftest import built_sm90_table
from tilekernels.ops import DECLARED, linear, linear_decode_sm90, linear_sm90

pytestmark = pytest.mark.gpu

ROWS = (1, 7, 64, 300, 512, 1000, 2100, 4096)  # 1000, 2100: ragged last tiles and panels of the persistent body
SHAPES = [(1024, 4096), (32768, 1024), (4096, 8192),  # q_a, q_b, o_b (N, K)
          (1000, 2048),  # ragged N
          (1000, 9216),  # ragged N of a large weight: swapped at up to linear.SWAP_ROWS rows
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


@pytest.mark.parametrize("m", (1, 5))
def test_grouped_swapped_variants_match_reference(m, ops, cache_dir):
    """o_a's shape (8 groups of 1024 x 4096, split K): the swapped decode kernel writes each group's partials."""
    v = linear.variant(m, 1024, 4096, 8)
    assert v.swapped and v.split_k > 1 and linear_decode_sm90.fits(v)
    torch.manual_seed(m)
    x = torch.randn(m, 8, 4096, device="cuda").to(torch.bfloat16)
    w = (torch.randn(8, 1024, 4096, device="cuda") / 64).to(torch.bfloat16)
    want = torch.einsum("mgk,gnk->mgn", x.float(), w.float())
    from tilekernels.kernels import kernel_launcher

    close(linear.gemm(kernel_launcher("sm90", cache_dir).for_op("linear"), x, w, v), want.to(torch.bfloat16))


def test_decode_override_takes_the_swapped_variants_only(ops, cache_dir):
    """A few rows of a large weight build from linear_decode_sm90 (wgmma with the token rows as its N = 16); more
    rows, or a small weight, keep the portable narrow body."""
    import backends
    from codegen import Compiler
    from tilekernels.kernels import request

    compiler = Compiler(backends.get("sm90"), cache_dir)
    assert linear.variant(linear.SWAP_ROWS, 32768, 1024).swapped
    assert not linear.variant(linear.SWAP_ROWS + 1, 32768, 1024).swapped
    assert not linear.variant(1, 1024, 4096).swapped  # 4M values: the narrow tile was faster
    assert not linear.variant(1, 32768, 1024, invariant=True).swapped  # batch-invariant: one body per shape
    assert linear.KERNEL.body_for("sm90", linear.variant(1, 32768, 1024)) is linear_decode_sm90.body
    assert linear.KERNEL.body_for("sm90", linear.variant(9, 32768, 1024)) is linear.body
    source = compiler.get(request("linear", "gemm", linear.variant(1, 32768, 1024))).file("cuda").read_text()
    assert "64, 16, 16" in source  # wgmma m64n16k16
