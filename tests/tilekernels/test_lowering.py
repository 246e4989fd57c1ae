"""Every kernel lowers for every target; CUDA sources compile to cubins for sm_90a and sm_100a; Ascend
sources carry none of the silent traps of kernels.md section 4 (a buffer read before written raises inside
lowering). sm_100 and Ascend are compile-only here: nothing of theirs runs on hardware."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import backends
from codegen import Compiler
from tilekernels.kernels import request
from tilekernels.ops import (DECLARED, act_quant, candidate_blocks, compress_pool, compress_ring, engram_gate, engram_lookup,
                             fp4_act_qdq, fp4_gather, fp4_pack, hc_collapse, hc_mid, hc_mixes, hc_post, hc_pre, indexer_scores,
                             indexer_topk,
                             indexer_scores_fp4, linear, linear_fp8, moe_decode, moe_experts, moe_gate, rms_norm, rope,
                             sparse_attention, split_sum, swiglu)

# One bf16 variant per kernel, at V4-Flash widths.
CASES = {
    ("rms_norm", "rms_norm"): rms_norm.Variant(4096, "bfloat16"),
    ("swiglu", "swiglu"): swiglu.Variant(2048, "bfloat16"),
    ("rope", "rope"): rope.Variant(64, 512, 64, "bfloat16"),
    ("linear", "gemm"): linear.Variant(1024, 4096, "bfloat16"),
    ("linear", "gemm_fp8"): linear_fp8.Variant(1024, 4096, "bfloat16", (128, 128), groups=8, ue8m0=True),
    ("linear", "split_sum"): split_sum.Variant(16, 1024, "bfloat16"),  # q_a at decode: 16 K slices
    ("indexer_scores", "indexer_scores"): indexer_scores.Variant(64, 128, "bfloat16", False),
    ("indexer_topk", "indexer_topk"): indexer_topk.Variant(512),  # V4-Flash's k
    ("act_quant", "act_quant"): act_quant.Variant(4096, 128, "bfloat16", pow2=True),
    ("moe_gate", "moe_gate"): moe_gate.Variant(256, 6, "sqrtsoftplus", "bfloat16"),
    ("moe_experts", "grouped_gemm"): moe_experts.variant(4096, 4096, 256, "bfloat16", tokens=4096),  # 128-row tiles
    ("moe_experts", "grouped_gemm_fp4"): moe_experts.Variant(4096, 4096, 256, "bfloat16", fp4=True),
    ("moe_experts", "moe_route"): moe_decode.RouteVariant(256, 16, 64 * 6),
    ("moe_experts", "moe_combine"): moe_decode.CombineVariant(4096, 6, "bfloat16"),
    ("hc_pre", "hc_pre_split"): hc_pre.Variant(4, 4096, 20, "bfloat16", split=16),  # sm90: hc_mixes_sm90's GEMM
    ("hc_pre", "hc_pre_finish"): hc_pre.Variant(4, 4096, 20, "bfloat16", split=16),
    ("hc_post", "hc_post"): hc_post.Variant(4, 4096, "bfloat16"),
    ("hc_mid", "hc_mid_post"): hc_mid.Variant(4, 4096, "bfloat16", 128),
    ("sparse_attention", "split"): sparse_attention.Variant(64, 512, "bfloat16"),
    ("sparse_attention", "combine"): sparse_attention.Variant(64, 512, "bfloat16"),
    ("sparse_attention", "whole"): sparse_attention.Variant(64, 512, "bfloat16"),
    ("compress_pool", "compress_pool"): compress_pool.Variant(128, 512, "bfloat16"),  # HCA: the largest staged tile
    # CSA's decode pooling from its ring (8 slots of two series, 2 x 512 channels; bf16 gates as the cache keeps)
    ("compress_ring", "compress_ring"): compress_ring.Variant(4, 8, 8, 1024, "bfloat16", "bfloat16"),
    # V4.1's own, at V4.1 widths (odd widths: tests/tilekernels/test_v41_kernels.py on the c target)
    ("hc_mixes", "hc_mixes_split"): hc_mixes.Variant(4, 5120, 20, "bfloat16", split=20),  # sm90: the GEMM too
    ("hc_mixes", "hc_mixes_finish"): hc_mixes.Variant(4, 5120, 20, "bfloat16", split=20),
    ("hc_collapse", "hc_collapse"): hc_collapse.Variant(4, 5120, "bfloat16"),
    ("fp4_act_qdq", "fp4_act_qdq"): fp4_act_qdq.Variant(512, 16, "e4m3", "bfloat16"),
    ("fp4_pack", "fp4_pack"): fp4_pack.Variant(512, 16, "e4m3", "bfloat16"),  # the compressed latents
    ("fp4_gather", "fp4_gather"): fp4_gather.Variant(512, 16, "e4m3", "bfloat16"),
    ("indexer_scores_fp4", "indexer_scores_fp4"): indexer_scores_fp4.Variant(32, 128, "bfloat16", False),
    ("candidate_blocks", "candidate_blocks"): candidate_blocks.Variant(8, 2048),
    ("engram_gate", "engram_gate"): engram_gate.Variant(4, 5120, "bfloat16"),
    ("engram_lookup", "engram_lookup"): engram_lookup.Variant(256, 32, "ue8m0", "fp8"),
}

# Widths of small configs that no thread count or chunk divides (the bodies pad and mask them; attention's
# head dim 20 is padded to 32 by its `variant`): they used to fail layout inference on sm90/sm100.
_ODD_ATTENTION = sparse_attention.variant(torch.empty(1, 5, 20, dtype=torch.bfloat16, device="meta"))
ODD = {
    ("linear", "split_sum"): split_sum.Variant(3, 100, "bfloat16"),  # a partial column block
    ("indexer_scores", "indexer_scores"): indexer_scores.Variant(16, 32, "bfloat16", True, 4, 64),
    ("rms_norm", "rms_norm"): rms_norm.Variant(20, "bfloat16"),
    ("swiglu", "swiglu"): swiglu.Variant(1408, "bfloat16"),
    ("rope", "rope"): rope.Variant(5, 20, 6, "bfloat16"),
    ("moe_gate", "moe_gate"): moe_gate.Variant(6, 2, "sqrtsoftplus", "bfloat16"),
    ("hc_pre", "hc_pre_split"): hc_pre.Variant(3, 41, 20, "bfloat16", split=2),  # K 123: portable on sm90 too
    ("hc_pre", "hc_pre_finish"): hc_pre.Variant(3, 40, 20, "bfloat16"),
    # K 120 in 3 parts of one 64-column step on sm90: a partial step and a part wholly past K (zero-filled loads)
    ("hc_mixes", "hc_mixes_split"): hc_mixes.Variant(3, 40, 20, "bfloat16", split=3),
    ("hc_post", "hc_post"): hc_post.Variant(4, 100, "bfloat16"),
    ("hc_mid", "hc_mid_post"): hc_mid.Variant(2, 64, "bfloat16", 64),  # one part of the whole width
    ("sparse_attention", "split"): _ODD_ATTENTION,
    ("sparse_attention", "combine"): _ODD_ATTENTION,
    ("compress_pool", "compress_pool"): compress_pool.Variant(8, 100, "bfloat16"),  # a partial channel block
    ("compress_ring", "compress_ring"): compress_ring.Variant(4, 8, 12, 200, "bfloat16"),  # partial blocks, overlap
}
# V4.1's ratio-2 compressors project in fp32 (K 5120): on sm100 tcgen05 takes no fp32 inputs (registers
# accumulate), on sm90 the tiles' K depth halves to fit shared memory.
FP32 = {("linear", "gemm"): linear.Variant(512, 5120, "float32"),
        ("compress_pool", "compress_pool"): compress_pool.Variant(2, 512, "float32")}  # V4.1 pools fp32 kv
# V4.1's index keys in the FP4 cache: 128 wide, groups of 32, ue8m0 scales (CASES has the latents' variants)
KEYS = {("fp4_pack", "fp4_pack"): fp4_pack.Variant(128, 32, "ue8m0", "bfloat16"),
        ("fp4_gather", "fp4_gather"): fp4_gather.Variant(128, 32, "ue8m0", "bfloat16")}
# One token of o_a (8 groups, split K): the swapped decode variant, linear_decode_sm90's on sm_90a
SWAPPED = {("linear", "gemm"): linear.variant(1, 1024, 4096, 8)}
# RoPE in place: the queries' 64 rotated channels of 512, and odd widths (6 heads of 24, 8 rotated: a tiny config's)
INPLACE = {"inplace": rope.Variant(64, 512, 64, "bfloat16", inverse=True, inplace=True),
           "inplace-odd": rope.Variant(6, 24, 8, "bfloat16", inplace=True),
           "norm": rope.Variant(64, 512, 64, "bfloat16", inplace=True, norm=True)}
# (the odd widths of the attention's `whole` kernel and of RoPE's norm form lower for every target in
# tests/compile/test_every_config_lowers.py: ODD_A's plan launches both)
# Prefill rows of act_quant: the NVIDIA row-tile override (act_quant_nvidia), V4.1's groups of 32, both CUDA targets
WIDE = {("act_quant", "act_quant"): act_quant.Variant(1024, 32, "bfloat16", pow2=True, wide=True)}
ALL = ([(case, v) for case, v in CASES.items()] + [(case, v) for case, v in ODD.items()]
       + [(case, v) for case, v in FP32.items()] + [(case, v) for case, v in KEYS.items()]
       + [(case, v) for case, v in SWAPPED.items()] + [(("rope", "rope"), v) for v in INPLACE.values()]
       + [(case, v) for case, v in WIDE.items()])
IDS = ([f"{c[0]}.{c[1]}" for c in CASES] + [f"{c[0]}.{c[1]}-odd" for c in ODD]
       + [f"{c[0]}.{c[1]}-fp32" for c in FP32] + [f"{c[0]}.{c[1]}-keys" for c in KEYS]
       + [f"{c[0]}.{c[1]}-swapped" for c in SWAPPED] + [f"rope.rope-{label}" for label in INPLACE]
       + [f"{c[0]}.{c[1]}-wide" for c in WIDE])


# hc_pre's norm form (the collapse RMS-normalized in the finish): V4-Flash's width, and a ragged one (chunks of 512)
NORMED = {"norm": hc_pre.Variant(4, 4096, 20, "bfloat16", split=32, norm=True),
          "norm-ragged": hc_pre.Variant(3, 600, 20, "bfloat16", split=4, norm=True)}
ALL += [(("hc_pre", "hc_pre_finish"), v) for v in NORMED.values()]
IDS += [f"hc_pre.hc_pre_finish-{label}" for label in NORMED]


# Kernels lowered elsewhere: the K-permuted FP4 expert kernels are sm90 bodies (tests/test_fp4_repacked.py lowers
# both; on every other target they are grouped_gemm_fp4's body, which CASES lowers)
ELSEWHERE = {("moe_experts", f"grouped_gemm_fp4_{d}") for d in moe_experts.KERNELS_KPERM}


def test_every_kernel_has_a_case():
    declared = {(name, k.name) for name, op in DECLARED.items() for k in op.kernels}
    assert declared == set(CASES) | ELSEWHERE
    v = CASES[("moe_experts", "grouped_gemm_fp4")]
    for kernel in moe_experts.KERNELS_KPERM.values():
        for name in backends.COMPILE_TARGETS:
            if name != "sm90":
                assert kernel.body_for(name, v) is moe_experts.KERNEL_FP4.body_for(name, v)


def source_only(name: str):
    """The target building its CUDA source and cubin but no runtime library (no GPU here)."""
    from backends.nvidia import without_library

    return without_library(backends.get(name))


def target_for(name: str):
    return backends.get(name) if name == "ascend" else source_only(name)


def build_quietly(name: str, case: tuple, variant, cache) -> None:
    """Build one kernel into `cache` (in a worker process); a failure is left for its test to raise again."""
    try:
        Compiler(target_for(name), cache).get(request(*case, variant))
    except Exception:  # noqa: BLE001 - nothing cached: the test builds it again and reports the error
        pass


# The builds the tests of this module make: (test name, the targets of one case)
BUILDS = {"test_cuda_source_and_cubin_for_sm90a_and_sm100a": ("sm90", "sm100"),
          "test_hc_partials_on_sm90_are_the_tensor_core_gemm": ("sm90",),
          "test_ascend_source_without_traps": ("ascend",)}


def queue_ahead(ahead, items: list) -> tuple:
    """The kernels of the selected tests (`items`), queued at the session's start by tests/conftest.py's `ahead`
    (two worker processes at the lowest priority, on the core the tests before this module leave idle), Ascend's
    and the slowest first; built into one cache, where each test then finds its kernels (a hit costs a trace)
    and checks them. Returns the cache and the builds' futures."""
    work = []
    for item in items:
        params = getattr(item, "callspec", None)
        for name in BUILDS.get(getattr(item, "originalname", ""), ()):
            case = params.params["case"]
            variant = params.params.get("variant", CASES[case])
            if name == "ascend" or name in cuda_targets(case, variant):
                work.append((name, case, variant))
    work = sorted(dict.fromkeys(work), key=lambda w: (w[0] != "ascend", w[1] != ("sparse_attention", "split")))
    path = ahead.tmp_path_factory.mktemp("kernels")
    return path, [ahead.submit(build_quietly, *w, path) for w in work]


@pytest.fixture(scope="module")
def cache(ahead, request):
    """The cache `queue_ahead` builds into, once its builds are done."""
    path, builds = ahead.of(request.module)
    for build in builds:
        build.result()
    return path


def cuda_targets(case: tuple, variant) -> tuple[str, ...]:
    """The CUDA targets a case builds a cubin for: both, but sm_90a alone for the odd widths (their sm_100a sources
    lower in tests/compile/test_every_config_lowers.py at ODD_A's widths; the cubins cost the CPU suite ~1 minute)."""
    return ("sm90",) if ODD.get(case) == variant else ("sm90", "sm100")


PREFETCH = re.compile(r"^ *deepinfer_prefetch_l2\(\(&\(\w+\[[^\[\]]*\]\)\), \d+\);$", re.M)  # no load inside


def waits_first(source: str) -> bool:
    """Every kernel of a CUDA source waits for the kernels before it (`cudaGridDependencySynchronize`, CUDA's
    programmatic dependent launch: `backends.tl.dependent_launch`) before it touches global memory: before its
    first use of a pointer parameter and its first TMA load (a tensor map itself is a kernel parameter). The one
    exception: whole statements that prefetch weight rows into L2 (`tilekernels.l2_prefetch`: no value read)."""
    kernels = list(re.finditer(r"__global__ void (?:__launch_bounds__\([^)]*\) )?\w+\(([^)]*)\) \{", source))
    for m in kernels:
        body = PREFETCH.sub("", source[m.end():])
        sync = body.find("cudaGridDependencySynchronize();")
        pointers = [p.split()[-1].lstrip("*") for p in m.group(1).split(",") if "*" in p and "CUtensorMap" not in p]
        uses = [u.start() for p in pointers for u in [re.search(rf"\b{re.escape(p)}\b", body)] if u]
        uses += [i for i in [body.find("tma_load")] if i >= 0]
        if sync < 0 or any(u < sync for u in uses):
            return False
    return bool(kernels)


@pytest.mark.full  # opt-in, with the next matrix: `pytest -m full` (README.md, Run the tests)
@pytest.mark.parametrize("case, variant", ALL, ids=IDS)
def test_cuda_source_and_cubin_for_sm90a_and_sm100a(case, variant, cache):
    for name in cuda_targets(case, variant):
        art = Compiler(source_only(name), cache).get(request(*case, variant))
        source = art.file("cuda").read_text()
        cubin = art.file("cubin")
        assert "__global__" in source and waits_first(source), f"{name}: {case} reads before its dependency wait"
        assert cubin is not None and cubin.read_bytes()[:4] == b"\x7fELF", f"{name}: no cubin for {case}"
        if case == ("linear", "gemm") and variant == CASES[case]:  # the GEMM uses each architecture's tensor-core instructions
            assert ("wgmma" in source) if name == "sm90" else ("tcgen05" in source)
        if getattr(variant, "swapped", False):  # sm_90a: weight rows as wgmma's M, 16 token rows as its N
            assert variant.split_k > 1 and (("64, 16, 16" in source) == (name == "sm90"))
        if case == ("linear", "gemm_fp8") and name == "sm90":  # Hopper's FP8 wgmma, fed by TMA
            assert "wgmma_ss<tl::DataType::kFloat8_e4m3" in source and "tma_load" in source


@pytest.mark.parametrize("case", [("hc_pre", "hc_pre_split"), ("hc_mixes", "hc_mixes_split")])
def test_hc_partials_on_sm90_are_the_tensor_core_gemm(case, cache):
    """bf16 mHC partials on sm_90a: hc_mixes_sm90's override (TMA-fed bf16 wgmma with fp32 accumulators); the
    portable body on the other targets and for fp32 streams."""
    from tilekernels.ops import hc_mixes_sm90

    variant, kernel = CASES[case], DECLARED[case[0]].kernel(case[1])
    assert kernel.body_for("sm90", variant) is hc_mixes_sm90.body
    assert all(kernel.body_for(t, variant) is kernel.body for t in ("sm100", "ascend", "c"))
    assert kernel.body_for("sm90", dataclasses.replace(variant, dtype="float32")) is kernel.body
    source = Compiler(source_only("sm90"), cache).get(request(*case, variant)).file("cuda").read_text()
    assert "wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32" in source
    assert "tma_load" in source


@pytest.mark.full
@pytest.mark.parametrize("case, variant", list(CASES.items()), ids=IDS[:len(CASES)])
def test_ascend_source_without_traps(case, variant, cache):
    """V4-Flash widths here (the FP4 key variants only for CUDA: the same bodies as the latents' with another
    group and scale format); the odd widths of every config's plan: tests/compile/test_every_config_lowers.py."""
    art = Compiler(backends.get("ascend"), cache).get(request(*case, variant))
    source = art.file("ascend").read_text()
    assert "__global__" in source and "asc_" in source and "GridDependency" not in source
    assert not re.search(r"blockIdx\.[yz]|threadIdx\.[yz]", source), "a 2-D launch leaked into the NPU source"
    if backends.ascend.bisheng_path() is None:
        assert art.file("binary") is None and "bisheng" in art.meta["notes"]["binary"]


def test_a_decode_tile_with_a_negative_prefetch_is_refused_by_name():
    from tilekernels.errors import ShapeError
    from tilekernels.lang import Facade
    from tilekernels.ops import linear_decode_sm90

    tune = dataclasses.replace(linear_decode_sm90.TUNE, prefetch=-1)
    with pytest.raises(ShapeError, match="prefetch=-1.*prefetch >= 0"):
        linear_decode_sm90.body(Facade(source_only("sm90").traits), SWAPPED[("linear", "gemm")], None, tune)


def test_only_weight_prefetches_run_ahead_of_the_dependency_wait(cache):
    """The swapped decode GEMM prefetches its first weight rows into L2 before the wait, and nothing else runs
    there; a statement that stores beside its prefetch call, or whose condition reads memory, is not hoisted (it
    and everything after it stay after the wait)."""
    from backends import tl

    tl.tilelang()
    import tilelang.language as T

    from tilekernels import l2_prefetch

    case = ("linear", "gemm")
    source = Compiler(source_only("sm90"), cache).get(request(*case, SWAPPED[case])).file("cuda").read_text()
    sync = source.find("cudaGridDependencySynchronize();")
    assert 0 <= source.find("deepinfer_prefetch_l2((") < sync and waits_first(source)

    def kernel_with(extra: str):
        @T.prim_func
        def kernel(W: T.Tensor((256, 64), "bfloat16"), C: T.Tensor((256,), "float32")):
            with T.Kernel(4, threads=64) as pid:
                tx = T.get_thread_binding()
                T.import_source(l2_prefetch.SOURCE)
                if extra == "read" and W[pid * 64, 0] > 0:  # a condition that reads memory
                    T.call_extern("handle", l2_prefetch.NAME, T.address_of(W[pid * 64, 0]), 128)
                if tx < 64:
                    T.call_extern("handle", l2_prefetch.NAME, T.address_of(W[pid * 64 + tx, 0]), 128)
                    if extra == "store":
                        C[pid * 64 + tx] = 0.0
                for i in T.Parallel(64):
                    C[pid * 64 + i] = T.cast(W[pid * 64 + i, 0], "float32")
        return kernel

    script = tl.dependent_launch(kernel_with("")).script()
    assert script.index("deepinfer_prefetch_l2") < script.index("T.pdl_sync()")
    for extra in ("store", "read"):
        script = tl.dependent_launch(kernel_with(extra)).script()
        assert script.index("T.pdl_sync()") < script.index("deepinfer_prefetch_l2"), extra


def test_dependent_launch_only_where_the_target_asks():
    """CUDA targets lower every kernel with the dependency wait first; without the trait the same body has none
    (and the check above would fail on it); the other targets' traits do not ask for it."""
    from backends import tl

    target = source_only("sm90")
    plain = dataclasses.replace(target, traits=dataclasses.replace(target.traits, dependent_launch=False))
    req = request("rms_norm", "rms_norm", CASES[("rms_norm", "rms_norm")])
    assert waits_first(tl.lower_source(req.build(target), target))
    assert not waits_first(tl.lower_source(req.build(plain), plain))
    assert {n: backends.get(n).traits.dependent_launch for n in backends.COMPILE_TARGETS} == {
        n: backends.get(n).family == "nvidia" for n in backends.COMPILE_TARGETS}


def test_the_bf16_decode_expert_kernel_is_launched_plainly():
    """The 16-row bf16 expert kernel (moe_bf16_sm90.body_decode) opts out of dependent launch: with it, the GPU hung
    in short prefills (BENCHMARKS.md, twenty-fifth round); its sm90 source has no wait, the prefill tile's does."""
    from backends import tl

    target = source_only("sm90")
    decode = request("moe_experts", "grouped_gemm", moe_experts.Variant(128, 256, 4, "bfloat16", block_m=16))
    prefill = request("moe_experts", "grouped_gemm", moe_experts.Variant(128, 256, 4, "bfloat16", block_m=64))
    plain = tl.lower_source(decode.build(target), target)
    assert "cudaGridDependencySynchronize" not in plain and "cudaTriggerProgrammatic" not in plain
    assert "tma_load" in plain and waits_first(tl.lower_source(prefill.build(target), target))
