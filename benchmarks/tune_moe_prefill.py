"""Tiles of the sm90 bf16 routed-expert GEMM at prefill sizes (tilekernels/ops/moe_bf16_prefill_sm90.py) against the
portable 64-row body and cuBLAS, at V4-Flash expert shapes (256 experts, top 6, uniform random routing), on the H200:

    python benchmarks/tune_moe_prefill.py [--out tune.json] [--only LABELS] [--tokens 4096,16384]

Every candidate is built first in parallel (`codegen.driver.build_all`), then one grouped GEMM (gate_up: N 4096 x
K 4096, down: 4096 x 2048) over the expert-major layout of its M-tile height is timed (median of CUDA-graph
replays). TFLOP/s count the useful rows only (tokens x 6, not the layout's padding rows); `cuBLAS` is one dense
GEMM of the same useful FLOPs (tokens x 6 rows against one expert's weight): the rate a grouped GEMM would reach
with no grouping cost. Each candidate's rows are checked against fp32 products of four experts. Labels: `portable`
is the portable body at 64 rows (the kernel before the override), `mBM` the override with BM-row tiles and the
Tune fields after it (`n`: block_n, `k`: block_k, `s`: stages, `p`: swizzle panel, `c0`: no staged output).
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"gate_up": (4096, 4096), "down": (4096, 2048)}  # N, K
EXPERTS, TOP_K = 256, 6
CANDIDATES = {  # label -> (block_m, Tune fields; None: the portable body)
    "portable": (64, None),
    "m64-n256-s3": (64, dict(block_n=256, stages=3)),
    "m64-n256-s4": (64, dict(block_n=256, stages=4)),
    "m64-n128-s4": (64, dict(block_n=128, stages=4)),
    "m128-n256-s3": (128, dict(block_n=256, stages=3)),
    "m128-n256-s3-p8": (128, dict(block_n=256, stages=3, panel=8)),
    "m128-n256-s4-c0": (128, dict(block_n=256, stages=4, stage_c=0)),
    "m128-n128-s4": (128, dict(block_n=128, stages=4)),
    "m128-n128-k128-s3": (128, dict(block_n=128, block_k=128, stages=3)),
}


def kernel_name(label: str) -> str:
    fields = CANDIDATES[label][1]
    if fields is None:
        return "grouped_gemm@portable"
    return "grouped_gemm@" + ",".join(f"{k}={v}" for k, v in sorted(fields.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="comma-separated labels")
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--jobs", type=int, default=16)
    args = parser.parse_args()
    start = time.perf_counter()

    import backends
    from codegen import Compiler
    from codegen.driver import build_all
    from deepinfer.env import Env
    from tilekernels.ops import moe_experts

    labels = [lb for lb in CANDIDATES if args.only is None or lb in args.only.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]

    def variant(label, shape):
        n, k = SHAPES[shape]
        return moe_experts.Variant(n, k, EXPERTS, "bfloat16", CANDIDATES[label][0])

    items = list(dict.fromkeys(("moe_experts", kernel_name(lb), variant(lb, s)) for lb in labels for s in SHAPES))
    cache_dir = Env.read().cache_dir
    trial = "tilekernels.ops.moe_bf16_prefill_sm90:trial_request"
    results = build_all("sm90", items, trial, cache_dir, jobs=args.jobs)
    failed = {r.kernel + json.dumps(r.variant, sort_keys=True) for r in results if r.status == "failed"}
    for r in results:
        if r.status == "failed":
            print(f"  build failed: {r.kernel} {r.variant}: {str(r.notes.get('error', ''))[-300:]}", flush=True)
    print(f"# built {len(items)} kernels in {time.perf_counter() - start:.0f} s", flush=True)

    import torch

    from benchmarks.kernels import time_fn
    from tilekernels.ops.moe_bf16_prefill_sm90 import trial_request

    compiler = Compiler(backends.get("sm90"), cache_dir)
    out = []
    print("| candidate | shape | tokens | ms | TFLOP/s | vs cuBLAS | padding | err |\n|---|---|---|---|---|---|---|---|",
          flush=True)
    for shape, (n, k) in SHAPES.items():
        torch.manual_seed(0)
        w = (torch.randn(EXPERTS, n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        for t in tokens:
            idx = torch.rand(t, EXPERTS, device="cuda").topk(TOP_K, dim=-1).indices
            flat = idx.reshape(-1)
            x = torch.randn(flat.numel(), k, device="cuda").to(torch.bfloat16)
            flops = 2 * flat.numel() * n * k
            dense = lambda: torch.mm(x, w[0].T)  # noqa: E731
            cublas_ms, _ = time_fn(dense)
            print(f"| cuBLAS (dense, same FLOPs) | {shape} | {t} | {cublas_ms:.3f} | {flops / cublas_ms / 1e9:.0f} | "
                  f"1.00x | | |", flush=True)
            for label in labels:
                v = variant(label, shape)
                name = kernel_name(label)
                if name + json.dumps(vars(v), sort_keys=True) in failed:
                    continue
                dest, tiles = moe_experts.layout(idx, EXPERTS, v.block_m)
                a = torch.zeros(tiles.numel() * v.block_m, k, dtype=torch.bfloat16, device="cuda")
                a[dest] = x
                c = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device="cuda")
                try:
                    fn = compiler.load(trial_request("moe_experts", name, v))
                    call = lambda: fn(a, w, tiles, c)  # noqa: E731
                    call()
                    err = 0.0
                    for e in flat.unique()[:4].tolist():
                        rows = dest[flat == e]
                        want = a[rows].float() @ w[e].float().T
                        err = max(err, ((c[rows].float() - want).abs().max() / want.abs().max()).item())
                    ms, _ = time_fn(call)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"| {label} | {shape} | {t} | failed: {str(exc).splitlines()[-1][:160]} |", flush=True)
                    continue
                used = int((tiles >= 0).sum()) * v.block_m
                row = dict(candidate=label, shape=shape, tokens=t, ms=ms, tflops=flops / ms / 1e9,
                           vs_cublas=cublas_ms / ms, padding=used / flat.numel() - 1, rel_err=err)
                out.append(row)
                flag = "" if err < 1e-2 else " WRONG"
                print(f"| {label} | {shape} | {t} | {ms:.3f} | {row['tflops']:.0f} | {row['vs_cublas']:.2f}x | "
                      f"{row['padding']:.0%} | {err:.0e}{flag} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
