"""Tiles of the sm90 prefill indexer scores (tilekernels/ops/indexer_scores_sm90.py) against the portable body, at
V4-Flash widths (64 index heads of 128, bf16) for one prefill chunk whose queries share their keys, on the H200:

    python benchmarks/tune_indexer_prefill.py [--out tune.json] [--queries 4096,16384] [--keys 4096]

Every candidate is built first in parallel, then timed (median of CUDA-graph replays) through the kernel alone on
the padded inputs `indexer_scores.run` makes; TFLOP/s count the logits' GEMM (2 x S x E x nI x dI). Each candidate's
scores are checked against the portable body's. Labels: `portable`, `qN` (N queries per CTA), `-bM` (min_blocks).
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CANDIDATES = {"portable": None, "q4-b2": dict(queries=4, min_blocks=2), "q2-b3": dict(queries=2, min_blocks=3),
              "q8-b1": dict(queries=8, min_blocks=1), "q4-b0": dict(queries=4, min_blocks=0)}


def kernel_name(label: str) -> str:
    fields = CANDIDATES[label]
    return "indexer_scores@" + ("portable" if fields is None else ",".join(f"{k}={v}" for k, v in sorted(fields.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--queries", default="4096,16384")
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--jobs", type=int, default=8)
    args = parser.parse_args()
    start = time.perf_counter()

    import torch

    import backends
    from codegen import Compiler
    from codegen.driver import build_all
    from deepinfer.env import Env
    from tilekernels.ops import indexer_scores as isc

    v = isc.variant(torch.empty(1, 64, 128, dtype=torch.bfloat16, device="meta"), True)
    cache_dir = Env.read().cache_dir
    items = [("indexer_scores", kernel_name(lb), v) for lb in CANDIDATES]
    trial = "tilekernels.ops.indexer_scores_sm90:trial_request"
    for r in build_all("sm90", items, trial, cache_dir, jobs=args.jobs):
        if r.status == "failed":
            print(f"  build failed: {r.kernel}: {str(r.notes.get('error', ''))[-300:]}", flush=True)
    print(f"# built {len(items)} kernels in {time.perf_counter() - start:.0f} s", flush=True)

    from benchmarks.kernels import time_fn
    from tilekernels.ops.indexer_scores_sm90 import trial_request

    compiler = Compiler(backends.get("sm90"), cache_dir)
    out = []
    print("| candidate | queries | keys | ms | TFLOP/s | vs portable | max rel diff |\n|---|---|---|---|---|---|---|")
    for s in (int(x) for x in args.queries.split(",")):
        q, store, w, scale, rows = isc.example(v, s, "cuda", keys=args.keys)
        qq, ww = isc.pad_queries(q, w, v.block_q, v.heads, v.dim)
        idx = isc.pad_rows(rows, True, v.block_e)
        flops = 2 * s * args.keys * 64 * 128
        base = base_ms = None
        for label in CANDIDATES:
            res = torch.empty(qq.shape[0], idx.shape[1], v.block_e, dtype=torch.float32, device="cuda")
            try:
                fn = compiler.load(trial_request("indexer_scores", kernel_name(label), v))
                call = lambda: fn(qq.view(-1, v.dim), store, idx, ww, res, float(scale))  # noqa: E731
                call()
                ms, _ = time_fn(call)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"| {label} | {s} | {args.keys} | failed: {str(exc).splitlines()[-1][:160]} |", flush=True)
                continue
            if base is None:
                base, base_ms = res.clone(), ms
            diff = ((res - base).abs().max() / base.abs().max()).item()
            row = dict(candidate=label, queries=s, keys=args.keys, ms=ms, tflops=flops / ms / 1e9,
                       vs_portable=base_ms / ms, rel_diff=diff)
            out.append(row)
            print(f"| {label} | {s} | {args.keys} | {ms:.3f} | {row['tflops']:.0f} | {row['vs_portable']:.2f}x | "
                  f"{diff:.1e} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
