"""indexer_scores_fp4 (lightning-indexer scores over FP4-cached keys read by storage row): the kernel on TileLang's
`c` target in fp32 against the reference (per-query and shared rows, ragged key and query counts, repeated and
out-of-order rows, both ways of reading the scale bytes), the key decoding bit for bit, the empty cases, the named
errors, `run` on meta tensors (what the compile plan traces), and the lowering for sm_90a / sm_100a (with cubins)
and Ascend at V4.1 widths. The H200 run at V4.1 widths: tests/gpu/test_indexer_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

from codegen.driver import record_run
from tests import helpers
from tilekernels.errors import ShapeError
from tilekernels.kernels import Recorder, kernel_table, table
from tilekernels.ops import DECLARED, indexer_scores_fp4 as isf

NAME = "indexer_scores_fp4"
F = "float32"


@pytest.fixture(scope="module")
def ops(c_kernel_cache):
    return kernel_table("c", c_kernel_cache)


def within_bound(got, args):
    return helpers.within_bound(isf, got, args)


# (nI, dI, S, E): dI 64 reads the scale bytes one by one, dI 128 as int32 words; E ragged against the key tiles
# (128 per query, 64 shared), S ragged against the shared rows' 4 queries per tile
@pytest.mark.parametrize("shared", [False, True], ids=["per-query", "shared"])
@pytest.mark.parametrize("heads, dim, s, e", [(4, 64, 3, 37), (2, 128, 5, 130)], ids=["dI64-E37", "dI128-E130"])
def test_c_kernel_matches_reference(heads, dim, s, e, shared, ops, c_kernel_cache):
    torch.manual_seed(e)
    v = isf.Variant(heads, dim, F, shared)
    args = isf.example(v, s, "cpu", keys=e)
    rows = args[3]
    assert rows.shape == ((e,) if shared else (s, e)) and (rows[..., 1] == rows[..., 0]).all()  # a repeat
    want = within_bound(ops.indexer_scores_fp4(*args), args)
    assert want.abs().max() > 1.0  # real scores, not zeros
    atol, rtol = DECLARED[NAME].tolerance[F]
    torch.testing.assert_close(ops.indexer_scores_fp4(*args), want, atol=atol, rtol=rtol)
    record_run(c_kernel_cache, NAME, "c", "fp32 on TileLang's c target matched the reference")


def test_int32_rows_and_per_query_rows_that_differ(ops):
    """int32 row ids; each query's own key set (the scores of query t are those of its rows, not of query 0's)."""
    torch.manual_seed(0)
    v = isf.Variant(4, 64, F, False)
    q, codes, scales, rows, w, scale = isf.example(v, 3, "cpu", keys=37)
    rows = torch.stack([torch.randperm(codes.shape[0])[:37] for _ in range(3)]).int()
    args = (q, codes, scales, rows, w, scale)
    within_bound(ops.indexer_scores_fp4(*args), args)


@pytest.mark.parametrize("shared", [False, True], ids=["per-query", "shared"])
def test_keys_decode_exactly(shared, ops):
    """One-hot queries (heads 4t .. 4t + 3 read dims 4t .. 4t + 3 of one scale group, weights 1, scale 1): each
    score is a sum of 4 exact key values (every nibble, scale bytes 0 .. 252, subnormal keys included), so the
    kernel matches the reference bit for bit; negated queries put the negative keys through ReLU."""
    torch.manual_seed(1)
    heads, dim, n = 4, 64, 300
    codes = torch.randint(0, 256, (n, dim // 2), dtype=torch.uint8)
    codes[:16, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code in both nibbles
    scales = torch.randint(0, 253, (n, dim // 32), dtype=torch.uint8)  # 6 * 2^(252 - 127) is finite in fp32
    scales[:2] = torch.tensor([[0, 1], [252, 2]], dtype=torch.uint8)
    s = 2 * dim // heads  # 16 positive and 16 negated one-hot queries
    q = torch.zeros(s, heads, dim)
    for t in range(s):
        for h in range(heads):
            q[t, h, (t * heads + h) % dim] = 1.0 if t < s // 2 else -1.0
    rows = torch.randperm(n)[:150] if shared else torch.randint(0, n, (s, 150))
    rows[..., :16] = torch.arange(16)
    args = (q, codes, scales, rows, torch.ones(s, heads), 1.0)
    got, want = ops.indexer_scores_fp4(*args), isf.reference(*args)
    assert torch.equal(got, want)
    assert (want > 0).any() and (want == 0).any()


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5)], ids=["shared-E0", "per-query-E0", "S0"])
def test_empty_launches_nothing(shape):
    s = 3 if shape in ((0,), (3, 0)) else 0
    rec = Recorder()
    q = torch.randn(s, 4, 64)
    codes, scales = torch.zeros(6, 32, dtype=torch.uint8), torch.zeros(6, 2, dtype=torch.uint8)
    out = table(rec).indexer_scores_fp4(q, codes, scales, torch.zeros(shape, dtype=torch.long), torch.ones(s, 4), 0.125)
    assert out.shape == (s, shape[-1]) and out.dtype == torch.float32 and not rec.seen


def _args(q=(3, 4, 64), codes=(6, 32), scales=(6, 2), rows=(3, 5), w=(3, 4), qdt=torch.float32,
          cdt=torch.uint8, sdt=torch.uint8, rdt=torch.long, wdt=torch.float32):
    return (torch.zeros(q, dtype=qdt), torch.zeros(codes, dtype=cdt), torch.zeros(scales, dtype=sdt),
            torch.zeros(rows, dtype=rdt), torch.zeros(w, dtype=wdt), 0.125)


@pytest.mark.parametrize("args, message", [
    (_args(q=(3, 256)), "q must be [S, nI, dI], got [3, 256]"),
    (_args(qdt=torch.float64), "q must be one of float32, bfloat16, float16, got torch.float64"),
    (_args(q=(3, 4, 48), codes=(6, 24)), "dI must be a multiple of 32"),
    (_args(cdt=torch.int8), "codes and scales must be uint8"),
    (_args(sdt=torch.float32), "codes and scales must be uint8"),
    (_args(codes=(6, 64)), "codes must be [N, dI / 2] = [N, 32], got [6, 64]"),
    (_args(scales=(6, 4)), "scales must be [N, dI / 32] = [6, 2], got [6, 4]"),
    (_args(scales=(5, 2)), "scales must be [N, dI / 32] = [6, 2], got [5, 2]"),
    (_args(rdt=torch.float32), "rows must be int64 (or int32), got torch.float32"),
    (_args(rows=(2, 5)), "rows must be [S, E] = [3, E] or [E], got [2, 5]"),
    (_args(rows=(3, 5, 1)), "rows must be [S, E] = [3, E] or [E], got [3, 5, 1]"),
    (_args(w=(3, 5)), "weights must be float32 [S, nI] = [3, 4], got torch.float32 [3, 5]"),
    (_args(wdt=torch.bfloat16), "weights must be float32 [S, nI] = [3, 4], got torch.bfloat16"),
    (_args(codes=(0, 32), scales=(0, 2)), "rows given but the store has no rows"),
])
def test_inputs_the_kernel_cannot_take_are_named(args, message):
    """(No kernel is built: `run` rejects the inputs first.)"""
    with pytest.raises(ShapeError, match=re.escape(f"{NAME}: {message}")):
        table(Recorder()).indexer_scores_fp4(*args)


@pytest.mark.parametrize("shared", [False, True], ids=["per-query", "shared"])
def test_run_on_meta_tensors(shared):
    """`run` reads no tensor values (the compile plan traces the model on meta tensors): one kernel, the variant
    of the inputs (bf16 q at V4.1 widths), a [S, E] result."""
    rec = Recorder()
    v = isf.Variant(32, 128, "bfloat16", shared)
    args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in isf.example(v, 6, "cpu", keys=300))
    out = table(rec).indexer_scores_fp4(*args)
    assert out.shape == (6, 300) and out.device.type == "meta"
    want = isf.Variant(32, 128, "bfloat16", True, 4, 64) if shared else isf.Variant(32, 128, "bfloat16", False)
    assert list(rec.seen) == [(NAME, NAME, want)]


# ---- lowering at V4.1 widths (32 heads of 128; bf16 queries): compile-only for sm_100a and Ascend; the per-query
# variant lowers in tests/tilekernels/test_lowering.py (the same body) ----------------------------------------------
LOWERED = {"shared": isf.Variant(32, 128, "bfloat16", True, 4, 64)}


@pytest.fixture(scope="module")
def lower_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("indexer-kernels")


@pytest.mark.parametrize("case", sorted(LOWERED))
def test_cuda_source_and_cubin_for_sm90a_and_sm100a(case, lower_cache):
    import backends
    from backends.nvidia import without_library
    from codegen import Compiler
    from tilekernels.kernels import request

    for name, mma in (("sm90", "wgmma"), ("sm100", "tcgen05")):
        art = Compiler(without_library(backends.get(name)), lower_cache).get(request(NAME, NAME, LOWERED[case]))
        source = art.file("cuda").read_text()
        cubin = art.file("cubin")
        assert "__global__" in source and mma in source, f"{name}: no {mma} in the source"
        assert cubin is not None and cubin.read_bytes()[:4] == b"\x7fELF", f"{name}: no cubin"
        if name == "sm100":  # the logits leave tensor memory through tcgen05.ld, not as copies of TMEM addresses
            assert "tcgen05_ld" in source


@pytest.mark.parametrize("case", sorted(LOWERED))
def test_ascend_source_without_traps(case, lower_cache):
    import backends
    from codegen import Compiler
    from tilekernels.kernels import request

    art = Compiler(backends.get("ascend"), lower_cache).get(request(NAME, NAME, LOWERED[case]))
    source = art.file("ascend").read_text()
    assert "__global__" in source and "asc_" in source and "ascend_gemm_l1" in source
    assert not re.search(r"blockIdx\.[yz]|threadIdx\.[yz]", source), "a 2-D launch leaked into the NPU source"
    assert "asc_get_sub_block_id" in source  # each vector unit gathers and scores its half of the keys
