"""indexer_scores_fp4 on the H200 (sm_90a) at DeepSeek-V4.1 widths (32 index heads of 128, keys FP4 in the paged
cache with ue8m0 scales per 32) with bf16 queries against the PyTorch reference: decode (one key set per query, 1
and 128 queries of 4096 keys), a prefill chunk (64 queries sharing 2048 keys), ragged key and query counts, and a
replay from a CUDA graph. Each score is checked against `error_bound` (fp32 summation order, with twice the
rounding error per add for the tensor cores' adders) and the op's bf16 tolerance.

Run with `pytest -m gpu tests/gpu/test_indexer_gpu.py` on the GPU host; build the kernels first with
`build_kernels("sm90", indexer_kernel_items(), cache_dir)` (deepinfer.compile.prebuild) or let the first call
compile them."""

from __future__ import annotations

import pytest
import torch

from codegen.driver import record_run
from tilekernels.ops import DECLARED, indexer_scores_fp4 as isf

pytestmark = pytest.mark.gpu

NAME = "indexer_scores_fp4"
# (queries, keys, shared rows)
CASES = [(1, 4096, False), (128, 4096, False), (64, 2048, True), (8, 1000, False), (13, 777, True)]
IDS = [f"S{s}-E{e}-{'shared' if sh else 'per-query'}" for s, e, sh in CASES]


def variant(shared: bool) -> isf.Variant:
    return isf.variant(torch.empty(1, 32, 128, dtype=torch.bfloat16, device="meta"), shared)


def indexer_kernel_items() -> list[tuple]:
    """The (op, kernel, variant) items these tests launch: what the GPU host prebuilds (from `run` on meta
    tensors with a recording launcher, so it cannot drift from what the tests call)."""
    from tilekernels.kernels import Recorder, table

    recorder = Recorder()
    ops = table(recorder)
    for shared in (False, True):
        args = isf.example(variant(shared), 2, "cpu", keys=5)
        ops.indexer_scores_fp4(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
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
