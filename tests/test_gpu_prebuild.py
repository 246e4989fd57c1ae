"""tools/gpu_prebuild.py plans the kernels of its tags (built on the GPU host; here only the plan) and names the
accepted tags for an unknown one."""

from __future__ import annotations

import pytest

from deepinfer.compile.plan import kernel_plan
from deepinfer.tiny import tiny_config
from tools.gpu_prebuild import items_for


def test_default_is_the_embedded_models_plan_in_both_modes():
    items = items_for("default")
    cfg = tiny_config()
    assert set(items) == set(kernel_plan(cfg, "bfloat16")) | set(kernel_plan(cfg, "bfloat16", invariant=True))


def test_an_unknown_tag_names_the_accepted_ones():
    with pytest.raises(ValueError, match="unknown tag 'tiny1'.*default, tiny, tinyq"):
        items_for("tiny1")


def test_kernels_tag_covers_every_op_the_kernel_tests_run():
    """Every V4-Flash op `tests/gpu/test_kernels_gpu.py` parametrizes has a variant there (a missing one fails that
    test on the GPU host with a KeyError) and kernels in the `kernels` tag, at its decode and prefill sizes."""
    from tests.gpu.test_kernels_gpu import flash_ops, flash_variants

    assert set(flash_ops()) <= set(flash_variants()), set(flash_ops()) - set(flash_variants())
    ops = {op for op, _, _ in items_for("kernels")}
    # the grouped projection and the unweighted norm run as `linear` and `rms_norm` kernels
    assert {"grouped_linear", "rms_norm_unweighted"} | ops >= set(flash_ops())
    moe = [v for op, _, v in items_for("kernels") if op == "moe_experts"]
    assert any(getattr(v, "fp4", False) for v in moe) and any(not getattr(v, "fp4", False) for v in moe)


def test_the_quantized_slice_tag_plans_the_fp8_and_fp4_kernels():
    """`qslice` is the slice as `benchmarks/decode.py --quantized` makes it (V4's formats declared on its config): its
    FP8 projections and FP4 experts, which the bf16 slice's plan lacks."""
    kernels = {(op, kernel) for op, kernel, _ in items_for("qslice")}
    assert {("linear", "gemm_fp8"), ("act_quant", "act_quant")} <= kernels
    assert any(op == "moe_experts" and "fp4" in kernel for op, kernel in kernels)
    assert ("linear", "gemm_fp8") not in {(op, kernel) for op, kernel, _ in items_for("slice")}


def test_the_gemm_tag_plans_what_the_gemm_tests_launch():
    """`gemm`: the bf16 prefill variants of `tests/gpu/test_linear_sm90_gpu.py` (its ragged row counts included), the
    grouped swapped decode variant, and the FP8 GEMMs of `tests/gpu/test_fp8_gpu.py` at every row bucket and both scale
    formats, with the activations' quantization."""
    from tests.gpu import test_linear_sm90_gpu as bf16_tests
    from tilekernels.ops import linear, linear_fp8

    items = items_for("gemm")
    gemms = {v for op, kernel, v in items if (op, kernel) == ("linear", "gemm")}
    assert {linear.variant(m, n, k) for n, k in bf16_tests.SHAPES for m in bf16_tests.ROWS} <= gemms
    assert linear.variant(5, 1024, 4096, 8) in gemms
    fp8 = [v for op, kernel, v in items if kernel == "gemm_fp8"]
    assert linear_fp8.variant(4096, 32768, 1024, (128, 128), True) in fp8  # the short-K prefill body
    assert any(v.narrow for v in fp8) and any(v.split_k > 1 for v in fp8) and any(v.groups == 8 for v in fp8)
    assert {v.block for v in fp8} == {(128, 128), (32, 32)} and {v.ue8m0 for v in fp8} == {True, False}
    assert any(op == "act_quant" for op, _, _ in items)


def test_the_ranks_tag_plans_each_parallel_gpu_tests_layout(monkeypatch):
    """`ranks`: the rank plans of `tests/gpu/test_parallel_gpu.py`'s layouts on TINY_A (8 experts; two of its
    layouts here, each plan a trace of seconds): 4 expert slots a rank where the experts are split over 2, all 8
    where not, half the query heads with tensor parallelism."""
    import tests.gpu.test_parallel_gpu as gpu_tests

    monkeypatch.setattr(gpu_tests, "LAYOUTS", {k: gpu_tests.LAYOUTS[k] for k in ("dp2+ep", "tp2")})
    items = items_for("ranks")
    assert {v.experts for op, _, v in items if op == "moe_experts" and hasattr(v, "experts")} == {4, 8}
    assert {v.heads for op, _, v in items if op == "rope" and v.norm} == {2, 4}
