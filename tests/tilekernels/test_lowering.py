"""Every kernel lowers for every target; CUDA sources compile to cubins for sm_90a and sm_100a; Ascend
sources carry none of the silent traps of kernels.md section 4 (a buffer read before written raises inside
lowering). sm_100 and Ascend are compile-only here: nothing of theirs runs on hardware."""

from __future__ import annotations

import dataclasses
import re

import pytest

import backends
from codegen import Compiler
from tilekernels.kernels import request
from tilekernels.ops import DECLARED, hc_post, hc_pre, linear, moe_experts, moe_gate, rms_norm, rope, sparse_attention, swiglu

# One bf16 variant per kernel, at V4-Flash widths.
CASES = {
    ("rms_norm", "rms_norm"): rms_norm.Variant(4096, "bfloat16"),
    ("swiglu", "swiglu"): swiglu.Variant(2048, "bfloat16"),
    ("rope", "rope"): rope.Variant(64, 512, 64, "bfloat16"),
    ("linear", "gemm"): linear.Variant(1024, 4096, "bfloat16"),
    ("moe_gate", "moe_gate"): moe_gate.Variant(256, 6, "sqrtsoftplus", "bfloat16"),
    ("moe_experts", "grouped_gemm"): moe_experts.Variant(4096, 4096, 256, "bfloat16"),
    ("hc_pre", "hc_pre"): hc_pre.Variant(4, 4096, 20, "bfloat16"),
    ("hc_post", "hc_post"): hc_post.Variant(4, 4096, "bfloat16"),
    ("sparse_attention", "split"): sparse_attention.Variant(64, 512, "bfloat16", splits=4),
    ("sparse_attention", "combine"): sparse_attention.Variant(64, 512, "bfloat16", splits=4),
}


def test_every_kernel_has_a_case():
    declared = {(name, k.name) for name, op in DECLARED.items() for k in op.kernels}
    assert declared == set(CASES)


def source_only(name: str):
    """The target with its device-binary stage but without the runtime-library stage (no GPU here)."""
    target = backends.get(name)
    return dataclasses.replace(target, stages=tuple(s for s in target.stages if s.name != "lib"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.mark.parametrize("case", sorted(CASES), ids=lambda c: f"{c[0]}.{c[1]}")
def test_cuda_source_and_cubin_for_sm90a_and_sm100a(case, cache):
    for name in ("sm90", "sm100"):
        art = Compiler(source_only(name), cache).get(request(*case, CASES[case]))
        source = art.file("cuda").read_text()
        cubin = art.file("cubin")
        assert "__global__" in source
        assert cubin is not None and cubin.read_bytes()[:4] == b"\x7fELF", f"{name}: no cubin for {case}"
        if case == ("linear", "gemm"):  # the GEMM uses each architecture's tensor-core instructions
            assert ("wgmma" in source) if name == "sm90" else ("tcgen05" in source)


@pytest.mark.parametrize("case", sorted(CASES), ids=lambda c: f"{c[0]}.{c[1]}")
def test_ascend_source_without_traps(case, cache):
    art = Compiler(backends.get("ascend"), cache).get(request(*case, CASES[case]))
    source = art.file("ascend").read_text()
    assert "__global__" in source and "asc_" in source
    assert not re.search(r"blockIdx\.[yz]|threadIdx\.[yz]", source), "a 2-D launch leaked into the NPU source"
    if backends.ascend.bisheng_path() is None:
        assert art.file("binary") is None and "bisheng" in art.meta["notes"]["binary"]
