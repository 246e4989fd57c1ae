"""The GEMM kernels (linear, grouped_linear, moe_experts) take every N and K a DeepSeek-V4 config can produce:
ragged edges are masked, not refused. Numerics run fp32 on TileLang's `c` target through each op's `run` and
`example`; the edge test calls the kernel on NaN-guarded buffers to show that out-of-range K columns read as
zero and out-of-range outputs are not written; a few representative variants lower for sm_90a, sm_100a and
Ascend (compile only here)."""

from __future__ import annotations


import pytest
import torch

import backends
from codegen import Compiler
from tilekernels.kernels import Launcher, kernel_table, request
from tilekernels.ops import DECLARED, grouped_linear, linear, moe_experts

LINEAR = [(20, 48), (144, 20), (48, 24), (6, 48), (36, 48), (48, 18), (301, 48), (36, 20), (3, 48), (28, 40),
          (100, 28), (20, 40), (40, 30), (5, 40), (40, 14), (257, 40), (40, 40), (50, 28)]
GROUPED = [(2, 12, 72), (5, 6, 20)]  # (groups, n, k)
EXPERTS = [(36, 48, 6), (48, 18, 6), (28, 40, 5), (40, 14, 5)]  # (n = 2I, k = H, experts) of gate_up / down
ROWS = (1, 3, 17, 65, 300)  # both row buckets the c target sees (narrow up to 64 rows, wide above)
TOL = DECLARED["linear"].tolerance["float32"]
C_TARGET = "c"  # TileLang's c target
F = "float32"


@pytest.fixture(scope="module")
def cache(tmp_path_factory, request):
    """A kernel cache with the c kernels of the selected shape and ragged-edge tests (every row bucket) built
    ahead by two workers (`tests.helpers.prebuild_c`): each test then loads them built."""
    from tests.helpers import kernels_of, prebuild_c, selected

    path = tmp_path_factory.mktemp("gemm-shapes")
    items = []
    for n, k, e in selected(request, "n", "k", "experts"):
        items += [i for rows in (1, 17, 65) for i in kernels_of("moe_experts", moe_experts.variant(n, k, e, F), rows)]
    for groups, n, k in selected(request, "groups", "n", "k"):
        if (groups, n, k) in GROUPED:
            items += [i for rows in ROWS for i in kernels_of("grouped_linear", linear.variant(rows, n, k, groups, F),
                                                               rows)]
    for n, k in selected(request, "n", "k"):
        if (n, k) in LINEAR:
            items += [i for rows in ROWS for i in kernels_of("linear", linear.variant(rows, n, k, 1, F), rows)]
    # the ragged-edge test's variants (it launches them directly): split K and groups, not shapes' `run` variants
    items += [("linear", "gemm", linear.Variant(n, k, F, groups=groups, split_k=split))
              for n, k, groups, split in selected(request, "n", "k", "groups", "split")]
    prebuild_c(path, items)
    return path


@pytest.fixture(scope="module")
def ops(cache):
    return kernel_table(C_TARGET, cache)


@pytest.fixture(scope="module")
def launch(cache):
    return Launcher(Compiler(backends.get(C_TARGET), cache)).for_op("linear")


def close(got, want, tol=TOL):
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize("n, k", LINEAR, ids=lambda s: str(s))
def test_linear_any_shape(n, k, ops):
    torch.manual_seed(n * 1000 + k)
    for rows in ROWS:
        args = linear.example(linear.variant(rows, n, k, 1, "float32"), rows, "cpu")
        close(ops.linear(*args), linear.reference(*args))


@pytest.mark.parametrize("groups, n, k", GROUPED, ids=lambda s: str(s))
def test_grouped_linear_any_shape(groups, n, k, ops):
    torch.manual_seed(groups * 1000 + n)
    for rows in ROWS:
        args = grouped_linear.example(linear.variant(rows, n, k, groups, "float32"), rows, "cpu")
        close(ops.grouped_linear(*args), grouped_linear.reference(*args))


@pytest.mark.parametrize("n, k, experts", EXPERTS, ids=lambda s: str(s))
def test_moe_experts_any_shape(n, k, experts, ops):
    torch.manual_seed(n + k + experts)
    tol = DECLARED["moe_experts"].tolerance["float32"]
    for rows in (1, 17, 65):
        args = moe_experts.example(moe_experts.variant(n, k, experts, "float32"), rows, "cpu")
        close(ops.moe_experts(*args), moe_experts.reference(*args), tol)


def guarded(shape, fill=float("nan")):
    """A contiguous tensor of `shape` followed in memory by a guard region of `fill`: a read past its end sees
    NaN, a write past its end changes the guard."""
    numel = 1
    for s in shape:
        numel *= s
    storage = torch.full((numel + 4096,), fill)
    return storage[:numel].view(shape), storage[numel:]


@pytest.mark.parametrize("n, k, groups, split", [
    (20, 40, 1, 1), (301, 48, 1, 1), (40, 14, 1, 1),  # ragged N and/or K in one tile, several tiles
    (20, 40, 1, 3), (144, 20, 1, 2),  # split K: the last slice runs past K
    (12, 72, 2, 1), (6, 20, 5, 2), (12, 72, 2, 5),  # groups: an edge must not reach the next group
], ids=str)
def test_ragged_edges_are_zero_filled_and_masked(n, k, groups, split, launch):
    """The kernel called directly on NaN-guarded inputs: reads past K (or past the last row) would bring NaN
    into the sums, writes past N (or into the next group) would change the guard or a neighbour's outputs."""
    torch.manual_seed(n + k + groups + split)
    v = linear.Variant(n, k, "float32", groups=groups, split_k=split)
    for rows in (3, 17):
        a, _ = guarded((rows, groups, k) if groups > 1 else (rows, k))
        w, _ = guarded((groups, n, k) if groups > 1 else (n, k))
        a.copy_(torch.randn(a.shape))
        w.copy_(torch.randn(w.shape) / k**0.5)
        out_shape = ((split,) if split > 1 else ()) + (rows,) + ((groups,) if groups > 1 else ()) + (n,)
        c, guard = guarded(out_shape, fill=12345.0)
        launch("gemm", v)(a, w, c)
        assert torch.all(guard == 12345.0), "the kernel wrote past its output"
        got = c.sum(0) if split > 1 else c
        want = torch.einsum("mgk,gnk->mgn", a.view(rows, groups, k), w.view(groups, n, k)).view(got.shape)
        close(got, want)


class Recorder:
    """A launcher on meta tensors: records (op, kernel, variant) and returns a no-op kernel."""

    def __init__(self, calls=None, op="linear"):
        self.calls, self.name = ([] if calls is None else calls), op

    def __call__(self, kernel, variant):
        self.calls.append((self.name, kernel, variant))
        return lambda *args: None

    def op(self, name):
        return Recorder(self.calls, name)


def test_run_works_on_meta_tensors_and_launches_the_variant_function():
    rec = Recorder()
    y = linear.run(rec, *linear.example(linear.Variant(20, 48, "bfloat16"), 5, "meta"))
    assert y.shape == (5, 20) and y.device.type == "meta"
    y = grouped_linear.run(rec.op("grouped_linear"), *grouped_linear.example(
        linear.Variant(6, 20, "bfloat16", groups=5), 300, "meta"))
    assert y.shape == (300, 5, 6)
    y = moe_experts.run(rec.op("moe_experts"), *moe_experts.example(moe_experts.variant(36, 48, 6, "bfloat16"), 17,
                                                                    "meta"))
    assert y.shape == (17, 48)
    gemms = [c for c in rec.calls if c[1] in ("gemm", "grouped_gemm")]
    assert gemms == [
        ("linear", "gemm", linear.variant(5, 20, 48, 1, "bfloat16")),
        ("linear", "gemm", linear.variant(300, 6, 20, 5, "bfloat16")),
        ("moe_experts", "grouped_gemm", moe_experts.variant(36, 48, 6, "bfloat16", tokens=17)),  # decode: 16-row tiles
        ("moe_experts", "grouped_gemm", moe_experts.variant(48, 18, 6, "bfloat16", tokens=17)),
    ]
    assert gemms[-1][2].block_m == moe_experts.DECODE_BLOCK_M


def test_expert_tiles_by_size_and_format():
    """bf16 experts past DECODE_TOKENS take PREFILL_BLOCK_M-row tiles (sm_90a: the TMA + wgmma override, every
    other target the portable body), fp32 and FP4 ones BLOCK_M; the layout the op builds follows the variant."""
    from tilekernels.ops import moe_bf16_prefill_sm90

    kernel = moe_experts.KERNEL
    prefill = moe_experts.variant(4096, 4096, 256, "bfloat16", tokens=moe_experts.DECODE_TOKENS + 1)
    assert prefill.block_m == moe_experts.PREFILL_BLOCK_M == 128
    assert kernel.body_for("sm90", prefill) is moe_bf16_prefill_sm90.body
    assert all(kernel.body_for(t, prefill) is kernel.body for t in ("sm100", "ascend", "c"))
    fp32 = moe_experts.variant(4096, 4096, 256, "float32", tokens=moe_experts.DECODE_TOKENS + 1)
    assert fp32.block_m == moe_experts.BLOCK_M and kernel.body_for("sm90", fp32) is kernel.body
    assert moe_experts.variant(4096, 4096, 256, "bfloat16", fp4=True, tokens=4096).block_m == moe_experts.BLOCK_M
    rec = Recorder()
    args = moe_experts.example(moe_experts.variant(36, 48, 6, "bfloat16"), 100, "meta")
    moe_experts.run(rec.op("moe_experts"), *args)
    assert {c[2].block_m for c in rec.calls if c[1] == "grouped_gemm"} == {moe_experts.PREFILL_BLOCK_M}
    with pytest.raises(ValueError, match="bf16 tiles of"):
        moe_bf16_prefill_sm90.body(None, fp32)


def test_v4_flash_shapes_keep_their_tiles():
    """Edge handling changes no tile of a shape that divides it (the sm90 tiles are the tuned ones)."""
    sm90, sm100 = linear.KERNEL.config("sm90"), linear.KERNEL.config("sm100")
    assert linear.shape(linear.variant(4096, 32768, 1024), sm90) == (256, 128, 256, 64, 16)
    assert linear.shape(linear.variant(4096, 1024, 4096, 8), sm90) == (256, 128, 8, 64, 64)
    assert linear.shape(linear.variant(1, 1024, 4096), sm90) == (64, 64, 16, 64, 4)  # narrow, split 16
    assert linear.variant(1, 1024, 4096).split_k == 16
    assert linear.shape(linear.variant(4096, 129280, 4096), sm100) == (128, 128, 1010, 64, 64)
    assert linear.variant(300, 20, 48) == linear.Variant(20, 48, "bfloat16")  # ragged K never splits


def cuda_source_only(name):
    from backends.nvidia import without_library

    return without_library(backends.get(name))


LOWERED = [
    ("linear", "gemm", linear.Variant(40, 14, "bfloat16", narrow=True)),
    ("linear", "gemm", linear.Variant(6, 20, "bfloat16", groups=5)),
    ("linear", "gemm", linear.Variant(8, 64, "bfloat16", narrow=True)),  # sm_100a: 64-row tcgen05 needs N % 64
    ("linear", "gemm", linear.Variant(32, 128, "bfloat16", groups=2, narrow=True)),
    ("moe_experts", "grouped_gemm", moe_experts.variant(48, 18, 6, "bfloat16")),
]


@pytest.mark.parametrize("case", LOWERED, ids=lambda c: f"{c[0]}-{c[2]}")
def test_ragged_variants_build_cubins_with_tensor_cores(case, cache):
    for name in ("sm90", "sm100"):
        art = Compiler(cuda_source_only(name), cache).get(request(*case))
        source = art.file("cuda").read_text()
        assert ("wgmma" in source) if name == "sm90" else ("tcgen05" in source), f"{name}: no tensor-core MMA"
        cubin = art.file("cubin")
        assert cubin is not None and cubin.read_bytes()[:4] == b"\x7fELF", f"{name}: no cubin"
    # Ascend: tests/compile/test_every_config_lowers.py lowers every ragged GEMM of the odd configs (traps checked)


def test_tune_trials_parse_their_fields_and_name_a_bad_one():
    """A benchmark sweep's kernel name "<kernel>@field=value,..." replaces those fields of the tile; an unknown field
    or a non-integer value is refused naming it and the fields there are."""
    from tilekernels.op import tuned
    from tilekernels.ops import moe_bf16_prefill_sm90 as pre

    assert tuned(pre.TUNE, "block_n=128,stages=4") == pre.Tune(block_n=128, stages=4)
    assert tuned(pre.TUNE, "") == pre.TUNE
    with pytest.raises(ValueError, match=r"'blockn=128'.*field of \['block_n'"):
        tuned(pre.TUNE, "blockn=128")
    with pytest.raises(ValueError, match="'stages=x'"):
        tuned(pre.TUNE, "stages=x")


def test_a_tune_trial_request_builds_the_override_with_its_tile():
    """`kernels.tune_request`: "<kernel>@<fields>" builds the override's body with those fields of its tile (and
    the target's dependent-launch wait, as the engine's kernel); a plain name is the op's own request; a bad field
    is refused before anything is built."""
    from tilekernels.kernels import tune_request
    from tilekernels.ops import hc_mixes_sm90, hc_pre

    v = hc_pre.Variant(4, 4096, 20, "bfloat16", 32)
    seen = []

    def body(P, variant, cfg, tune):
        seen.append((variant, cfg, tune))
        return "func"

    req = tune_request("hc_pre", "hc_pre_split@stages=3,block_k=128", v, body, hc_mixes_sm90.TUNE, {"key": 1})
    assert req.kernel == "hc_pre_split@stages=3,block_k=128" and req.pass_configs(None) == {"key": 1}
    target = backends.get("c")  # no dependent launch: the body's function as it is
    assert req.build(target) == "func"
    assert seen == [(v, None, hc_mixes_sm90.Tune(stages=3, block_k=128))]
    assert tune_request("hc_pre", "hc_pre_split", v, body, hc_mixes_sm90.TUNE).kernel == "hc_pre_split" and not seen[1:]
    with pytest.raises(ValueError, match="'stage=3'"):
        tune_request("hc_pre", "hc_pre_split@stage=3", v, body, hc_mixes_sm90.TUNE)
    # "@portable": the portable body with the given config, where the override names one
    req = tune_request("hc_pre", "hc_pre_split@portable", v, body, hc_mixes_sm90.TUNE, cfg="sm90 cfg",
                       portable=lambda P, variant, cfg: seen.append((variant, cfg)) or "portable")
    assert req.build(target) == "portable" and seen[-1] == (v, "sm90 cfg")


def test_the_two_cta_linear_trials_cap_registers_and_drop_warp_specialisation_where_named():
    """`benchmarks/tune_linear.py`'s two-CTA candidates: `min_blocks` puts the occupancy hint and no setmaxnreg
    reallocation into the override's kernel; the `-nows` ones also build without the producer warpgroup (a pass
    config); the engine's own tile (`current`) has neither."""
    from benchmarks.tune_linear import candidate_request, kernel_name

    v, sm90 = linear.variant(4096, 32768, 1024), backends.get("sm90")
    seen = {}
    for label in ("big-128x128x64-s3-w8-stc-2cta-nows", "big-64x128x64-s4-w8-stc-2cta", "current"):
        req = candidate_request("linear", kernel_name(label), v)
        script = req.build(sm90).script()
        seen[label] = ("min_blocks_per_sm" in script, "no_set_max_nreg" in script,
                       req.pass_configs(sm90).get("tl.disable_warp_specialized", False))
    assert seen == {"big-128x128x64-s3-w8-stc-2cta-nows": (True, True, True),
                    "big-64x128x64-s4-w8-stc-2cta": (True, True, False), "current": (False, False, False)}


def test_short_k_prefill_gemms_take_the_persistent_body_with_unwaited_tma_stores():
    """sm90's bf16 prefill variants with K <= short_k whose tiles divide N and K (q_b) build `linear_sm90.body_ws`
    (a persistent grid of 132 programs, the output stored by TMA and waited for only before its staging rows are
    reused); longer K (q_a, o_b, lm_head) and ragged shapes keep the pipelined body with its swizzled block order."""
    from tilekernels.lang import Facade
    from tilekernels.ops import linear_sm90

    sm90, cfg = backends.get("sm90"), linear.KERNEL.config("sm90")

    def script(n, k):
        return linear_sm90.body(Facade(sm90.traits), linear.variant(4096, n, k), cfg).script()

    q_b = script(32768, 1024)
    assert "tma_store_wait" in q_b and "132" in q_b and "swizzle_pattern" not in q_b
    for n, k in ((1024, 4096), (4096, 8192), (1000, 2048), (200, 1000)):
        other = script(n, k)
        assert "tma_store_wait" not in other and "swizzle_pattern" in other, (n, k)
