"""DeepSeek-V4.1's own ops (mHC mixes and collapse, FP4 activation rounding, FP4 cache packing and gathering,
candidate blocks, Engram lookup and gate) through their TileLang kernels on the `c` target in fp32, against their
references; ragged and odd widths included (the c target's tiles are 64 columns, 16 blocks). The GPU run at V4.1
widths: tests/gpu/test_v41_kernels_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

from codegen.driver import record_run
from tilekernels.errors import ShapeError
from tilekernels.kernels import Recorder, kernel_table, table
from tilekernels.ops import (DECLARED, V41_OPS, candidate_blocks, engram_gate, engram_lookup, fp4_act_qdq, fp4_gather,
                             fp4_pack, hc_collapse, hc_mixes, indexer_scores_fp4)
from tilekernels.quant import BlockQuantized

F = "float32"
# case -> (op, variant, rows); the inputs are the op's own `example(variant, rows, "cpu")`
CASES = {
    "hc_mixes": ("hc_mixes", hc_mixes.Variant(4, 64, 20, F), 5),
    "hc_mixes-ragged": ("hc_mixes", hc_mixes.Variant(3, 40, 3, F), 3),  # 120 stream columns: a partial chunk
    "hc_mixes-split": ("hc_mixes", hc_mixes.Variant(4, 512, 20, F), 3),  # 2048 columns, 3 rows: 4 parts of 8 chunks
    "hc_mixes-split-ragged": ("hc_mixes", hc_mixes.Variant(3, 520, 3, F), 2),  # 4 parts of 7 chunks, 24.4 used
    "hc_collapse": ("hc_collapse", hc_collapse.Variant(4, 64, F), 5),
    "hc_collapse-ragged": ("hc_collapse", hc_collapse.Variant(4, 100, F), 3),
    "fp4_act_qdq-e4m3": ("fp4_act_qdq", fp4_act_qdq.Variant(128, 16, "e4m3", F), 6),
    "fp4_act_qdq-e4m3-ragged": ("fp4_act_qdq", fp4_act_qdq.Variant(80, 16, "e4m3", F), 4),  # 5 groups, tiles of 4
    "fp4_act_qdq-ue8m0-ragged": ("fp4_act_qdq", fp4_act_qdq.Variant(96, 32, "ue8m0", F), 5),  # 3 groups, tiles of 2
    "fp4_pack-e4m3-ragged": ("fp4_pack", fp4_pack.Variant(80, 16, "e4m3", F), 4),  # 5 groups, tiles of 4
    "fp4_pack-ue8m0": ("fp4_pack", fp4_pack.Variant(64, 32, "ue8m0", F), 5),  # whole tiles: copies in and out
    "fp4_gather-e4m3": ("fp4_gather", fp4_gather.Variant(80, 16, "e4m3", F), 4),  # a row per tile
    "fp4_gather-ue8m0": ("fp4_gather", fp4_gather.Variant(64, 32, "ue8m0", F), 5),  # 2 rows per tile, a masked one
    "candidate_blocks": ("candidate_blocks", candidate_blocks.Variant(4, 3), 5),
    "candidate_blocks-odd": ("candidate_blocks", candidate_blocks.Variant(3, 2), 7),  # blocks of 3, a ragged last
    "engram_gate": ("engram_gate", engram_gate.Variant(4, 64, F), 5),
    "engram_gate-odd": ("engram_gate", engram_gate.Variant(3, 20, F), 3),
    "engram_lookup-ue8m0": ("engram_lookup", engram_lookup.Variant(64, 32, "ue8m0", "fp8"), 5),
    "engram_lookup-fp32-scales": ("engram_lookup", engram_lookup.Variant(96, 32, "fp32", "fp8"), 3),
    "engram_lookup-plain": ("engram_lookup", engram_lookup.Variant(24, 0, "none", F), 3),
    "indexer_scores_fp4": ("indexer_scores_fp4", indexer_scores_fp4.Variant(4, 64, F, False), 3),
    "indexer_scores_fp4-shared": ("indexer_scores_fp4", indexer_scores_fp4.Variant(4, 64, F, True, 4, 64), 3),
}


@pytest.fixture(scope="module")
def ops(c_kernel_cache, request):
    """The c kernels, those of the selected cases and fixtures (their plans' V4.1 and pooling kernels) built
    ahead by two workers (`tests.helpers.prebuild_c`)."""
    from deepinfer.compile.plan import kernel_plan
    from tests.helpers import kernels_of, prebuild_c, selected
    from tests.v41_fixture import fixture

    items = [item for case in selected(request, "case") for item in kernels_of(*CASES[case])]
    for name in selected(request, "name"):
        items += [i for i in kernel_plan(fixture(name).cfg, "float32") if i[0] in {*V41_OPS, "compress_pool"}]
    prebuild_c(c_kernel_cache, items)
    return kernel_table("c", c_kernel_cache)


def test_every_v41_op_has_a_kernel_and_a_case():
    assert {name for name in V41_OPS if DECLARED[name].run is not None} == set(V41_OPS)
    assert {op for op, _, _ in CASES.values()} == set(V41_OPS)


def check(name, got, want):
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    atol, rtol = DECLARED[name].tolerance["float32"]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.dtype == torch.bool:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference_in_fp32(case, ops, c_kernel_cache):
    name, variant, rows = CASES[case]
    torch.manual_seed(rows)
    args = DECLARED[name].example(variant, rows, "cpu")
    check(name, getattr(ops, name)(*args), DECLARED[name].reference(*args))
    record_run(c_kernel_cache, name, "c", "fp32 on TileLang's c target matched the reference")


def test_fp4_rounds_every_e2m1_value_and_midpoint(ops):
    """Every e2m1 magnitude, the midpoints between neighbours (ties to the even code) and values just off them,
    both signs, in groups whose max is 6 (scale 1 in both formats); also through a [S, heads, D] input."""
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = (mags[1:] + mags[:-1]) / 2
    values = torch.cat([mags, mids, mids * (1 + 1e-6), mids * (1 - 1e-6)])
    values = torch.cat([values, -values])
    for k, group, fmt in ((80, 16, "e4m3"), (96, 32, "ue8m0")):
        per = group - 1
        groups = -(-values.numel() // per)
        body = torch.nn.functional.pad(values, (0, groups * per - values.numel())).view(groups, per)
        x = torch.cat([torch.full((groups, 1), 6.0), body], 1).flatten()
        x = torch.nn.functional.pad(x, (0, -x.numel() % k)).view(-1, k)
        check("fp4_act_qdq", ops.fp4_act_qdq(x, group, fmt), fp4_act_qdq.reference(x, group, fmt))
        x3 = torch.randn(3, 2, k) * 10
        check("fp4_act_qdq", ops.fp4_act_qdq(x3, group, fmt), fp4_act_qdq.reference(x3, group, fmt))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("k, group, fmt", [(80, 16, "e4m3"), (64, 32, "ue8m0")])
def test_fp4_gather_of_fp4_pack_is_fp4_act_qdq_bit_for_bit(k, group, fmt, ops):
    """What the cache stores and gives back is what fp4_act_qdq rounds to, -0 included: through the c kernels
    (the variants of CASES) from a [S, heads, K] input, gathered by [2, 3] row ids out of order and repeated; and
    through the references in bf16."""
    x = torch.randn(4, 2, k) * torch.logspace(-8, 2, 4)[:, None, None]
    x[0, 0, :group] = -1e-3 * torch.rand(group)  # negatives that round to -0 (code 8) next to a 6 (scale 1)
    x[0, 0, 0] = 6.0
    x[1, 1, :8] = torch.tensor([6.0, -0.25, 0.75, -1.25, 1.75, -2.5, 3.5, -5.0])  # e2m1 ties, both signs
    codes, scales = ops.fp4_pack(x, group, fmt)
    assert codes.shape == (4, 2, k // 2) and scales.shape == (4, 2, k // group)
    assert codes[0, 0, 0] == 0x87 and (codes[0, 0, 1 : group // 2] == 0x88).all()  # (6, -0), then (-0, -0)
    ids = torch.tensor([[7, 0, 3], [3, 5, 7]])
    got = ops.fp4_gather(codes.view(8, -1), scales.view(8, -1), ids, fmt, torch.float32)
    want = fp4_act_qdq.reference(x, group, fmt).view(8, k)[ids]
    assert torch.equal(bits(got), bits(want))
    xb = x.to(torch.bfloat16)
    cb, sb = fp4_pack.reference(xb, group, fmt)
    gb = fp4_gather.reference(cb.view(8, -1), sb.view(8, -1), ids, fmt, torch.bfloat16)
    assert torch.equal(bits(gb), bits(fp4_act_qdq.reference(xb, group, fmt).view(8, k)[ids]))


def test_candidate_ties_go_to_the_lower_block(ops):
    """Equal block maxima: the newest block, then the lowest ones (torch.topk leaves ties unspecified); a query
    seeing nothing keeps nothing; more than the top-k of finite blocks, fewer, and one block of +inf and -inf."""
    e, bs, k = 20, 4, 3  # 5 blocks, the last one full
    scores = torch.zeros(3, e)
    visible = torch.tensor([20, 0, 10])
    scores[1] = float("-inf")
    scores[2, 10:] = float("-inf")
    scores[2, 4] = float("inf")
    keep = ops.candidate_blocks(scores, visible, k, bs).view(3, 5, bs)
    assert keep.all(-1).eq(keep.any(-1)).all()  # whole blocks
    assert keep[:, :, 0].tolist() == [[True, True, False, False, True], [False] * 5, [True, True, True, False, False]]


def test_v41_ops_run_on_meta_tensors():
    """Each `run` validates and launches without reading a value (the compile plan traces the model on meta
    tensors): the recorder sees each op's kernels (hc_mixes: its partials and its finish), with the variant of the
    inputs."""
    recorder = Recorder()
    ops = table(recorder)
    meta = torch.device("meta")
    for name in V41_OPS:
        _, variant, _ = next(c for c in CASES.values() if c[0] == name)
        args = DECLARED[name].example(variant, 4, "cpu")
        args = tuple(to_meta(a, meta) for a in args)
        getattr(ops, name)(*args)
    expected = {(n, k.name) for n in V41_OPS for k in DECLARED[n].kernels}
    assert {(op, kernel) for op, kernel, _ in recorder.seen} == expected


def to_meta(a, meta):
    return a.to(meta) if isinstance(a, (torch.Tensor, BlockQuantized)) else a


def fp4_store(n: int, code_bytes: int, scales: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, code_bytes, dtype=torch.uint8), torch.zeros(n, scales, dtype=torch.uint8)


@pytest.mark.parametrize("call, message", [
    (lambda ops: ops.fp4_act_qdq(torch.zeros(2, 48), 24, "e4m3"), "group must be one of"),
    (lambda ops: ops.fp4_act_qdq(torch.zeros(2, 40), 16, "e4m3"), "multiple of the FP4 group 16"),
    (lambda ops: ops.fp4_pack(torch.zeros(2, 40), 16, "e4m3"), "multiple of the FP4 group 16"),
    (lambda ops: ops.fp4_pack(torch.zeros(2, 48), 24, "e4m3"), "group must be one of"),
    (lambda ops: ops.fp4_pack(torch.zeros(2, 32), 32, "fp8"), "scale format 'fp8' is not one of"),
    (lambda ops: ops.fp4_pack(torch.zeros(2, 32, dtype=torch.int32), 32, "ue8m0"), "x must be one of"),
    (lambda ops: ops.fp4_gather(torch.zeros(4, 8), torch.zeros(4, 1, dtype=torch.uint8), torch.zeros(2).long(),
                                "e4m3", torch.float32), "codes and scales must be uint8"),
    (lambda ops: ops.fp4_gather(*fp4_store(4, 20, 3), torch.zeros(2).long(), "e4m3", torch.float32),
     "code bytes per row 20 (K / 2) must be a multiple of the scales per row 3"),
    (lambda ops: ops.fp4_gather(*fp4_store(4, 24, 2), torch.zeros(2).long(), "e4m3", torch.float32),
     "group (K / scales per row = 48 / 2) must be one of"),
    (lambda ops: ops.fp4_gather(*fp4_store(4, 32, 2), torch.zeros(2).long(), "e2m1", torch.float32),
     "scale format 'e2m1' is not one of"),
    (lambda ops: ops.fp4_gather(*fp4_store(4, 32, 2), torch.zeros(2), "e4m3", torch.float32), "rows must be int64"),
    (lambda ops: ops.hc_collapse(torch.zeros(2, 4, 8), torch.zeros(2, 3)), "pre must be [2, 4]"),
    (lambda ops: ops.engram_gate(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 7), torch.zeros(4, 8),
                                 torch.zeros(4, 8), 1e-6), "got [2, 4, 8]/[2, 7]"),
    (lambda ops: ops.candidate_blocks(torch.zeros(2, 8), torch.zeros(2), 3, 65), "block_size must be 1..64"),
    (lambda ops: ops.engram_gate(*(torch.zeros(s) for s in ((1, 1, 9000), (1, 1, 9000), (1, 9000), (1, 9000),
                                                            (1, 9000))), 1e-6), "stream width 9000 is more than"),
])
def test_shapes_the_kernels_cannot_take_are_named(call, message, ops):
    """(No kernel is built: `run` rejects the inputs first.)"""
    with pytest.raises(ShapeError, match=re.escape(message)):
        call(ops)


@pytest.mark.parametrize("name", ["a", "b"])
def test_v41_fixture_through_the_new_kernels_matches_the_reference_path(name, ops):
    """The tiny V4.1 fixtures with V4.1's own ops and the compressor's pooling (ratio 2, fp32: compress_pool) on
    their c kernels (the rest on the reference): logits within the fixtures' own bounds (fp32 summation order; one
    rounding flip of the FP4/FP8 grids downstream at most)."""
    from tests.v41_fixture import assert_logits_close, fixture, run
    from tilekernels import reference_table
    from tilekernels.op import OpTable

    fx = fixture(name)
    on_kernels = set(V41_OPS) | {"compress_pool"}
    mixed = OpTable({n: getattr(ops, n) if n in on_kernels else d.reference for n, d in DECLARED.items()}, DECLARED)
    for got, want in zip(run(fx, mixed), run(fx, reference_table()), strict=True):
        assert_logits_close(got, want)
