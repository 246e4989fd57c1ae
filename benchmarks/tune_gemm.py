"""Try tile configs of the portable GEMM body on the GPU at prefill shapes, against cuBLAS (torch.nn.functional.linear).

    python benchmarks/tune_gemm.py [--rows 4096]

Prints TFLOP/s per (shape, config); pick the best into `tilekernels/ops/linear.py`'s configs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = [(128, 128, 64, 3, 256), (128, 256, 64, 3, 256), (128, 256, 64, 4, 256), (128, 128, 64, 4, 256),
           (256, 128, 64, 3, 256), (128, 256, 32, 4, 256)]
SHAPES = [(1024, 4096), (32768, 1024), (4096, 8192), (129280, 4096)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4096)
    args = parser.parse_args()
    import backends
    from backends import tl
    from benchmarks.kernels import time_fn
    from tilekernels.lang import Facade
    from tilekernels.ops import linear

    tilelang = tl.tilelang()
    target = backends.get("sm90")
    for n, k in SHAPES:
        a = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        flops = 2 * args.rows * n * k
        ms, _ = time_fn(lambda: torch.nn.functional.linear(a, w))
        print(f"{n}x{k} rows {args.rows}: cuBLAS {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        for bm, bn, bk, stages, threads in CONFIGS:
            cfg = linear.Config(bm, bn, bk, stages, threads)
            func = linear.body(Facade(target.traits), linear.Variant(n, k, "bfloat16"), cfg)
            try:
                kern = tilelang.compile(func, target=target.tvm_target, execution_backend="tvm_ffi")
                c = torch.empty(args.rows, n, device="cuda", dtype=torch.bfloat16)
                ms, _ = time_fn(lambda: kern(a, w, c))
                err = (c.float() - torch.nn.functional.linear(a, w).float()).abs().max().item()
                print(f"  {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{stages} t{threads}: {flops / ms / 1e9:.0f} TFLOP/s"
                      f" (max err {err:.3f})", flush=True)
            except Exception as exc:  # a config that does not fit (shared memory, registers)
                print(f"  {bm}x{bn}x{bk} s{stages} t{threads}: failed: {str(exc).splitlines()[-1][:120]}", flush=True)


if __name__ == "__main__":
    main()
