"""indexer_scores (lightning-indexer scores, keys read from the index-key store by storage row): the kernel on TileLang's
`c` target in fp32 against the reference (per-query and shared rows, the keys passed themselves as [E, dI] and
[S, E, dI], ragged key and query counts, odd head counts and widths that `run` pads, repeated, out-of-order and
int32 rows), `run` for bf16 and mixed dtypes through an emulated launch (the c target runs no bf16), the empty
cases, the named errors, `run` on meta tensors (what the compile plan traces), and the lowering for sm_90a / sm_100a
(with cubins) and Ascend at V4-Flash widths. The H200 run at V4-Flash widths: tests/gpu/test_indexer_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

from codegen.driver import record_run
from tilekernels import dtypes
from tests import helpers
from tilekernels.errors import ShapeError
from tilekernels.kernels import Recorder, kernel_table, table
from tilekernels.ops import DECLARED, indexer_scores as isc

NAME = "indexer_scores"
F = "float32"


@pytest.fixture(scope="module")
def ops(c_kernel_cache):
    return kernel_table("c", c_kernel_cache)


def within_bound(got, args):
    want = helpers.within_bound(isc, got, args)
    atol, rtol = DECLARED[NAME].tolerance[F]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return want


# (nI, dI, S, E): nI 4 / dI 20 are padded to 16 / 32 by `run`; E ragged against the key tiles (128 per query, 64
# shared), S ragged against the shared rows' block of queries (4 at 16 heads, 2 at 64)
SHAPES = [(4, 20, 3, 37), (16, 64, 5, 130), (64, 128, 3, 70)]


@pytest.mark.parametrize("shared", [False, True], ids=["per-query", "shared"])
@pytest.mark.parametrize("heads, dim, s, e", SHAPES, ids=[f"nI{h}-dI{d}-S{s}-E{e}" for h, d, s, e in SHAPES])
def test_c_kernel_matches_reference(heads, dim, s, e, shared, ops, c_kernel_cache):
    torch.manual_seed(e)
    args = isc.example(isc.Variant(heads, dim, F, shared), s, "cpu", keys=e)
    rows = args[4]
    assert rows.shape == ((e,) if shared else (s, e)) and (rows[..., 1] == rows[..., 0]).all()  # a repeat
    want = within_bound(ops.indexer_scores(*args), args)
    assert want.abs().max() > 0.5 and (want != 0).float().mean() > 0.5  # real scores, not zeros
    record_run(c_kernel_cache, NAME, "c", "fp32 on TileLang's c target matched the reference")


@pytest.mark.parametrize("form", ["shared", "per-query"])
def test_keys_passed_themselves(form, ops):
    """keys [E, dI] (a prefill chunk's) or [S, E, dI] (one set per query) without rows: the scores of those keys,
    as with the store and rows they were gathered by."""
    torch.manual_seed(2)
    q, store, w, scale, rows = isc.example(isc.Variant(16, 64, F, form == "shared"), 5, "cpu", keys=100)
    keys = store[rows]
    got = ops.indexer_scores(q, keys, w, scale)
    within_bound(got, (q, keys, w, scale))
    torch.testing.assert_close(got, ops.indexer_scores(q, store, w, scale, rows=rows), atol=0, rtol=0)


def test_int32_rows_and_per_query_rows_that_differ(ops):
    """int32 row ids; each query's own key set (the scores of query t are those of its rows, not of query 0's)."""
    torch.manual_seed(0)
    q, store, w, scale, _ = isc.example(isc.Variant(16, 64, F, False), 3, "cpu", keys=150)
    rows = torch.stack([torch.randperm(store.shape[0])[:150] for _ in range(3)]).int()
    args = (q, store, w, scale, rows)
    got = within_bound(ops.indexer_scores(*args), args)
    assert not torch.allclose(got[1], isc.reference(q[1:2], store, w[1:2], scale, rows[0:1])[0])


def emulated(kernel: str, v: isc.Variant):
    """The kernel's contract in PyTorch (fp32 math): what `run` hands a launched kernel, checked, then scored."""
    assert kernel == NAME

    def launch(q, store, rows, w, out, scale):
        s, h, d = w.shape[0], v.heads, v.dim
        assert q.dtype == getattr(torch, v.dtype) and store.dtype == getattr(torch, v.keys or v.dtype)
        assert q.shape == (s * h, d) and store.dim() == 2 and store.shape[1] == d and store.is_contiguous()
        assert rows.dtype == torch.int64 and rows.shape[0] == (1 if v.shared else s) and rows.shape[2] == v.block_e
        assert w.dtype == torch.float32 and s % v.block_q == 0 and out.shape == (s, rows.shape[1], v.block_e)
        keys = store[rows.reshape(rows.shape[0], -1)]
        out.copy_(isc.reference(q.view(s, h, d), keys[0] if v.shared else keys, w, scale).view_as(out))

    return launch


@pytest.mark.parametrize("qdt, kdt", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                      (torch.float32, torch.bfloat16)], ids=["bf16", "bf16-q-fp32-store", "fp32-q-bf16-store"])
@pytest.mark.parametrize("shared", [False, True], ids=["per-query", "shared"])
def test_run_pads_and_casts_for_bf16(qdt, kdt, shared):
    """bf16 q (V4 at bf16) and stores of another dtype than q's (the keys are cast on chip: the variant says so),
    through `run` with the kernel's contract emulated: ragged S and E, odd heads and widths."""
    torch.manual_seed(3)
    q, store, w, scale, rows = isc.example(isc.Variant(5, 20, dtypes.name(qdt), shared), 7, "cpu", keys=77)
    store = store.to(kdt)
    got = isc.run(emulated, q, store, w, scale, rows)
    torch.testing.assert_close(got, isc.reference(q, store, w, scale, rows), atol=1e-5, rtol=1e-5)
    v = isc.variant(q, shared, kdt)
    assert v.keys == (None if kdt == qdt else dtypes.name(kdt)) and (v.heads, v.dim) == (16, 32)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5)], ids=["shared-E0", "per-query-E0", "S0"])
def test_empty_launches_nothing(shape):
    s = 3 if shape in ((0,), (3, 0)) else 0
    rec = Recorder()
    out = table(rec).indexer_scores(torch.randn(s, 4, 64), torch.zeros(6, 64), torch.ones(s, 4), 0.125,
                                    rows=torch.zeros(shape, dtype=torch.long))
    assert out.shape == (s, shape[-1]) and out.dtype == torch.float32 and not rec.seen


def _args(q=(3, 4, 64), keys=(6, 64), w=(3, 4), rows=(3, 5), qdt=torch.float32, kdt=torch.float32,
          wdt=torch.float32, rdt=torch.long):
    return (torch.zeros(q, dtype=qdt), torch.zeros(keys, dtype=kdt), torch.zeros(w, dtype=wdt), 0.125,
            None if rows is None else torch.zeros(rows, dtype=rdt))


@pytest.mark.parametrize("args, message", [
    (_args(q=(3, 256)), "q must be [S, nI, dI], got [3, 256]"),
    (_args(qdt=torch.float64), "q must be one of float32, bfloat16, float16, got torch.float64"),
    (_args(kdt=torch.uint8), "keys must be one of float32, bfloat16, float16, got torch.uint8"),
    (_args(keys=(6, 32)), "keys must be a store [N, dI] = [N, 64] when rows are given, got [6, 32]"),
    (_args(keys=(3, 6, 64)), "keys must be a store [N, dI] = [N, 64] when rows are given, got [3, 6, 64]"),
    (_args(keys=(6, 32), rows=None), "keys must be [E, dI] or [S, E, dI] with S = 3, dI = 64 (or a store [N, dI] "
                                     "with rows), got [6, 32]"),
    (_args(keys=(2, 6, 64), rows=None), "keys must be [E, dI] or [S, E, dI] with S = 3, dI = 64"),
    (_args(keys=(64,), rows=None), "keys must be [E, dI] or [S, E, dI]"),
    (_args(rdt=torch.float32), "rows must be int64 (or int32), got torch.float32"),
    (_args(rows=(2, 5)), "rows must be [S, E] = [3, E] or [E], got [2, 5]"),
    (_args(rows=(3, 5, 1)), "rows must be [S, E] = [3, E] or [E], got [3, 5, 1]"),
    (_args(w=(3, 5)), "weights must be float32 [S, nI] = [3, 4], got torch.float32 [3, 5]"),
    (_args(wdt=torch.bfloat16), "weights must be float32 [S, nI] = [3, 4], got torch.bfloat16"),
    (_args(keys=(0, 64)), "rows given but the store has no rows"),
])
def test_inputs_the_kernel_cannot_take_are_named(args, message):
    """(No kernel is built: `run` rejects the inputs first.)"""
    q, keys, w, scale, rows = args
    with pytest.raises(ShapeError, match=re.escape(f"{NAME}: {message}")):
        table(Recorder()).indexer_scores(q, keys, w, scale, rows=rows)


# V4-Flash widths (64 index heads of 128), bf16 q and store: the variants decode and prefill launch
V4 = {False: isc.Variant(64, 128, "bfloat16", False), True: isc.Variant(64, 128, "bfloat16", True, 2, 64)}


@pytest.mark.parametrize("form", ["per-query-rows", "shared-rows", "shared-keys", "per-query-keys"])
def test_run_on_meta_tensors(form):
    """`run` reads no tensor values (the compile plan traces the model on meta tensors): one kernel, the variant
    of the inputs, a [S, E] result; the keys passed themselves launch the same variants as rows."""
    shared = form.startswith("shared")
    rec = Recorder()
    q, store, w, scale, rows = (a.to("meta") if isinstance(a, torch.Tensor) else a
                                for a in isc.example(V4[shared], 6, "cpu", keys=300))
    if form.endswith("keys"):
        store, rows = torch.empty((300, 128) if shared else (6, 300, 128), dtype=store.dtype, device="meta"), None
    out = table(rec).indexer_scores(q, store, w, scale, rows=rows)
    assert out.shape == (6, 300) and out.device.type == "meta"
    assert list(rec.seen) == [(NAME, NAME, V4[shared])]


@pytest.fixture(scope="module")
def lower_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("indexer-scores-kernels")


def test_sm90_override_takes_the_prefill_variant_only():
    """sm_90a's prefill kernel (indexer_scores_sm90) takes shared bf16 rows in 64-key tiles; decode (per-query rows),
    the batch-invariant tile (128 keys), a store in another dtype and every other target keep the portable body."""
    from tilekernels.ops import indexer_scores_sm90

    kernel = DECLARED[NAME].kernel(NAME)
    q = torch.empty(1, 64, 128, dtype=torch.bfloat16, device="meta")
    assert kernel.body_for("sm90", isc.variant(q, True)) is indexer_scores_sm90.body
    for v in (isc.variant(q, False), isc.variant(q, True, invariant=True), isc.variant(q, True, torch.float32)):
        assert kernel.body_for("sm90", v) is kernel.body
    assert all(kernel.body_for(t, isc.variant(q, True)) is kernel.body for t in ("sm100", "ascend", "c"))
    with pytest.raises(ShapeError, match="shared bf16 rows"):
        indexer_scores_sm90.body(None, isc.variant(q, False))


def test_cuda_source_and_cubin_for_sm90a_and_sm100a(lower_cache):
    """The shared-rows variant at V4 widths (tests/tilekernels/test_lowering.py lowers the per-query one; on sm_90a
    this is indexer_scores_sm90's kernel)."""
    import backends
    from backends.nvidia import without_library
    from codegen import Compiler
    from tilekernels.kernels import request

    for name, mma in (("sm90", "wgmma"), ("sm100", "tcgen05")):
        art = Compiler(without_library(backends.get(name)), lower_cache).get(request(NAME, NAME, V4[True]))
        source = art.file("cuda").read_text()
        cubin = art.file("cubin")
        assert "__global__" in source and mma in source, f"{name}: no {mma} in the source"
        assert cubin is not None and cubin.read_bytes()[:4] == b"\x7fELF", f"{name}: no cubin"
        if name == "sm100":  # the logits leave tensor memory through tcgen05.ld, not as copies of TMEM addresses
            assert "tcgen05_ld" in source


def test_ascend_source_without_traps(lower_cache):
    """The shared-rows variant at V4 widths (the per-query one: tests/tilekernels/test_lowering.py)."""
    import backends
    from codegen import Compiler
    from tilekernels.kernels import request

    art = Compiler(backends.get("ascend"), lower_cache).get(request(NAME, NAME, V4[True]))
    source = art.file("ascend").read_text()
    assert "__global__" in source and "asc_" in source and "ascend_gemm_l1" in source
    assert not re.search(r"blockIdx\.[yz]|threadIdx\.[yz]", source), "a 2-D launch leaked into the NPU source"
    assert "asc_get_sub_block_id" in source  # each vector unit gathers and scores its half of the keys
