"""Tile configs of the sm90 FP8 block-scaled GEMM at V4-Flash shapes, against cuBLAS bf16 and torch's own FP8
scaled matmul (where this torch offers block scales on the GPU), on the H200:

    python benchmarks/tune_fp8.py [--rows 4096] [--json OUT.json] [--ue8m0]

`--ue8m0`: the weight scales as V4's checkpoints keep them (exponent bytes, activations scaled by powers of two),
the variant the engine runs; without it fp32 scales.

Prints TFLOP/s per (shape, config); the best goes into `tilekernels/ops/linear_fp8.py`'s sm90 config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = {  # label: linear_fp8.Config fields (r: warpgroups split the tile by rows, each wgmma block_n wide)
    "128x128 s4 t256": dict(block_m=128, block_n=128, stages=4, threads=256),
    "128x128 s4 t256 r": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True),
    "128x128 s3 t256 r": dict(block_m=128, block_n=128, stages=3, threads=256, full_rows=True),
    "128x128 s5 t256 r": dict(block_m=128, block_n=128, stages=5, threads=256, full_rows=True),
    "128x160 s4 t256 r": dict(block_m=128, block_n=160, stages=4, threads=256, full_rows=True),
    "128x192 s4 t256 r": dict(block_m=128, block_n=192, stages=4, threads=256, full_rows=True),
    "128x192 s3 t256 r": dict(block_m=128, block_n=192, stages=3, threads=256, full_rows=True),
    "128x256 s3 t256 r": dict(block_m=128, block_n=256, stages=3, threads=256, full_rows=True),
    "192x128 s4 t384 r": dict(block_m=192, block_n=128, stages=4, threads=384, full_rows=True),
    "64x128 s4 t128": dict(block_m=64, block_n=128, stages=4, threads=128),
    # linear_fp8_sm90 (x2: the tile's N in two 128-column slices, each its own wgmma and promotion)
    "128x256 s3 t256 r x2": dict(block_m=128, block_n=256, stages=3, threads=256, full_rows=True, slices=2),
    "128x256 s4 t256 r x2": dict(block_m=128, block_n=256, stages=4, threads=256, full_rows=True, slices=2),
    # linear_fp8_sm90 (ws: own producer/consumer mbarriers, each K block's wgmma in flight while the previous one
    # is promoted, in unrolled chains of c K blocks; p132: a persistent grid of 132 programs)
    "128x128 s4 t256 r ws c4": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True, ws=True, chain=4),
    "128x128 s4 t256 r ws c8": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True, ws=True, chain=8),
    "128x128 s6 t256 r ws c8": dict(block_m=128, block_n=128, stages=6, threads=256, full_rows=True, ws=True, chain=8),
    "128x128 s4 t256 r ws c8 p132": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True, ws=True,
                                         chain=8, programs=132),
    "128x128 s4 t256 r ws c4 p132": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True, ws=True,
                                         chain=4, programs=132),
    # ... cl2: clusters of two CTAs along N, the A tile multicast to both (a third less L2 -> SM traffic)
    "128x128 s4 t256 r ws c8 cl2": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True, ws=True,
                                        chain=8, cluster=2),
    "128x128 s4 t256 r ws c4 cl2": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True, ws=True,
                                        chain=4, cluster=2),
    # linear_fp8.py's sm90 config as the engine runs it: x2 above, the ws c8 p132 body where K <= 2,048
    "sm90 config": dict(block_m=128, block_n=256, stages=3, threads=256, full_rows=True, slices=2, short_k=2048),
    # ... st: each consumer warpgroup stages its rows in shared memory and stores them by TMA, not waited for
    "128x128 s4 t256 r ws c8 p132 st": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True, ws=True,
                                            chain=8, programs=132, tma_store=True),
    "128x128 s5 t256 r ws c8 p132 st": dict(block_m=128, block_n=128, stages=5, threads=256, full_rows=True, ws=True,
                                            chain=8, programs=132, tma_store=True),
    "128x128 s4 t256 r ws c4 p132 st": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True, ws=True,
                                            chain=4, programs=132, tma_store=True),
    "128x128 s4 t256 r ws c8 cl2 p128": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True,
                                             ws=True, chain=8, cluster=2, programs=128),  # 64 pairs surely resident
    "128x128 s4 t256 r ws c4 cl2 p128": dict(block_m=128, block_n=128, stages=4, threads=256, full_rows=True,
                                             ws=True, chain=4, cluster=2, programs=128),
}
SHAPES = [("q_b", 32768, 1024, 1), ("q_a", 1024, 4096, 1), ("o_b", 4096, 8192, 1), ("shared gate_up", 4096, 4096, 1),
          ("shared down", 4096, 2048, 1), ("o_a (8 groups)", 1024, 4096, 8)]


def torch_blockwise(a8, sa, w8, sw, out_dtype=torch.bfloat16):
    """torch's FP8 scaled matmul with 1x128 activation and 128x128 weight scales, if this build has it (the scale
    layouts it wants are tried in turn): (fn, how), or (None, why not)."""
    try:
        from torch.nn.functional import ScalingType, SwizzleType, scaled_mm  # torch >= 2.9
    except ImportError as exc:
        return None, f"not offered: {exc}"
    errors = []
    for a_scale in (sa, sa.t().contiguous().t()):
        for b_scale in (sw, sw.t(), sw.t().contiguous(), sw.contiguous().t()):
            def fn(a_scale=a_scale, b_scale=b_scale):
                return scaled_mm(a8, w8.t(), a_scale, ScalingType.BlockWise1x128, b_scale, ScalingType.BlockWise128x128,
                                 swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE,
                                 output_dtype=out_dtype)
            try:
                fn()
                return fn, (f"torch.nn.functional.scaled_mm BlockWise1x128 x BlockWise128x128 (scale strides "
                            f"{tuple(a_scale.stride())}, {tuple(b_scale.stride())})")
            except Exception as exc:  # noqa: BLE001 - report whatever this build says
                errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    return None, "not offered: " + " | ".join(sorted(set(errors)))[:600]


def _compile(job: tuple) -> str:
    """Compile one (shape, config) kernel in a worker process: TileLang's own disk cache keeps it for the timing
    loop, which then compiles nothing."""
    import backends
    from backends import tl
    from tilekernels.lang import Facade
    from tilekernels.ops import linear_fp8

    label, fields, n, k, groups, ue8m0 = job
    target = backends.get("sm90")
    func = linear_fp8.body_native(Facade(target.traits),
                                  linear_fp8.Variant(n, k, "bfloat16", (128, 128), groups, ue8m0=ue8m0),
                                  linear_fp8.Config(**fields))
    try:
        tl.tilelang().compile(func, target=target.tvm_target, execution_backend="tvm_ffi")
        return ""
    except Exception as exc:  # noqa: BLE001 - reported again by the timing loop
        return f"{label} {n}x{k}: {str(exc).splitlines()[-1][:160]}"


def precompile(jobs: list[tuple], workers: int) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for err in pool.map(_compile, jobs):
            if err:
                print("  compile failed:", err, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default=None, help="comma-separated config labels (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="compile the kernels in this many processes first")
    parser.add_argument("--ue8m0", action="store_true", help="exponent-byte weight scales (the engine's variant)")
    args = parser.parse_args()
    configs = {k: v for k, v in CONFIGS.items() if not args.only or k in args.only.split(",")}
    if args.jobs > 1:
        os.environ["TILELANG_DISABLE_CACHE"] = "0"  # the workers' builds, found again by the timing loop
        os.environ.setdefault("TILELANG_CACHE_DIR", "/tmp/tune-fp8-tilelang")
        precompile([(label, f, n, k, g, args.ue8m0) for _, n, k, g in SHAPES for label, f in configs.items()],
                   args.jobs)
    import backends
    from backends import tl
    from benchmarks.kernels import time_fn
    from tilekernels.lang import Facade
    from tilekernels.ops import act_quant, linear_fp8
    from tilekernels.quant import quantize

    tilelang = tl.tilelang()
    target = backends.get("sm90")
    m = args.rows
    results = []
    for name, n, k, groups in SHAPES:
        x = torch.randn(m, groups, k, device="cuda", dtype=torch.bfloat16).squeeze(1)
        w = quantize(torch.randn(groups * n, k, device="cuda") / k**0.5, "fp8", (128, 128))
        a8, sa = act_quant.reference(x.reshape(-1, k), 128, args.ue8m0)
        a2 = a8.view(torch.uint8).view(m, groups * k)
        sa2 = sa.view(m, -1).contiguous()
        flops = 2 * m * n * k * groups
        wb = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16)
        xb = x.view(m, groups, k).transpose(0, 1)
        ms, _ = time_fn(lambda: torch.bmm(xb, wb.transpose(1, 2)) if groups > 1 else torch.nn.functional.linear(x, wb[0]))
        row = {"shape": name, "n": n, "k": k, "groups": groups, "rows": m, "cublas_bf16_tflops": flops / ms / 1e9}
        print(f"{name} {groups}x{n}x{k} rows {m}: cuBLAS bf16 {row['cublas_bf16_tflops']:.0f} TFLOP/s", flush=True)
        if groups == 1:
            fn, how = torch_blockwise(a8, sa, w.values, w.scales)
            row["torch_fp8"] = how
            if fn is not None:
                ms, _ = time_fn(fn)
                row["torch_fp8_tflops"] = flops / ms / 1e9
            print(f"  torch FP8: {how} {row.get('torch_fp8_tflops', 0):.0f} TFLOP/s", flush=True)
        wq = w.with_exponent_bytes() if args.ue8m0 else w  # the weight as the kernels read it
        want = linear_fp8.emulated(x.view(m, groups, k) if groups > 1 else x, wq, groups).float()
        row["configs"] = []
        for label, fields in configs.items():
            cfg = linear_fp8.Config(**fields)
            v = linear_fp8.Variant(n, k, "bfloat16", (128, 128), groups, ue8m0=args.ue8m0)
            try:
                func = linear_fp8.body_native(Facade(target.traits), v, cfg)
                kern = tilelang.compile(func, target=target.tvm_target, execution_backend="tvm_ffi")
                c = torch.empty(m, groups * n, device="cuda", dtype=torch.bfloat16)
                call = lambda: kern(a2, sa2, wq.values.view(torch.uint8), wq.scales, c)  # noqa: E731
                ms, _ = time_fn(call)
                err = (c.float().view_as(want) - want).abs().max().item() / want.abs().max().item()
                row["configs"].append({"config": label, "tflops": flops / ms / 1e9, "rel_err": err})
                print(f"  {label}: {flops / ms / 1e9:.0f} TFLOP/s ({flops / ms / 1e9 / row['cublas_bf16_tflops']:.2f}x"
                      f" cuBLAS bf16), rel err {err:.1e}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a config that does not fit
                row["configs"].append({"config": label, "failed": str(exc).splitlines()[-1][:200]})
                print(f"  {label}: failed: {str(exc).splitlines()[-1][:160]}", flush=True)
        results.append(row)
        if args.json:  # after every shape: a variant that hangs (new synchronisation) loses no earlier results
            Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results},
                                                  indent=1))


if __name__ == "__main__":
    main()
