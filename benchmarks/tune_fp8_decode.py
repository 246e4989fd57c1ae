"""Tiles of the sm90 FP8 decode GEMM (tilekernels/ops/linear_fp8_decode_sm90.py) against the narrow tile it replaces
and cuBLAS bf16 on the same rows, at V4-Flash's FP8 projection shapes (V4's exponent-byte scales), on the GPU:

    python benchmarks/tune_fp8_decode.py [--out tune.json] [--only LABELS] [--rows 1,4,8] [--shapes ...]
    python benchmarks/tune_fp8_decode.py --build-only      # on a machine without a GPU: fill DEEPINFER_CACHE_DIR

Every candidate is built first in parallel (`codegen.driver.build_all`), then the whole projection as the model runs
it (`linear_fp8.gemm`: the activations' `act_quant`, the GEMM, the split-K sum) is timed as the median of CUDA-graph
replays of calls over enough weight copies to leave L2 (a step reads each weight once): us per call, GB/s (FP8
weights and their scales, activations read once, the output written once), the fraction of the measured copy
bandwidth. `narrow` is the narrow 64 x 64 tile (`linear_fp8.body_native`: the engine's kernel before the override),
`current` the override with its configured tile; other labels name Tune fields (`n128`: block_n, `m8`: block_m,
`k2`: blocks, `s4`: stages, `b4`: min_blocks, `p0`: prefetch; `x2`: K split twice more). cuBLAS bf16 on the
same shape reads twice the weight bytes: its time is printed for scale, not as the aim (the copy bandwidth is).
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # name -> (groups, N, K) per group: V4-Flash's FP8 projections of at least linear.SWAP_WEIGHT values
    "q_b": (1, 32768, 1024), "o_b": (1, 4096, 8192), "o_a": (8, 1024, 4096), "gate_up": (1, 4096, 4096),
    "down": (1, 4096, 2048),
}
ROWS = (1, 4, 8)
L2_BYTES = 200 << 20  # weight copies per timed call until their bytes pass this (the H100 / H200's L2 is 50 MB)
TRIAL = "tilekernels.ops.linear_fp8_decode_sm90:trial_request"

CANDIDATES = {  # label -> Tune fields (None: the narrow tile / the configured override); `splitx`: K split this
    # many times more than the engine's (`linear.split_factor`), where the scale blocks allow
    "narrow": None,
    "current": None,
    "s6-b3": dict(stages=6, min_blocks=3),
    "s4-b4": dict(stages=4, min_blocks=4),
    "s5-b4": dict(stages=5, min_blocks=4),
    "s8-b2": dict(stages=8, min_blocks=2),
    "n128-s4-b2": dict(block_n=128, stages=4, min_blocks=2),
    "m8-s6-b3": dict(block_m=8, stages=6, min_blocks=3),
    "m8-s6-b4": dict(block_m=8, stages=6, min_blocks=4),
    "m8-s8-b3": dict(block_m=8, stages=8, min_blocks=3),
    "m8-s4-b4": dict(block_m=8, stages=4, min_blocks=4),
    "m8-s6-b3-x2": dict(block_m=8, stages=6, min_blocks=3, splitx=2),
    "m8-s6-b4-x2": dict(block_m=8, stages=6, min_blocks=4, splitx=2),
    "m8-k2-s4-b3": dict(block_m=8, blocks=2, stages=4, min_blocks=3),
    "m8-k2-s3-b4": dict(block_m=8, blocks=2, stages=3, min_blocks=4),
    "m8-k2-s4-b3-x2": dict(block_m=8, blocks=2, stages=4, min_blocks=3, splitx=2),
    "p0": dict(prefetch=0),  # the default tile without (or with more of) the weight rows' L2 prefetch
    "p6": dict(prefetch=6),
    "p12": dict(prefetch=12),
}


def kernel_name(label: str) -> str:
    tune = {k: v for k, v in (CANDIDATES[label] or {}).items() if k != "splitx"}
    if label == "narrow":
        return "gemm_fp8@narrow"
    return "gemm_fp8@" + ",".join(f"{k}={v}" for k, v in sorted(tune.items()))


def todo_items(labels, shapes, rows) -> list[tuple]:
    """(label, shape, rows, variant) of every timed point: the engine's variant at those rows, swapped (K split
    `splitx` times more where each slice keeps whole 128-deep blocks)."""
    from tilekernels.ops import linear_fp8

    out = []
    for lb in labels:
        for s, (g, n, k) in shapes.items():
            for m in rows:
                v = dataclasses.replace(linear_fp8.variant(m, n, k, (128, 128), True, g), narrow=True, swapped=True)
                more = v.split_k * (CANDIDATES[lb] or {}).get("splitx", 1)
                if (k // 128) % more == 0:
                    v = dataclasses.replace(v, split_k=more)
                out.append((lb, s, m, v))
    return out


class TrialLauncher:
    """`launch(op, kernel, variant)` with the linear op's gemm_fp8 replaced by a candidate's build (memoized)."""

    def __init__(self, compiler, label: str, loaded: dict):
        self.compiler, self.label, self.loaded, self.invariant = compiler, label, loaded, False

    def __call__(self, op: str, kernel: str, variant):
        from tilekernels.ops.linear_fp8_decode_sm90 import trial_request

        name = kernel_name(self.label) if (op, kernel) == ("linear", "gemm_fp8") else kernel
        key = (op, name, variant)
        if key not in self.loaded:
            self.loaded[key] = self.compiler.load(trial_request(op, name, variant))
        return self.loaded[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="comma-separated labels")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows, up to linear.SWAP_ROWS")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--build-only", action="store_true", help="build the candidates (and act_quant, split_sum)")
    args = parser.parse_args()
    start = time.perf_counter()

    from codegen import Compiler
    from codegen.driver import build_all
    from deepinfer.env import Env
    from tilekernels.ops import act_quant, split_sum

    import backends

    labels = [lb for lb in CANDIDATES if args.only is None or lb in args.only.split(",")]
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    rows = [int(r) for r in args.rows.split(",")]
    todo = todo_items(labels, shapes, rows)
    cache_dir = Env.read().cache_dir
    items = list(dict.fromkeys(("linear", kernel_name(lb), v) for lb, _, _, v in todo))
    for _, s, m, v in todo:  # the projection's other kernels, the op's own
        g, n, k = shapes[s]
        items.append(("act_quant", "act_quant", act_quant.Variant(k, 128, "bfloat16", True)))
        if v.split_k > 1:
            items.append(("linear", "split_sum", split_sum.Variant(v.split_k, g * n, "bfloat16")))
    items = list(dict.fromkeys(items))
    results = build_all("sm90", items, TRIAL, cache_dir, jobs=args.jobs)
    failed = {(r.kernel, json.dumps(r.variant, sort_keys=True)) for r in results if r.status == "failed"}
    for r in results:
        if r.status == "failed":
            print(f"  build failed: {r.kernel} {r.variant}: {str(r.notes.get('error', ''))[-300:]}", flush=True)
    print(f"# built {len(items)} kernels in {time.perf_counter() - start:.0f} s", flush=True)
    if args.build_only:
        return

    import torch

    from benchmarks.decode import copy_bandwidth
    from benchmarks.kernels import time_fn
    from tilekernels.kernels import OpLauncher
    from tilekernels.ops import linear_fp8
    from tilekernels.quant import quantize

    compiler = Compiler(backends.get("sm90"), cache_dir)
    loaded: dict = {}
    bw = copy_bandwidth()
    print(f"# copy bandwidth {bw:.0f} GB/s", flush=True)
    out, cublas, operands = [], {}, {}
    print("| candidate | shape | rows | split | us | GB/s | of copy | cuBLAS bf16 us | err |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for label, name, m, v in todo:
        g, n, k = shapes[name]
        if (name, m) not in operands:
            torch.manual_seed(0)
            copies = max(1, min(32, -(-L2_BYTES // (g * n * k))))
            ws = [quantize(torch.randn(g * n, k, device="cuda") / k**0.5, "fp8", (128, 128), pow2_scales=True)
                  .with_exponent_bytes() for _ in range(copies)]
            x = torch.randn(m, g, k, device="cuda", dtype=torch.bfloat16)
            want = linear_fp8.emulated(x if g > 1 else x.view(m, k), ws[0], g, torch.float32).reshape(m, g * n)
            wb = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
            ms, _ = time_fn(lambda: torch.einsum("mgk,gnk->mgn", x, wb))
            operands[(name, m)] = (ws, x, want)
            cublas[(name, m)] = ms
        ws, x, want = operands[(name, m)]
        if (kernel_name(label), json.dumps(vars(v), sort_keys=True)) in failed:
            continue
        launch = OpLauncher(TrialLauncher(compiler, label, loaded), "linear")

        def call(w, launch=launch):
            # the engine's call with this candidate's variant (linear_fp8.gemm picks the same split, narrow and
            # swapped; the candidate's build stands in for its gemm_fp8)
            return linear_fp8.gemm(launch, x if g > 1 else x.view(m, k), w, g).reshape(m, g * n)
        try:
            got = call(ws[0])
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            ms, _ = time_fn(lambda: [call(w) for w in ws])
            ms /= len(ws)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"| {label} | {name} | {m} | failed: {str(exc).splitlines()[-1][:160]} |", flush=True)
            continue
        wbytes = g * n * k + ws[0].scales.numel() * ws[0].scales.element_size()
        gbs = (wbytes + 2 * m * g * k + 2 * m * g * n) / ms / 1e6
        row = dict(candidate=label, shape=name, rows=m, split=v.split_k, us=ms * 1e3, gbs=gbs, of_copy=gbs / bw,
                   cublas_bf16_us=cublas[(name, m)] * 1e3, rel_err=err)
        out.append(row)
        flag = "" if err < 1e-2 else " WRONG"
        print(f"| {label} | {name} | {m} | {v.split_k} | {row['us']:.1f} | {gbs:.0f} | {gbs / bw:.0%} | "
              f"{row['cublas_bf16_us']:.1f} | {err:.0e}{flag} |", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbs": bw,
                                                  "rows": out}, indent=1))


if __name__ == "__main__":
    main()
