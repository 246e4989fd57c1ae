"""Tiles of the sm90 bf16 `linear` override at decode rows (tilekernels/ops/linear_decode_sm90.py) against the
portable narrow tile it replaces and torch (cuBLAS), at V4-Flash projection shapes, on the H200:

    python benchmarks/tune_linear_decode.py [--out tune.json] [--only LABELS] [--rows 1,4,16,64] [--shapes ...]

Every candidate is built first in parallel (`codegen.driver.build_all`), then timed through `linear.gemm` (split-K
sums included) as the median of CUDA-graph replays of calls over enough weight copies to leave L2 (a step reads
each weight once): ms per call, GB/s (weights and activations read once, the output written once), the fraction
of the measured copy bandwidth and the speed-up over cuBLAS. `portable` is the portable narrow body, `current`
the override with its configured tile; other labels name Tune fields (`m16`: block_m 16, `k128`, `s4`: stages,
`n128`: block_n, `b0`: min_blocks, `p0`: prefetch). Every row count is timed with the swapped variant (the
override) and the narrow one (the portable body), whichever `linear.variant` picks there.
"""

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # name -> (groups, N, K) per group
    "lm_head": (1, 129280, 4096), "q_b": (1, 32768, 1024), "o_b": (1, 4096, 8192), "o_a": (8, 1024, 4096),
    "gate_up": (1, 4096, 4096), "down": (1, 4096, 2048), "q_a": (1, 1024, 4096), "kv": (1, 512, 4096),
    "idx_q_b": (1, 8192, 1024),
}
ROWS = (1, 4, 16, 64)
L2_BYTES = 200 << 20  # weight copies per timed call until their bytes pass this (the H200's L2 is 50 MB)

CANDIDATES = {  # label -> Tune fields (None: the portable body / the configured override)
    "portable": None,
    "current": None,
    "m16-k128-s4": dict(block_m=16, block_k=128, stages=4),
    "m16-k128-s6": dict(block_m=16, block_k=128, stages=6),
    "m16-k256-s3": dict(block_m=16, block_k=256, stages=3),
    "m16-k64-s8": dict(block_m=16, block_k=64, stages=8),
    "m16-n128-k128-s4": dict(block_m=16, block_n=128, block_k=128, stages=4),
    "m32-k128-s4": dict(block_m=32, block_k=128, stages=4),
    "m64-k128-s3": dict(block_m=64, block_k=128, stages=3),
    "m16-k128-s4-b0": dict(block_m=16, block_k=128, stages=4, min_blocks=0),
    "p0": dict(prefetch=0),  # the configured tile without (or with more of) the weight rows' L2 prefetch
    "p8": dict(prefetch=8),
    "p16": dict(prefetch=16),
}


def kernel_name(label: str) -> str:
    tune = CANDIDATES[label]
    if label == "portable":
        return "gemm@portable"
    if tune is None:
        return "gemm@"
    return "gemm@" + ",".join(f"{k}={v}" for k, v in sorted(tune.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="comma-separated labels")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows, up to linear.ROW_BUCKETS[0]")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--jobs", type=int, default=16)
    args = parser.parse_args()
    start = time.perf_counter()

    from codegen import Compiler
    from codegen.driver import build_all
    from deepinfer.env import Env
    from tilekernels.ops import linear

    import backends

    labels = [lb for lb in CANDIDATES if args.only is None or lb in args.only.split(",")]
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    rows = [int(r) for r in args.rows.split(",")]
    todo = [(lb, s, m, dataclasses.replace(linear.variant(m, n, k, g), narrow=True, swapped=lb != "portable"))
            for lb in labels for s, (g, n, k) in shapes.items() for m in rows]
    cache_dir = Env.read().cache_dir
    trial = "tilekernels.ops.linear_decode_sm90:trial_request"
    items = list(dict.fromkeys(("linear", kernel_name(lb), v) for lb, _, _, v in todo))
    results = build_all("sm90", items, trial, cache_dir, jobs=args.jobs)
    failed = {(r.kernel, json.dumps(r.variant, sort_keys=True)) for r in results if r.status == "failed"}
    for r in results:
        if r.status == "failed":
            print(f"  build failed: {r.kernel} {r.variant}: {str(r.notes.get('error', ''))[-300:]}", flush=True)
    print(f"# built {len(items)} kernels in {time.perf_counter() - start:.0f} s", flush=True)

    import torch

    from benchmarks.decode import copy_bandwidth
    from benchmarks.kernels import time_fn
    from tilekernels.ops.linear_decode_sm90 import trial_request

    compiler = Compiler(backends.get("sm90"), cache_dir)
    loaded: dict = {}

    def launcher(label):
        def launch(kernel, variant):  # the candidate's gemm; split_sum as the op builds it
            from tilekernels.kernels import request

            name = kernel_name(label) if kernel == "gemm" else kernel
            if (name, variant) not in loaded:
                req = trial_request("linear", name, variant) if kernel == "gemm" else request("linear", kernel, variant)
                loaded[(name, variant)] = compiler.load(req)
            return loaded[(name, variant)]
        launch.invariant = False
        return launch

    bw = copy_bandwidth()
    print(f"# copy bandwidth {bw:.0f} GB/s", flush=True)
    out, cublas, operands = [], {}, {}
    print("| candidate | shape | rows | split | us | GB/s | of copy | vs cuBLAS | err |\n|---|---|---|---|---|---|---|---|---|")
    for label, name, m, v in todo:
        g, n, k = shapes[name]
        if (name, m) not in operands:
            torch.manual_seed(0)
            wbytes = g * n * k * 2
            copies = max(1, min(32, -(-L2_BYTES // wbytes)))
            ws = [torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            x = torch.randn(m, g, k, device="cuda", dtype=torch.bfloat16)
            want = torch.einsum("mgk,gnk->mgn", x.float(), ws[0].float())
            ms, _ = time_fn(lambda: [torch.einsum("mgk,gnk->mgn", x, w) for w in ws])
            operands[(name, m)] = (ws, x, want)
            cublas[(name, m)] = ms / copies
        ws, x, want = operands[(name, m)]
        if (kernel_name(label), json.dumps(vars(v), sort_keys=True)) in failed:
            continue
        launch = launcher(label)

        def call(w, launch=launch):
            if g == 1:
                return linear.gemm(launch, x.view(m, k), w.view(n, k), v).view(m, 1, n)
            return linear.gemm(launch, x, w, v)
        try:
            got = call(ws[0])
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            ms, _ = time_fn(lambda: [call(w) for w in ws])
            ms /= len(ws)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"| {label} | {name} | {m} | failed: {str(exc).splitlines()[-1][:160]} |", flush=True)
            continue
        gbs = 2 * (g * n * k + m * g * k + m * g * n) / ms / 1e6
        row = dict(candidate=label, shape=name, rows=m, split=v.split_k, us=ms * 1e3, gbs=gbs, of_copy=gbs / bw,
                   cublas_us=cublas[(name, m)] * 1e3, vs_cublas=cublas[(name, m)] / ms, rel_err=err)
        out.append(row)
        flag = "" if err < 2e-2 else " WRONG"
        print(f"| {label} | {name} | {m} | {v.split_k} | {row['us']:.1f} | {gbs:.0f} | {gbs / bw:.0%} | "
              f"{row['vs_cublas']:.2f}x | {err:.0e}{flag} |", flush=True)
    print("# per candidate: geometric mean of the speed-up over cuBLAS (and over portable)")
    base = {(r["shape"], r["rows"]): r["us"] for r in out if r["candidate"] == "portable"}
    for label in labels:
        got = [r for r in out if r["candidate"] == label and r["rel_err"] < 2e-2]
        if got:
            gm = math.exp(sum(math.log(r["vs_cublas"]) for r in got) / len(got))
            gp = [base[(r["shape"], r["rows"])] / r["us"] for r in got if (r["shape"], r["rows"]) in base]
            gpm = math.exp(sum(math.log(x) for x in gp) / len(gp)) if gp else float("nan")
            print(f"  {label:<22} {gm:.3f}x cuBLAS, {gpm:.3f}x portable over {len(got)}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbs": bw, "rows": out},
                                             indent=1))


if __name__ == "__main__":
    main()
