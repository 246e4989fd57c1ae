"""`hc_pre`'s one-kernel prefill form (`hc_pre_fused`): when `run` takes it, and its portable body on the c target
against the reference (its sm_90a override, a cluster of CTAs over distributed shared memory, is checked on the GPU
in tests/gpu/test_hc_sm90_gpu.py)."""

import pytest
import torch

from tilekernels.kernels import Recorder, kernel_launcher
from tilekernels.ops import DECLARED, hc_pre, hc_pre_sm90

F = "float32"
# (variant, rows): the V4 shape's width in chunks of 64, widths the c target's chunks do not divide (the last
# chunk masked), the norm form, and a row count past FUSED_ROWS
CASES = {
    "n4": (hc_pre.Variant(4, 64, 20, F), 5),
    "ragged": (hc_pre.Variant(3, 40, 3, F), 3),
    "norm": (hc_pre.Variant(4, 64, 20, F, norm=True), 4),
    "norm-ragged": (hc_pre.Variant(2, 100, 3, F, norm=True), 2),
    "rows": (hc_pre.Variant(4, 32, 5, F), hc_pre.FUSED_ROWS + 3),
}


@pytest.fixture(scope="module")
def launch(c_kernel_cache):
    from tests.helpers import prebuild_c

    prebuild_c(c_kernel_cache, [("hc_pre", "hc_pre_fused", v) for v, _ in CASES.values()])
    return kernel_launcher("c", c_kernel_cache).for_op("hc_pre")


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_body_matches_reference(case, launch):
    v, rows = CASES[case]
    torch.manual_seed(rows)
    streams, fn, base, scale, iters, hc_eps, norm_eps, *norm = hc_pre.example(v, rows, "cpu")
    want = hc_pre.reference(streams, fn, base, scale, iters, hc_eps, norm_eps, *norm)
    s = streams.reshape(rows, -1).contiguous()
    got = hc_pre.launch_fused(launch, v, s, fn, base, scale, hc_eps, norm_eps, *norm)
    atol, rtol = DECLARED["hc_pre"].tolerance[F]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


def launched(rows: int, hidden: int = 4096, dtype=torch.bfloat16, invariant: bool = False, norm: bool = True):
    """The kernels `run` launches for V4-width streams of `rows` rows (traced on meta tensors)."""
    recorder = Recorder(invariant)
    v = hc_pre.Variant(4, hidden, 20, "bfloat16" if dtype == torch.bfloat16 else F, norm=norm)
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in hc_pre.example(v, 1, "cpu")]
    args[0] = torch.empty(rows, 4, hidden, dtype=dtype, device="meta")
    DECLARED["hc_pre"].run(recorder.for_op("hc_pre"), *args)
    return [kernel for _, kernel, _ in recorder.seen]


def test_run_takes_the_fused_kernel_at_prefill_rows_only():
    assert launched(hc_pre.FUSED_ROWS) == ["hc_pre_split", "hc_pre_finish"]  # decode and verify steps
    assert launched(hc_pre.FUSED_ROWS + 1) == ["hc_pre_fused"]
    assert launched(4096, norm=False) == ["hc_pre_fused"]
    # the batch-invariant mode keeps one form at every row count; shapes the sm_90a kernel does not take keep two
    assert launched(4096, invariant=True) == ["hc_pre_split", "hc_pre_finish"]
    assert launched(4096, hidden=4096 + 64) == ["hc_pre_split", "hc_pre_finish"]
    assert launched(4096, dtype=torch.float32) == ["hc_pre_split", "hc_pre_finish"]


def test_the_sm90_tile_fits_its_shared_memory():
    for norm in (False, True):
        v = hc_pre.Variant(4, 4096, 20, "bfloat16", norm=norm)
        assert hc_pre_sm90.fits(v)
        assert hc_pre_sm90.smem_bytes(v) <= 227 * 1024 // hc_pre_sm90.TUNE.min_blocks
