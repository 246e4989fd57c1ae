"""The compile driver and `deepinfer compile`: caching, corruption, concurrency, no-JIT, bad input."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import backends
from codegen import Compiler, NotBuiltError
from codegen.driver import build_one
from deepinfer.cli import main
from deepinfer.config import ModelConfig
from deepinfer.compile.plan import kernel_plan
from tilekernels.kernels import request
from tilekernels.ops import linear, moe_experts, rms_norm, sparse_attention

FLASH = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "v4-flash.json"


def compile_cli(*args):
    return CliRunner().invoke(main, ["compile", *args], catch_exceptions=False)


def test_second_run_is_all_cache_hits_and_a_corrupted_entry_is_rebuilt(tmp_path):
    first = compile_cli("--target", "c", "--ops", "rms_norm,swiglu", "--out", str(tmp_path), "--jobs", "2")
    assert first.exit_code == 0, first.output
    assert "built 3, cached 0, failed 0" in first.output  # two norm widths, SwiGLU (q's head norm: in RoPE)
    second = compile_cli("--target", "c", "--ops", "rms_norm,swiglu", "--out", str(tmp_path), "--jobs", "1")
    assert "built 0, cached 3, failed 0" in second.output
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert len(manifest["entries"]) == 3
    victim = tmp_path / "c" / manifest["entries"][0]["path"] / "kernel.c"
    victim.write_text(victim.read_text()[:100])  # truncated, as a crashed writer would leave it
    third = compile_cli("--target", "c", "--ops", "rms_norm,swiglu", "--out", str(tmp_path), "--jobs", "1")
    assert "built 1, cached 2, failed 0" in third.output
    assert len(victim.read_text()) > 100


@pytest.mark.parametrize("target", ["sm90", "sm100", "ascend"])
def test_compile_each_target_on_the_tiny_model(target, tmp_path):
    from deepinfer.tiny import tiny_config

    norms = sum(op == "rms_norm" for op, _, _ in kernel_plan(tiny_config(), "bfloat16"))
    result = compile_cli("--target", target, "--ops", "rms_norm", "--out", str(tmp_path), "--jobs", "1")
    assert result.exit_code == 0, result.output
    assert f"built {norms}, cached 0, failed 0" in result.output
    entries = json.loads((tmp_path / target / "manifest.json").read_text())["entries"]
    for e in entries:
        files = {p.name for p in (tmp_path / target / e["path"]).rglob("*")}
        assert "kernel.tir" in files and "meta.json" in files
        assert ("kernel.cubin" in files and "executable.so" in files) if target != "ascend" else "kernel.cpp" in files
    listing = CliRunner().invoke(main, ["kernels", "list", "--out", str(tmp_path)])
    assert f"{target}:{norms}" in listing.output


def test_bad_target_and_bad_op_are_clear_errors(tmp_path):
    result = CliRunner().invoke(main, ["compile", "--target", "sm80", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "unknown target 'sm80'" in result.output and "sm90, sm100, ascend" in result.output
    result = CliRunner().invoke(main, ["compile", "--target", "c", "--ops", "flash_attn", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "unknown op(s) ['flash_attn']" in result.output
    with pytest.raises(backends.BackendError, match="unknown target 'tpu'"):
        backends.get("tpu")


def test_no_jit_mode_names_the_missing_kernel_and_the_command(tmp_path):
    compiler = Compiler(backends.get("c"), tmp_path, jit=False)
    with pytest.raises(NotBuiltError, match=r"rms_norm\.rms_norm\[dim=96.*not built.*deepinfer compile --target c --ops rms_norm"):
        compiler.get(request("rms_norm", "rms_norm", rms_norm.Variant(96, "float32")))


def test_concurrent_builds_of_one_entry_are_safe(tmp_path):
    item = ("rms_norm", "rms_norm", rms_norm.Variant(80, "float32"))
    results = []
    threads = [threading.Thread(target=lambda: results.append(build_one("c", str(tmp_path), request, item)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status for r in results) == ["built", "cached", "cached"]
    assert len({r.path for r in results}) == 1
    assert not [p for p in (tmp_path / "c").rglob("*staging*")]


def test_flash_config_yields_its_real_shapes():
    items = kernel_plan(ModelConfig.from_dict(json.loads(FLASH.read_text())))
    variants = {(op, v) for op, _, v in items}
    assert ("linear", linear.Variant(32768, 1024, "bfloat16")) in variants  # q_b_proj: 64 heads x 512
    assert ("linear", linear.Variant(1024, 4096, "bfloat16", groups=8)) in variants  # grouped o_a_proj
    assert ("linear", linear.Variant(129280, 4096, "bfloat16")) in variants  # lm_head, prefill
    # the stacked input projections at one decode row (deepinfer/model/stacked.py): q_a + kv of a sliding layer,
    # and with the compressor's (HCA) and the indexer's (CSA) projections
    for n in (1536, 2560, 4160):
        assert ("linear", linear.variant(1, n, 4096, 1)) in variants, n
    gate_up = moe_experts.Variant(4096, 4096, 256, "bfloat16", moe_experts.PREFILL_BLOCK_M)  # 256 experts, prefill
    assert ("moe_experts", gate_up) in variants
    assert ("sparse_attention", sparse_attention.Variant(64, 512, "bfloat16")) in variants


def test_prebuild_lists_what_the_manifest_lacks_and_builds_it(tmp_path):
    """A kernel backend builds (with progress) only the kernels of the model that `deepinfer compile` has not."""
    from deepinfer.compile.plan import kernel_plan
    from deepinfer.compile.prebuild import missing_kernels, prebuild
    from deepinfer.tiny import tiny_config

    cfg = tiny_config()
    plan = [it for it in kernel_plan(cfg, "float32") if it[0] in ("rms_norm", "swiglu")]
    result = compile_cli("--target", "c", "--ops", "rms_norm", "--dtype", "float32", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    missing = missing_kernels("c", cfg, "float32", tmp_path)
    assert [it for it in plan if it in missing] == [it for it in plan if it[0] == "swiglu"]
    assert not any(it[0] == "rms_norm" for it in missing)
    # build just the swiglu one through prebuild's path, then nothing of it is missing
    import deepinfer.compile.prebuild as pb

    only_swiglu = lambda *a: [it for it in missing_kernels(*a) if it[0] == "swiglu"]  # noqa: E731
    original, pb.missing_kernels = pb.missing_kernels, only_swiglu
    try:
        prebuild("c", cfg, "float32", tmp_path, progress=False)
    finally:
        pb.missing_kernels = original
    assert not any(it[0] == "swiglu" for it in missing_kernels("c", cfg, "float32", tmp_path))
