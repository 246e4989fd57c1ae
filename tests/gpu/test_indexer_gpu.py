"""The lightning-indexer kernels on the H200 (sm_90a) with bf16 queries against the PyTorch reference.

indexer_scores_fp4 at DeepSeek-V4.1 widths (32 index heads of 128, keys FP4 in the paged cache with ue8m0 scales per
32): decode (one key set per query, 1 and 128 queries of 4096 keys), a prefill chunk (64 queries sharing 2048 keys),
ragged key and query counts, and a replay from a CUDA graph.

indexer_scores at DeepSeek-V4-Flash widths (64 index heads of 128, bf16 keys read from the store by storage row):
decode (per-query rows, 1 to 128 queries, up to 16384 keys: a 64K context at ratio 4), a 4096-query prefill chunk
sharing its keys (passed as rows, and as the [E, dI] keys the model passes), ragged counts, an fp32 store under bf16
queries, and a replay from a CUDA graph.

Each score is checked against the op's `error_bound` (fp32 summation order, with twice the rounding error per add
for the tensor cores' adders) and its bf16 tolerance.

Run with `pytest -m gpu tests/gpu/test_indexer_gpu.py` on the GPU host; build the kernels first with
`build_kernels("sm90", indexer_kernel_items(), cache_dir)` (deepinfer.compile.prebuild) or let the first call
compile them."""

from __future__ import annotations

import pytest
import torch

from codegen.driver import record_run
from tilekernels.ops import DECLARED, indexer_scores as isc, indexer_scores_fp4 as isf

pytestmark = pytest.mark.gpu

NAME = "indexer_scores_fp4"
# (queries, keys, shared rows)
CASES = [(1, 4096, False), (128, 4096, False), (64, 2048, True), (8, 1000, False), (13, 777, True)]
IDS = [f"S{s}-E{e}-{'shared' if sh else 'per-query'}" for s, e, sh in CASES]


def variant(shared: bool) -> isf.Variant:
    return isf.variant(torch.empty(1, 32, 128, dtype=torch.bfloat16, device="meta"), shared)


def v4_variant(shared: bool, keys: torch.dtype | None = None) -> isc.Variant:
    return isc.variant(torch.empty(1, 64, 128, dtype=torch.bfloat16, device="meta"), shared, keys)


def indexer_kernel_items() -> list[tuple]:
    """The (op, kernel, variant) items these tests launch: what the GPU host prebuilds (from `run` on meta
    tensors with a recording launcher, so it cannot drift from what the tests call)."""
    from tilekernels.kernels import Recorder, table

    recorder = Recorder()
    ops = table(recorder)
    meta = lambda args: tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)  # noqa: E731
    for shared in (False, True):
        ops.indexer_scores_fp4(*meta(isf.example(variant(shared), 2, "cpu", keys=5)))
        for keys in (None, torch.float32):
            q, store, w, scale, rows = meta(isc.example(v4_variant(shared), 2, "cpu", keys=5))
            ops.indexer_scores(q, store if keys is None else store.float(), w, scale, rows=rows)
    return list(recorder.seen)


def check(got: torch.Tensor, args: tuple) -> None:
    want = isf.reference(*args)
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got - want).abs()
    bound = isf.error_bound(*args, accumulate_ulps=2.0)
    worst = (err / bound.clamp(min=1e-30)).max().item()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, {worst:.3g}x the bound"
    atol, rtol = DECLARED[NAME].tolerance["bfloat16"]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("s, e, shared", CASES, ids=IDS)
def test_indexer_scores_fp4_matches_reference_bf16(s, e, shared, sm90_ops, cuda, cache_dir):
    torch.manual_seed(s + e)
    args = isf.example(variant(shared), s, cuda, keys=e)
    check(sm90_ops.indexer_scores_fp4(*args), args)
    record_run(cache_dir, NAME, "sm90", f"H200 bf16 at V4.1 widths, S={s} E={e} {'shared' if shared else 'per-query'} "
               "rows: within the fp32 summation bound of the reference")


def test_indexer_scores_fp4_replays_from_a_cuda_graph(sm90_ops, cuda):
    """Decode replays captured steps: new queries, weights and row ids written into the captured inputs."""
    torch.manual_seed(5)
    args = isf.example(variant(False), 16, cuda, keys=3000)
    fn = sm90_ops.indexer_scores_fp4
    fn(*args)  # load the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    fresh = isf.example(variant(False), 16, cuda, keys=3000)
    for i in (0, 3, 4):  # q, rows, weights (the store is the same size: rows stay in range)
        args[i].copy_(fresh[i])
    graph.replay()
    torch.cuda.synchronize()
    check(out, args)


# ---- indexer_scores at V4-Flash widths ----------------------------------------------------------------------------
# (queries, keys, shared rows): decode at 1..128 sequences up to a 64K context (16384 entries at ratio 4), ragged
# counts, and a 4096-token prefill chunk sharing 4096 keys (16K tokens of context at ratio 4)
V4_CASES = [(1, 16384, False), (37, 1000, False), (128, 16384, False), (13, 777, True), (4096, 4096, True)]
V4_IDS = [f"S{s}-E{e}-{'shared' if sh else 'per-query'}" for s, e, sh in V4_CASES]


def check_v4(got: torch.Tensor, args: tuple) -> None:
    want = isc.reference(*args)
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got - want).abs()
    bound = isc.error_bound(*args, accumulate_ulps=2.0)
    worst = (err / bound.clamp(min=1e-30)).max().item()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, {worst:.3g}x the bound"
    atol, rtol = DECLARED["indexer_scores"].tolerance["bfloat16"]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert (want != 0).float().mean() > 0.5  # real scores, not zeros


@pytest.mark.parametrize("s, e, shared", V4_CASES, ids=V4_IDS)
def test_indexer_scores_matches_reference_bf16(s, e, shared, sm90_ops, cuda, cache_dir):
    torch.manual_seed(s + e)
    args = isc.example(v4_variant(shared), s, cuda, keys=e)
    check_v4(sm90_ops.indexer_scores(*args), args)
    record_run(cache_dir, "indexer_scores", "sm90", f"H200 bf16 at V4-Flash widths, S={s} E={e} "
               f"{'shared' if shared else 'per-query'} rows: within the fp32 summation bound of the reference")


@pytest.mark.parametrize("shared", [False, True], ids=["per-query", "shared"])
def test_indexer_scores_keys_passed_themselves(shared, sm90_ops, cuda):
    """The keys as the model's prefill passes them ([E, dI]) or gathered per query ([S, E, dI]): the same scores
    as the store and rows they came from, bit for bit (same kernel, same sums)."""
    torch.manual_seed(7)
    q, store, w, scale, rows = isc.example(v4_variant(shared), 4096 if shared else 64, cuda, keys=2000)
    keys = store[rows]
    got = sm90_ops.indexer_scores(q, keys, w, scale)
    check_v4(got, (q, keys, w, scale))
    assert torch.equal(got, sm90_ops.indexer_scores(q, store, w, scale, rows=rows))


@pytest.mark.parametrize("shared", [False, True], ids=["per-query", "shared"])
def test_indexer_scores_fp32_store_under_bf16_queries(shared, sm90_ops, cuda):
    """A store in another dtype than q's: the keys are cast to bf16 on chip (round to nearest), so the scores are
    those of the store rounded to bf16, within the same bound."""
    torch.manual_seed(8)
    q, store, w, scale, rows = isc.example(v4_variant(shared), 33, cuda, keys=3000)
    store = store.float() * (1 + 2.0**-12)  # values bf16 cannot hold exactly
    got = sm90_ops.indexer_scores(q, store, w, scale, rows=rows)
    check_v4(got, (q, store.bfloat16(), w, scale, rows))


def test_indexer_scores_replays_from_a_cuda_graph(sm90_ops, cuda):
    """Decode replays captured steps: new queries, weights, keys and row ids written into the captured inputs."""
    torch.manual_seed(9)
    args = isc.example(v4_variant(False), 64, cuda, keys=8000)
    fn = sm90_ops.indexer_scores
    fn(*args)  # load the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    fresh = isc.example(v4_variant(False), 64, cuda, keys=8000)
    for static, new in zip(args, fresh):
        if isinstance(static, torch.Tensor):
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    check_v4(out, args)
