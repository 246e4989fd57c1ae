"""Build, in parallel, the sm90 kernels that the GPU tests and benchmarks of named configs launch, before running them
on a fresh GPU host (its kernel cache starts empty; a test or benchmark building its own kernels one by one costs
minutes of device time). On the GPU host, after `source .gpu-host/setup.sh`:

    python tools/gpu_prebuild.py default tiny slice        # then: pytest -m gpu ..., python -m benchmarks.decode ...

Tags: `default` (the embedded tiny model, both modes), `tiny` (the test configs TINY_A/B, MTP and DSpark ones, both
modes), `tinyq` (TINY_A with FP8/FP4 weights kept), `v41` (the V4.1 fixtures, fixture a quantized too), `slice` (the
V4-Flash slice, bf16), `slice-invariant` (its batch-invariant variants), `qslice` (the slice quantized), `kernels`
(what `tests/gpu/test_kernels_gpu.py` launches: every V4-Flash op at its widths, recorded on meta tensors), `bench`
(what `benchmarks/kernels.py` launches at its default token counts, recorded the same way), `ranks` (one rank's
plan of each layout `tests/gpu/test_parallel_gpu.py` runs on TINY_A), `flash-epN` (one rank's plan of the whole
V4-Flash in native precision over N GPUs, as `benchmarks/parallel_decode.py --ranks N` runs it). Jobs:
min(16, cores); the cache is `DEEPINFER_CACHE_DIR`'s.

It also runs on a machine without a GPU (nvcc builds the same libraries): build there, carry the cache compressed
(`tar cf - -C /tmp kc | xz > kc.tar.xz`: the slice's 80 kernels are 23 MB, 0.6 MB compressed; `tiny slice` 1.1 MB),
unpack it on the GPU host into `DEEPINFER_CACHE_DIR`, and this finds every kernel cached (34 s for 182 kernels on the
H200's host instead of minutes of device time); the keys match when the two hosts have the same nvcc and TileLang."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TAGS = ("default", "tiny", "tinyq", "v41", "slice", "slice-invariant", "qslice", "kernels", "bench", "gemm", "ranks",
        "flash-ep2", "flash-ep4", "flash-ep8")


def kernel_test_items() -> list[tuple]:
    """The (op, kernel, variant) items `tests/gpu/test_kernels_gpu.py` launches: each op's example at its V4-Flash
    variant for the test's token counts, the query's norm-and-RoPE form and the FP4 experts, run on meta tensors
    through a recorder."""
    import torch

    from tests.gpu.test_kernels_gpu import flash_ops, flash_variants
    from tilekernels.kernels import Recorder, table
    from tilekernels.ops import DECLARED, moe_experts, rope

    recorder, meta = Recorder(), torch.device("meta")
    ops, variants = table(recorder), flash_variants()
    cases = [(name, variants[name], tokens) for name in flash_ops() for tokens in (8, 16, 512)]
    cases += [("rope", rope.Variant(64, 512, 64, "bfloat16", norm=True), tokens) for tokens in (1, 8, 512)]
    cases += [("moe_experts", moe_experts.Variant(4096, 4096, 256, "bfloat16", fp4=True), t) for t in (1, 64, 700)]
    for name, variant, tokens in cases:
        args = DECLARED[name].example(variant, tokens, meta)
        if name == "rope" and variant.norm:  # the test's call: in place, normalised
            getattr(ops, name)(*args[:5], inplace=True, norm_eps=args[6])
        else:
            getattr(ops, name)(*args)
    return list(recorder.seen)


def kernel_bench_items() -> list[tuple]:
    """The (op, kernel, variant) items `benchmarks/kernels.py` launches at its default token counts, recorded on meta
    tensors."""
    from benchmarks.kernels import TOKENS, attention_cases, cases
    from tilekernels.kernels import Recorder, table

    recorder = Recorder()
    ops = table(recorder)
    for t in TOKENS:
        for name, args, _, _ in {**cases(t, "meta"), **attention_cases(t, "meta")}.values():
            getattr(ops, name)(*args)
    return list(recorder.seen)


def gemm_test_items() -> list[tuple]:
    """The (op, kernel, variant) items of the bf16 and FP8 GEMM tests (`tests/gpu/test_linear_sm90_gpu.py`,
    `tests/gpu/test_fp8_gpu.py`): their calls at their shapes and row counts, run on meta tensors through a
    recorder."""
    import torch

    from tests.gpu import test_fp8_gpu as fp8_tests
    from tests.gpu import test_linear_sm90_gpu as bf16_tests
    from tilekernels.kernels import Recorder, table
    from tilekernels.ops import act_quant, grouped_linear, linear, linear_fp8

    recorder, meta = Recorder(), torch.device("meta")
    ops = table(recorder)
    items = [("linear", "gemm", linear.variant(m, n, k)) for n, k in bf16_tests.SHAPES for m in bf16_tests.ROWS]
    items += [("linear", "gemm", linear.variant(m, 1024, 4096, 8)) for m in (1, 5)]
    calls = [(linear_fp8.Variant(n, k, "bfloat16", (128, 128), g, ue8m0=True), t)
             for _, n, k, g in fp8_tests.SHAPES for t in (*fp8_tests.TOKENS, fp8_tests.GRAPH_TOKENS)]
    calls += [(linear_fp8.Variant(2048, 1024, "bfloat16", block, ue8m0=ue8m0), t)
              for block, ue8m0 in (((128, 128), False), ((32, 32), True)) for t in fp8_tests.FORMAT_TOKENS]
    for v, tokens in calls:
        op = grouped_linear if v.groups > 1 else linear
        getattr(ops, op.OP.name)(*op.example(v, tokens, meta))
    quantized = [(act_quant.Variant(k, 128, "bfloat16", pow2), rows) for k in fp8_tests.ACT_WIDTHS
                 for pow2 in (True, False) for rows in fp8_tests.ACT_ROWS]
    quantized += [(act_quant.Variant(1024, 32, dtype, True), act_quant.WIDE_ROWS + 1) for dtype in ("bfloat16", "float16")]
    for v, rows in quantized:
        ops.act_quant(*act_quant.example(v, rows, meta))
    return items + list(recorder.seen)


def items_for(tag: str) -> list[tuple]:
    """The (op, kernel, variant) items of `tag`'s configs."""
    from deepinfer.compile.plan import kernel_plan
    from deepinfer.config import ModelConfig
    from deepinfer.tiny import tiny_config

    def both(cfg) -> list[tuple]:
        return kernel_plan(cfg, "bfloat16") + kernel_plan(cfg, "bfloat16", invariant=True)

    if tag == "default":
        return both(tiny_config())
    if tag in ("tiny", "tinyq"):
        from tests.helpers import TINY_A, TINY_B, TINY_DSPARK, TINY_MTP

        if tag == "tinyq":
            raw = dict(TINY_A, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
            return kernel_plan(ModelConfig.from_dict(raw), "bfloat16", quantized=True)
        return [i for raw in (TINY_A, TINY_B, TINY_MTP, TINY_DSPARK) for i in both(ModelConfig.from_dict(raw))]
    if tag == "v41":
        from deepinfer.config_v41 import V41Config
        from tests.v41_dirs import QUANTIZATION
        from tests.v41_fixture import FIXTURES

        out = []
        for name in ("a", "b", "dspark"):
            raw = json.loads((FIXTURES / name / "config.json").read_text())
            out += kernel_plan(V41Config.from_dict(raw), "bfloat16")
            if name == "a":
                raw.update(dtype="fp8", expert_dtype="fp4", quantization_config=QUANTIZATION)
                out += kernel_plan(V41Config.from_dict(raw), "bfloat16", quantized=True)
        return out
    if tag == "kernels":
        return kernel_test_items()
    if tag == "bench":
        return kernel_bench_items()
    if tag == "gemm":
        return gemm_test_items()
    if tag == "ranks":
        from deepinfer.parallel.config import ParallelConfig
        from tests.gpu.test_parallel_gpu import LAYOUTS
        from tests.helpers import TINY_A

        cfg = ModelConfig.from_dict(TINY_A)
        return [i for layout in LAYOUTS.values() for i in kernel_plan(cfg, "bfloat16", None, False,
                                                                      (ParallelConfig(**layout), 0))]
    if tag.startswith("flash-ep") and tag in TAGS:
        from deepinfer.parallel.config import ParallelConfig
        from deepinfer.weights.synthetic import with_quantization

        cfg = with_quantization(ModelConfig.from_dict(json.loads((ROOT / "benchmarks/configs/v4-flash.json")
                                                                 .read_text())))
        ranks = int(tag.removeprefix("flash-ep"))
        return kernel_plan(cfg, "bfloat16", None, False, (ParallelConfig(ranks, 1, True), 0))
    if tag in ("slice", "slice-invariant", "qslice"):
        from benchmarks.decode import SLICE

        cfg = ModelConfig.from_dict(json.loads((SLICE / "config.json").read_text()))
        if tag == "qslice":  # as `benchmarks/decode.py --quantized` makes it: V4's formats on the slice's config
            from deepinfer.weights.synthetic import V4_QUANTIZATION, with_quantization

            cfg = with_quantization(cfg, V4_QUANTIZATION)
        return kernel_plan(cfg, "bfloat16", quantized=tag == "qslice", invariant=tag == "slice-invariant")
    raise ValueError(f"unknown tag {tag!r}; accepted: {', '.join(TAGS)}")


def main(tags: list[str]) -> int:
    from deepinfer.compile.prebuild import build_kernels
    from deepinfer.env import Env

    start = time.perf_counter()
    items = list(dict.fromkeys(i for tag in tags for i in items_for(tag)))
    results = build_kernels("sm90", items, Env.read().cache_dir, jobs=min(16, os.cpu_count() or 1), progress=False)
    failed = [r for r in results if r.status == "failed"]
    print(f"gpu_prebuild: {len(items)} kernels, {len(failed)} failed, {time.perf_counter() - start:.0f} s")
    for r in failed:
        print(f"FAILED {r.label}: {r.path}")
    return 1 if failed else 0


if __name__ == "__main__":  # the build workers re-import this module: keep the work under the guard
    sys.exit(main(sys.argv[1:] or ["default"]))
