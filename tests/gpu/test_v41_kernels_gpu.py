"""DeepSeek-V4.1's own ops through their TileLang kernels on the H200 (sm_90a) at V4.1 widths in bf16 against the
PyTorch reference, eagerly and replayed from a CUDA graph: hidden 5120 with 4 mHC copies and 20 Sinkhorn
iterations, FP4 latents (512 wide, groups of 16, e4m3 scales) and index queries/keys (32 heads of 128, groups of
32, ue8m0 scales), rounded (fp4_act_qdq) and packed into and gathered from the FP4 cache (fp4_pack, fp4_gather; the
pack's bytes and the gather's bf16 values bit for bit), candidate blocks of 8 (top 2048), Engram rows of 256 (FP8,
ue8m0 per 32).

Run with `pytest -m gpu tests/gpu/test_v41_kernels_gpu.py` on the GPU host; build the kernels first with
`build_kernels("sm90", v41_kernel_items(), cache_dir)` (deepinfer.compile.prebuild) or let the first call
compile them."""

from __future__ import annotations

import pytest
import torch

from codegen.driver import record_run
from tilekernels.ops import DECLARED

pytestmark = pytest.mark.gpu

TOKENS = (8, 512)
GRAPH_TOKENS = 16


def v41_variants() -> dict[str, list]:
    """op -> the variants its inputs are made for, at V4.1 widths; the inputs come from each op's `example`."""
    from tilekernels.ops import (candidate_blocks, engram_gate, engram_lookup, fp4_act_qdq, fp4_gather, fp4_pack,
                                 hc_collapse, hc_mixes, indexer_scores_fp4)

    b = "bfloat16"
    return {
        # split K at every row count (20 parts of 2 chunks); 20000 columns: a partial last chunk, masked
        "hc_mixes": [hc_mixes.Variant(4, 5120, 20, b), hc_mixes.Variant(4, 5000, 20, b)],
        "hc_collapse": [hc_collapse.Variant(4, 5120, b)],
        "fp4_act_qdq": [fp4_act_qdq.Variant(512, 16, "e4m3", b), fp4_act_qdq.Variant(128, 32, "ue8m0", b)],
        "fp4_pack": [fp4_pack.Variant(512, 16, "e4m3", b), fp4_pack.Variant(128, 32, "ue8m0", b)],
        "fp4_gather": [fp4_gather.Variant(512, 16, "e4m3", b), fp4_gather.Variant(128, 32, "ue8m0", b)],
        "candidate_blocks": [candidate_blocks.Variant(8, 2048)],
        "engram_gate": [engram_gate.Variant(4, 5120, b)],
        "engram_lookup": [engram_lookup.Variant(256, 32, "ue8m0", "fp8")],
        "indexer_scores_fp4": [indexer_scores_fp4.Variant(32, 128, b, False),
                               indexer_scores_fp4.Variant(32, 128, b, True, 4, 64)],
    }


CASES = [(name, v) for name, vs in v41_variants().items() for v in vs]
IDS = [f"{name}-{i}" for name, vs in v41_variants().items() for i in range(len(vs))]


def v41_kernel_items() -> list[tuple]:
    """The (op, kernel, variant) items these tests launch: what the GPU host prebuilds. Derived by running each
    case's `run` on meta tensors with a recording launcher, so it cannot drift from what the tests call."""
    from tilekernels.kernels import Recorder, table
    from tilekernels.quant import BlockQuantized

    recorder = Recorder()
    ops = table(recorder)
    meta = torch.device("meta")
    for name, v in CASES:
        args = DECLARED[name].example(v, 2, "cpu")
        getattr(ops, name)(*(a.to(meta) if isinstance(a, (torch.Tensor, BlockQuantized)) else a for a in args))
    return list(recorder.seen)


def compare(name, got, want):
    got = (got,) if isinstance(got, torch.Tensor) else got
    want = (want,) if isinstance(want, torch.Tensor) else want
    atol, rtol = DECLARED[name].tolerance["bfloat16"]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.dtype == torch.bool:
            assert torch.equal(g, w), f"{name}: {(g != w).sum().item()} positions differ"
        else:
            torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name, variant", CASES, ids=IDS)
def test_v41_kernel_matches_reference_bf16(name, variant, tokens, sm90_ops, cuda, cache_dir):
    torch.manual_seed(tokens)
    args = DECLARED[name].example(variant, tokens, cuda)
    compare(name, getattr(sm90_ops, name)(*args), DECLARED[name].reference(*args))
    record_run(cache_dir, name, "sm90", f"H200 bf16 at V4.1 widths, {tokens} tokens: matched the reference")


@pytest.mark.parametrize("name, variant", CASES, ids=IDS)
def test_v41_kernel_replays_from_a_cuda_graph(name, variant, sm90_ops, cuda):
    torch.manual_seed(1)
    args = DECLARED[name].example(variant, GRAPH_TOKENS, cuda)
    fn = getattr(sm90_ops, name)
    fn(*args)  # load the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    fresh = DECLARED[name].example(variant, GRAPH_TOKENS, cuda)
    for static, new in zip(args, fresh):  # new data into the captured inputs
        if isinstance(static, torch.Tensor) and static.is_floating_point():
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    compare(name, out, DECLARED[name].reference(*args))


def test_fp4_index_queries_at_the_models_shape(sm90_ops, cuda):
    """The indexer rounds its queries as [S, 32 heads, 128] (groups of 32, ue8m0) and latents as [S, 512]."""
    torch.manual_seed(2)
    for shape, group, fmt in (((300, 32, 128), 32, "ue8m0"), ((300, 512), 16, "e4m3")):
        x = (torch.randn(*shape, device=cuda) * 3).to(torch.bfloat16)
        compare("fp4_act_qdq", sm90_ops.fp4_act_qdq(x, group, fmt), DECLARED["fp4_act_qdq"].reference(x, group, fmt))


def test_fp4_cache_round_trip_at_the_models_shape(sm90_ops, cuda):
    """Latents [S, 512] (groups of 16, e4m3) and index keys [S, 128] (groups of 32, ue8m0) packed into the cache and
    gathered back by storage rows out of order and repeated: the pack's bytes are the reference's, and what comes
    back is fp4_act_qdq's rounding of the same rows, bit for bit (-0 included)."""
    torch.manual_seed(3)
    for width, group, fmt in ((512, 16, "e4m3"), (128, 32, "ue8m0")):
        x = (torch.randn(300, width, device=cuda) * torch.logspace(-4, 2, 300, device=cuda)[:, None]).to(torch.bfloat16)
        codes, scales = sm90_ops.fp4_pack(x, group, fmt)
        compare("fp4_pack", (codes, scales), DECLARED["fp4_pack"].reference(x, group, fmt))
        rows = torch.randperm(300, device=cuda)[:200].view(8, 25)
        rows[:, 0] = rows[0, 0]
        got = sm90_ops.fp4_gather(codes, scales, rows, fmt, torch.bfloat16)
        want = DECLARED["fp4_act_qdq"].reference(x, group, fmt)[rows]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{fmt}: the round trip is not bit-exact"
