"""FP8 activations and the block-scaled FP8 GEMM on TileLang's `c` target (the portable bodies, fp32):
act_quant's bytes equal torch's e4m3 cast, the GEMM equals its fp32 emulation (`linear_fp8.emulated`), and its
distance from the model's reference (unquantized activations) is the activations' FP8 rounding, bounded."""

from __future__ import annotations

import pytest
import torch

from tilekernels.kernels import kernel_table
from tilekernels.ops import act_quant, grouped_linear, linear, linear_fp8
from tilekernels.quant import BlockQuantized

F = "float32"


@pytest.fixture(scope="module")
def ops(c_kernel_cache, request):
    """The c kernels, those of the selected GEMM cases and act_quant variants built ahead by two workers
    (`tests.helpers.prebuild_c`). Not the quantized tiny model's: its whole plan (row buckets it never runs
    included) costs more to build ahead than the kernels it runs cost to build as it goes."""
    from tests.helpers import kernels_of, prebuild_c, selected

    items = [i for k, group, pow2 in selected(request, "k", "group", "pow2")
             for i in kernels_of("act_quant", act_quant.Variant(k, group, F, pow2), 9)]
    for case in selected(request, "case"):
        v, rows = CASES[case]
        items += kernels_of("grouped_linear" if v.groups > 1 else "linear", v, rows)
    prebuild_c(c_kernel_cache, items)
    return kernel_table("c", c_kernel_cache)


def test_encode_rounds_every_e4m3_value_and_midpoint_as_torch(ops):
    """Every finite e4m3 value, the midpoints between neighbours (ties to even) and values just off them: a
    group whose max is 448 gets scale 1 (a power of two), so the codes are the values' own bytes."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = grid[torch.isfinite(grid)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    values = torch.cat([finite, mids, mids * (1 + 1e-6), mids * (1 - 1e-6)])
    values = torch.cat([values, -values])
    group = 128
    rows = -(-values.numel() // (group - 1))
    body = torch.zeros(rows * (group - 1))
    body[: values.numel()] = values
    x = torch.cat([torch.full((rows, 1), 448.0), body.view(rows, group - 1)], dim=1)  # every group's max: 448
    codes, scales = ops.act_quant(x, group, True)
    want, want_scales = act_quant.reference(x, group, True)
    assert torch.equal(scales, torch.ones(rows, 1)) and torch.equal(want_scales, scales)
    assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(codes.float()[:, 1:].reshape(-1)[: finite.numel()], finite)


@pytest.mark.parametrize("k, group, pow2", [(256, 128, False), (100, 32, True), (64, 128, True)])
def test_act_quant_matches_reference(ops, k, group, pow2):
    args = act_quant.example(act_quant.Variant(k, group, F, pow2), 9, "cpu")
    codes, scales = ops.act_quant(*args)
    want_codes, want_scales = act_quant.reference(*args)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (9, -(-k // group))
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


# case -> (variant, rows): V4's 128x128 blocks, V4.1's 32x32 ue8m0 blocks, ragged N and K, split K, groups (K
# below the block and a scale block spanning two groups run in the tiny model below: TINY_A's o_a_proj)
CASES = {
    "v4-block": (linear_fp8.Variant(48, 256, F, (128, 128)), 37),
    "v41-block-ue8m0": (linear_fp8.Variant(40, 96, F, (32, 32), ue8m0=True), 5),
    "ragged-k": (linear_fp8.Variant(64, 200, F, (128, 128), ue8m0=True), 3),
    "split-k": (linear_fp8.Variant(32, 1024, F, (128, 128), ue8m0=True), 2),
    "grouped": (linear_fp8.Variant(64, 128, F, (32, 32), groups=2, ue8m0=True), 7),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_gemm_matches_its_emulation(ops, case):
    v, rows = CASES[case]
    torch.manual_seed(rows)
    op = grouped_linear if v.groups > 1 else linear
    x, w = op.example(v, rows, "cpu")
    assert isinstance(w, BlockQuantized) and w.format == "fp8"
    got = getattr(ops, op.OP.name)(x, w)
    emu = linear_fp8.emulated(x, w, v.groups)
    ref = op.reference(x, w)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, emu, atol=1e-5, rtol=1e-5)
    # the activations' e4m3 rounding: relative error <= 2^-4 per value, so the output moves by at most
    # 2^-4 * sum_k |x_k w_k| (and typically by ~2^-4 / sqrt(3) of the output's scale)
    w_dense = w.dequantize(torch.float32)
    if v.groups > 1:
        bound = torch.einsum("mgk,gnk->mgn", x.abs(), w_dense.abs().view(v.groups, -1, v.k)) / 16
    else:
        bound = x.abs() @ w_dense.abs().T / 16
    assert ((got - ref).abs() <= bound + 1e-6).all()
    if v.split_k > 1 or case == "split-k":
        assert linear_fp8.variant(rows, v.n, v.k, v.block, v.ue8m0).split_k > 1  # the run took the split path


def test_bad_fp8_inputs_are_named(ops):
    from tilekernels.errors import ShapeError

    v, _ = CASES["v4-block"]
    x, w = linear.example(v, 3, "cpu")
    with pytest.raises(ShapeError, match="x has 100 features, the FP8 weight expects 256"):
        ops.linear(torch.randn(3, 100), w)
    fp4 = BlockQuantized(torch.zeros(48, 128, dtype=torch.uint8), torch.ones(48, 8), (1, 32), "fp4")
    with pytest.raises(ShapeError, match="must be FP8, got fp4"):
        ops.linear(x, fp4)
    with pytest.raises(ShapeError, match="group must be 32, 64 or 128 columns, got 16"):
        ops.act_quant(x, 16, False)


@pytest.mark.full  # slow (CI time): `pytest -m full` (README.md, Run the tests)
def test_quantized_tiny_model_through_the_kernels_equals_its_w8a8_reference(ops, tmp_path):
    """The HF test config written as a V4 checkpoint (FP8 128x128 ue8m0: every K is below the block, o_a_proj's
    scale block spans both groups; FP4 experts), kept quantized: prefill and batched decode through the c-target
    kernels (act_quant, FP8 GEMM, FP4 experts) against the fp32 reference with the same activation rounding."""
    from deepinfer.config import ModelConfig
    from deepinfer.model.weights import ModelWeights
    from deepinfer.tiny import random_tensors
    from deepinfer.weights.loader import load_checkpoint
    from deepinfer.weights.synthetic import write_checkpoint
    from tests.helpers import TINY_A, Runner, w8a8_reference

    path = write_checkpoint(tmp_path / "q", TINY_A, random_tensors(ModelConfig.from_dict(TINY_A), seed=3), "hf")
    cfg = ModelConfig.from_model_dir(path)
    weights = ModelWeights.from_tensors(cfg, load_checkpoint(path, cfg, torch.float32, keep_quantized=True).tensors)
    assert isinstance(weights.layers[0].attn.q_a_proj, BlockQuantized)
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(0))

    def logits(table):
        run = Runner(cfg, weights, table, tokens=256, seqs=2)
        a, b = run.new_seq(), run.new_seq()
        out = [run.prefill(a, ids[:60]), run.prefill(b, ids[:9])]
        for i in range(60, 66):
            out.append(run.decode([a, b], [int(ids[i]), int(ids[i - 50])]))
        return torch.cat(out)

    want = logits(w8a8_reference())
    got = logits(ops)
    # equal up to fp32 summation order, except where that order moves an activation across an e4m3 rounding
    # boundary (one code step, 2^-3 of a value at most): rows untouched by such a flip agree to 1e-5, and a
    # flipped code moves the logits by far less than the W8A8 rounding itself (measured 0.2% of the largest)
    diff = (got - want).abs().amax(-1)
    scale = want.abs().max().item()
    assert (diff <= 1e-5 * scale).float().mean() >= 0.5
    assert diff.max().item() <= 1e-2 * scale


def test_act_quant_takes_the_row_tile_override_at_prefill_rows_and_whole_groups_only():
    """`run` picks the wide variant above WIDE_ROWS rows; NVIDIA targets take `act_quant_nvidia` for it when the
    groups tile K, the portable body otherwise (decode rows, a ragged last group, every other target)."""
    import dataclasses

    from tilekernels.ops import act_quant_nvidia

    def rows(m):
        return act_quant.variant(torch.empty(m, 4096, dtype=torch.bfloat16, device="meta"), 128, True)

    assert not rows(act_quant.WIDE_ROWS).wide and rows(act_quant.WIDE_ROWS + 1).wide
    wide = rows(4096)
    for target in ("sm90", "sm100"):
        assert act_quant.KERNEL.body_for(target, wide) is act_quant_nvidia.body
        assert act_quant.KERNEL.body_for(target, dataclasses.replace(wide, wide=False)) is act_quant.body
        assert act_quant.KERNEL.body_for(target, dataclasses.replace(wide, k=100, group=32)) is act_quant.body
    for target in ("ascend", "c"):
        assert act_quant.KERNEL.body_for(target, wide) is act_quant.body


def test_short_k_fp8_prefill_variants_take_the_persistent_warp_specialised_body(monkeypatch):
    """sm90's FP8 config sends prefill variants with K <= short_k (and 16-byte rows for its TMA copies) to `body_ws`
    at 128x128 tiles on 132 programs, chains of 4 K blocks, the output stored by TMA (q_b, q_a, the shared experts);
    longer K (o_b), grouped, narrow, V4.1's 32x32 blocks and odd K keep the others."""
    from tilekernels.ops import linear_fp8_sm90

    taken = []
    monkeypatch.setattr(linear_fp8_sm90, "body_ws", lambda P, v, cfg: taken.append(("ws", cfg)) or "ws")
    monkeypatch.setattr(linear_fp8_sm90, "body_sliced", lambda P, v, cfg: taken.append(("sliced", cfg)) or "sliced")
    monkeypatch.setattr(linear_fp8, "body_native", lambda P, v, cfg: taken.append(("native", cfg)) or "native")
    cfg = linear_fp8.KERNEL.config("sm90")
    q_b = linear_fp8.Variant(32768, 1024, "bfloat16", (128, 128), ue8m0=True)
    assert linear_fp8_sm90.body(None, q_b, cfg) == "ws"
    assert (taken[-1][1].programs, taken[-1][1].block_n, taken[-1][1].chain, taken[-1][1].tma_store) == (132, 128, 4, True)
    assert linear_fp8_sm90.body(None, linear_fp8.Variant(1024, 4096, "bfloat16", (128, 128), ue8m0=True), cfg) == "ws"
    import dataclasses

    others = {"long K": linear_fp8.Variant(4096, 8192, "bfloat16", (128, 128), ue8m0=True),
              "grouped": linear_fp8.Variant(1024, 1024, "bfloat16", (128, 128), groups=8, ue8m0=True),
              "narrow": dataclasses.replace(q_b, narrow=True),
              "V4.1 blocks": linear_fp8.Variant(4096, 2048, "bfloat16", (32, 32), ue8m0=True),
              "odd K": linear_fp8.Variant(144, 20, "bfloat16", (128, 128), ue8m0=True)}
    for name, v in others.items():
        assert linear_fp8_sm90.body(None, v, cfg) != "ws", name


def test_a_quantized_slice_decode_step_quantizes_the_activations_of_every_fp8_projection_once():
    """`benchmarks/decode_launches.py --quantized` on the V4-Flash slice: every FP8 GEMM of a decode step has its
    own act_quant launch (the count a fusion of the two would remove), and the routed experts run the FP4 kernels."""
    from benchmarks.decode import SLICE
    from benchmarks.decode_launches import count

    q, plain = count(SLICE, 1, False, quantized=True), count(SLICE, 1, False)
    assert q[("act_quant", "act_quant")] == q[("linear", "gemm_fp8")] > 0
    assert ("act_quant", "act_quant") not in plain and ("linear", "gemm_fp8") not in plain
    assert not any(op == "moe_experts" and kernel == "grouped_gemm" for op, kernel in q)
    assert any(op == "moe_experts" and kernel.startswith("grouped_gemm_fp4") for op, kernel in q)
