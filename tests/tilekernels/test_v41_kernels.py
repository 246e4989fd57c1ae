"""DeepSeek-V4.1's own ops (mHC mixes and collapse, FP4 activation rounding, candidate blocks, Engram lookup and
gate) through their TileLang kernels on the `c` target in fp32, against their references; ragged and odd widths
included (the c target's tiles are 64 columns, 16 blocks). The GPU run at V4.1 widths:
tests/gpu/test_v41_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch

from codegen.driver import record_run
from tilekernels.errors import ShapeError
from tilekernels.kernels import Recorder, kernel_table, table
from tilekernels.ops import (DECLARED, V41_OPS, candidate_blocks, engram_gate, engram_lookup, fp4_act_qdq,
                             hc_collapse, hc_mixes)
from tilekernels.quant import BlockQuantized

F = "float32"
# case -> (op, variant, rows); the inputs are the op's own `example(variant, rows, "cpu")`
CASES = {
    "hc_mixes": ("hc_mixes", hc_mixes.Variant(4, 64, 20, F), 5),
    "hc_mixes-ragged": ("hc_mixes", hc_mixes.Variant(3, 40, 3, F), 3),  # 120 stream columns: a partial chunk
    "hc_collapse": ("hc_collapse", hc_collapse.Variant(4, 64, F), 5),
    "hc_collapse-ragged": ("hc_collapse", hc_collapse.Variant(4, 100, F), 3),
    "fp4_act_qdq-e4m3": ("fp4_act_qdq", fp4_act_qdq.Variant(128, 16, "e4m3", F), 6),
    "fp4_act_qdq-e4m3-ragged": ("fp4_act_qdq", fp4_act_qdq.Variant(80, 16, "e4m3", F), 4),  # 5 groups, tiles of 4
    "fp4_act_qdq-ue8m0-ragged": ("fp4_act_qdq", fp4_act_qdq.Variant(96, 32, "ue8m0", F), 5),  # 3 groups, tiles of 2
    "candidate_blocks": ("candidate_blocks", candidate_blocks.Variant(4, 3), 5),
    "candidate_blocks-odd": ("candidate_blocks", candidate_blocks.Variant(3, 2), 7),  # blocks of 3, a ragged last
    "engram_gate": ("engram_gate", engram_gate.Variant(4, 64, F), 5),
    "engram_gate-odd": ("engram_gate", engram_gate.Variant(3, 20, F), 3),
    "engram_lookup-ue8m0": ("engram_lookup", engram_lookup.Variant(64, 32, "ue8m0", "fp8"), 5),
    "engram_lookup-fp32-scales": ("engram_lookup", engram_lookup.Variant(96, 32, "fp32", "fp8"), 3),
    "engram_lookup-plain": ("engram_lookup", engram_lookup.Variant(24, 0, "none", F), 3),
}


@pytest.fixture(scope="module")
def ops(c_kernel_cache):
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
    tensors): the recorder sees one kernel per op, with the variant of the inputs."""
    recorder = Recorder()
    ops = table(recorder)
    meta = torch.device("meta")
    for name in V41_OPS:
        _, variant, _ = next(c for c in CASES.values() if c[0] == name)
        args = DECLARED[name].example(variant, 4, "cpu")
        args = tuple(to_meta(a, meta) for a in args)
        getattr(ops, name)(*args)
    assert {(op, kernel) for op, kernel, _ in recorder.seen} == {(n, n) for n in V41_OPS}


def to_meta(a, meta):
    return a.to(meta) if isinstance(a, (torch.Tensor, BlockQuantized)) else a


@pytest.mark.parametrize("call, message", [
    (lambda ops: ops.fp4_act_qdq(torch.zeros(2, 48), 24, "e4m3"), "group must be one of"),
    (lambda ops: ops.fp4_act_qdq(torch.zeros(2, 40), 16, "e4m3"), "multiple of the FP4 group 16"),
    (lambda ops: ops.hc_collapse(torch.zeros(2, 4, 8), torch.zeros(2, 3)), "pre must be [2, 4]"),
    (lambda ops: ops.engram_gate(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 7), torch.zeros(4, 8),
                                 torch.zeros(4, 8), 1e-6), "got [2, 4, 8]/[2, 7]"),
    (lambda ops: ops.candidate_blocks(torch.zeros(2, 8), torch.zeros(2), 3, 65), "block_size must be 1..64"),
    (lambda ops: ops.engram_gate(*(torch.zeros(s) for s in ((1, 1, 9000), (1, 1, 9000), (1, 9000), (1, 9000),
                                                            (1, 9000))), 1e-6), "stream width 9000 is more than"),
])
def test_shapes_the_kernels_cannot_take_are_named(call, message, ops):
    with pytest.raises(ShapeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(ops)


@pytest.mark.parametrize("name", ["a", "b"])
def test_v41_fixture_through_the_new_kernels_matches_the_reference_path(name, ops):
    """The tiny V4.1 fixtures with the six ops on their c kernels (the rest on the reference): logits within the
    fixtures' own bounds (fp32 summation order; one rounding flip of the FP4/FP8 grids downstream at most)."""
    from tests.v41_fixture import assert_logits_close, fixture, run
    from tilekernels import reference_table
    from tilekernels.op import OpTable

    fx = fixture(name)
    mixed = OpTable({n: getattr(ops, n) if n in V41_OPS else d.reference for n, d in DECLARED.items()}, DECLARED)
    for got, want in zip(run(fx, mixed), run(fx, reference_table()), strict=True):
        assert_logits_close(got, want)
