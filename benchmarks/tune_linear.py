"""Tile configs of the sm90 bf16 `linear` override at prefill rows (tilekernels/ops/linear_sm90.py) against torch
(cuBLAS), on the H200 or H100:

    python benchmarks/tune_linear.py [--out tune.json] [--only LABELS] [--rows 512,4096,16384]
                                     [--shapes q_a,q_b,o_b,lm_head] [--jobs 16]

Every candidate is first built in parallel (`codegen.driver.build_all`, worker processes) into
DEEPINFER_CACHE_DIR, then timed (median of CUDA-graph replays, `benchmarks.kernels.time_fn`) through
`linear.gemm`. `big-*` candidates are override tiles; `current` is linear.py's sm90 selection (the override with
its configured tile), `portable` the portable body. In a label: `sN` pipeline stages, `wN` swizzle panels of N row
tiles (w0: row-major block order), `stc` the output tile staged in shared memory (TMA store), `2cta` two CTAs an SM
(`Tiles.min_blocks`), `nows` built without the producer warpgroup, `ws-...-pN` the persistent body of N programs
(`linear_sm90.body_ws`; its `wN` walks panels of N row tiles rows first). Prints ms, TFLOP/s,
GB/s (each operand read once, the output written once) and the speed-up over cuBLAS; the best goes into
linear.py's sm90 `Config(large=)`.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"q_a": (1024, 4096), "q_b": (32768, 1024), "o_b": (4096, 8192), "lm_head": (129280, 4096)}  # (N, K)
ROWS = (512, 4096, 16384)
DEVICE = "cuda"


def _t(bm, bn, bk, stages, threads, panel=0, stage_c=False, min_blocks=0, ws=True, programs=0):
    """The override's Tiles fields, and `ws`: False builds the candidate with TileLang's
    `tl.disable_warp_specialized` (no producer warpgroup: every thread issues cp.async loads; a tune trial only, the
    engine's override always builds warp-specialised)."""
    return dict(block_m=bm, block_n=bn, block_k=bk, stages=stages, threads=threads, panel=panel, stage_c=stage_c,
                min_blocks=min_blocks, ws=ws, programs=programs)


CANDIDATES = {  # label -> the override's Tiles fields (None: linear.py's selection / the portable body)
    "big-128x256x64-s3-w8": _t(128, 256, 64, 3, 256, 8),
    "big-128x256x64-s4-w8": _t(128, 256, 64, 4, 256, 8),
    "big-128x256x64-s3-w8-stc": _t(128, 256, 64, 3, 256, 8, True),
    "big-128x256x64-s3-w16": _t(128, 256, 64, 3, 256, 16),
    "big-128x256x64-s3-w0": _t(128, 256, 64, 3, 256, 0),
    "big-128x128x64-s4-w8": _t(128, 128, 64, 4, 256, 8),
    "big-128x128x64-s4-w8-stc": _t(128, 128, 64, 4, 256, 8, True),
    "big-128x256x64-s3-w32-stc": _t(128, 256, 64, 3, 256, 32, True),
    "big-256x128x64-s3-w8": _t(256, 128, 64, 3, 256, 8),
    "big-256x128x64-s3-w8-stc": _t(256, 128, 64, 3, 256, 8, True),
    "big-128x128x64-s2-w8-stc-2cta-nows": _t(128, 128, 64, 2, 256, 8, True, 2, ws=False),
    "big-128x128x64-s3-w8-stc-2cta-nows": _t(128, 128, 64, 3, 256, 8, True, 2, ws=False),
    "big-64x128x64-s4-w8-stc-2cta": _t(64, 128, 64, 4, 128, 8, True, 2),
    # linear_sm90.body_ws: persistent (p: programs), explicitly warp-specialised, stores not waited for (w: panels
    # of row tiles walked rows first); linear.py's `short` tile where K <= 2,048
    "big-ws-128x256x64-s3-w16-p132": _t(128, 256, 64, 3, 256, 16, programs=132),
    "big-ws-128x256x64-s3-w8-p132": _t(128, 256, 64, 3, 256, 8, programs=132),
    "big-ws-128x128x64-s5-w16-p132": _t(128, 128, 64, 5, 256, 16, programs=132),
    "current": None,
    "portable": None,
}


def bucket(label: str) -> str:
    return label.split("-")[0]


def variant_of(rows: int, n: int, k: int):
    """The variant `rows` rows of shape (n, k) run with (None: not a prefill row count, the override's bucket)."""
    from tilekernels.ops import linear

    return linear.variant(rows, n, k) if rows > linear.ROW_BUCKETS[1] else None


def kernel_name(label: str) -> str:
    """The kernel name a candidate builds under: its tiles spelled out (candidates with the same tiles and variant
    share one build), or `current` / `portable`."""
    tiles = CANDIDATES[label]
    if tiles is None:
        return f"gemm@{label}"
    return "gemm@" + ",".join(f"{k}={int(v)}" for k, v in sorted(tiles.items()))


def candidate_request(op: str, kernel: str, variant):
    """The build request of candidate kernel `kernel_name(label)` (importable by name: build workers call it)."""
    from codegen import Request
    from tilekernels.lang import Facade
    from tilekernels.ops import linear, linear_sm90

    spec = kernel.split("@", 1)[1]
    base = linear.KERNEL.config("sm90")

    def build(target):
        facade = Facade(target.traits)
        if spec == "portable":
            return linear.body(facade, variant, base)
        if spec == "current":
            return linear.KERNEL.body_for(target.name, variant)(facade, variant, base)
        fields = {k: (v == "1" if k == "stage_c" else int(v)) for k, v in (kv.split("=") for kv in spec.split(","))}
        fields.pop("ws", None)  # not a tile field: the pass config below
        tiles = linear_sm90.Tiles(**fields)
        return linear_sm90.body(facade, variant, base, tiles)

    def pass_configs(target):
        configs = dict(base.pass_configs)
        if "ws=0" in spec.split(","):
            configs["tl.disable_warp_specialized"] = True
        return configs

    return Request(op, kernel, variant, build, pass_configs)


def plan(labels: list[str], shapes: dict, rows: list[int]) -> list[tuple]:
    """(label, shape name, rows, variant) of every timing, in order."""
    out = []
    for label in labels:
        for name, (n, k) in shapes.items():
            for m in rows:
                v = variant_of(m, n, k)
                if v is not None:
                    out.append((label, name, m, v))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--only", default=None, help="comma-separated labels or label prefixes (big, current, portable)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--build-only", action="store_true", help="build the candidates, time nothing (no GPU needed)")
    parser.add_argument("--max-lm-head-rows", type=int, default=16384, help="skip lm_head above this many rows")
    args = parser.parse_args()
    start = time.perf_counter()

    tokens = args.only.split(",") if args.only else None
    labels = [lb for lb in CANDIDATES if tokens is None or any(lb == t or lb.startswith(t) for t in tokens)]
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    rows = [int(r) for r in args.rows.split(",")]
    todo = [(lb, s, m, v) for lb, s, m, v in plan(labels, shapes, rows) if s != "lm_head" or m <= args.max_lm_head_rows]

    from codegen import Compiler
    from codegen.driver import build_all
    from deepinfer.env import Env

    import backends

    cache_dir = Env.read().cache_dir
    items = list(dict.fromkeys(("linear", kernel_name(lb), v) for lb, _, _, v in todo))
    print(f"# building {len(items)} kernels ({len(labels)} candidates) into {cache_dir} with {args.jobs} jobs",
          flush=True)
    results = build_all("sm90", items, "benchmarks.tune_linear:candidate_request", cache_dir, jobs=args.jobs)
    failed = {(r.kernel, json.dumps(r.variant, sort_keys=True)): r.notes.get("error", r.path)
              for r in results if r.status == "failed"}
    for (kernel, variant), why in failed.items():
        print(f"  build failed: {kernel} {variant}: {str(why).splitlines()[-1][:200]}", flush=True)
    print(f"# built in {time.perf_counter() - start:.0f} s", flush=True)
    if args.build_only:
        return

    import torch

    from benchmarks.kernels import time_fn
    from tilekernels.ops import linear

    compiler = Compiler(backends.get("sm90"), cache_dir)
    loaded: dict = {}

    def launcher(label):
        def launch(kernel, variant):
            key = (kernel_name(label), variant)
            if key not in loaded:
                loaded[key] = compiler.load(candidate_request("linear", kernel_name(label), variant))
            return loaded[key]
        return launch

    rows_out, cublas = [], {}
    header = (f"| {'candidate':<30} | {'shape':<7} | {'rows':>5} | split | {'ms':>8} | {'TFLOP/s':>7} | {'GB/s':>6} | "
              f"vs cuBLAS | err |")
    print(header + "\n|" + "---|" * 9, flush=True)
    current = None
    for label, name, m, v in todo:
        n, k = shapes[name]
        if (name, m) != current:  # a new shape or row count: fresh operands
            current = (name, m)
            torch.manual_seed(0)
            copies = 1
            ws = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            want = torch.nn.functional.linear(x.float(), ws[0].float())
            nbytes, flops = 2 * (m * k + n * k + m * n), 2 * m * n * k
            ms, _ = time_fn(lambda: [torch.nn.functional.linear(x, w) for w in ws])
            cublas[(name, m)] = ms / copies
        if (kernel_name(label), json.dumps(vars(v), sort_keys=True)) in failed:
            rows_out.append(dict(candidate=label, shape=name, rows=m, variant=vars(v), failed=True))
            continue
        launch = launcher(label)
        try:
            got = linear.gemm(launch, x, ws[0], v)
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            ms, _ = time_fn(lambda: [linear.gemm(launch, x, w, v) for w in ws])
            ms /= copies
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"| {label:<30} | {name:<7} | {m:>5} | failed: {str(exc).splitlines()[-1][:120]}", flush=True)
            rows_out.append(dict(candidate=label, shape=name, rows=m, variant=vars(v), failed=True,
                                 error=str(exc)[-400:]))
            continue
        ref = cublas[(name, m)]
        row = dict(candidate=label, shape=name, n=n, k=k, rows=m, variant=vars(v), ms=ms,
                   tflops=flops / ms / 1e9, gbs=nbytes / ms / 1e6, cublas_ms=ref, vs_cublas=ref / ms, rel_err=err)
        rows_out.append(row)
        flag = "" if err < 2e-2 else " WRONG"
        print(f"| {label:<30} | {name:<7} | {m:>5} | {v.split_k:>5} | {ms:8.4f} | {row['tflops']:7.1f} | {row['gbs']:6.0f} | "
              f"{row['vs_cublas']:8.2f}x | {err:.0e}{flag} |", flush=True)
    print(f"# done in {time.perf_counter() - start:.0f} s")
    best = {}
    for r in rows_out:
        if not r.get("failed") and r["rel_err"] < 2e-2:
            key = (bucket(r["candidate"]), r["shape"], r["rows"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    print("# best per (bucket, shape, rows):")
    for (b, s, m), r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        print(f"  {b:<8} {s:<7} {m:>5}: {r['candidate']:<30} {r['ms']:.4f} ms  {r['vs_cublas']:.2f}x cuBLAS")
    print("# per candidate: geometric mean (and worst) of the speed-up over cuBLAS across its shapes and rows")
    import math

    for label in labels:
        got = [r["vs_cublas"] for r in rows_out if r["candidate"] == label and not r.get("failed")]
        bad = sum(1 for r in rows_out if r["candidate"] == label and (r.get("failed") or r["rel_err"] >= 2e-2))
        if got:
            gm = math.exp(sum(math.log(g) for g in got) / len(got))
            print(f"  {label:<30} {gm:.3f}x (worst {min(got):.2f}x over {len(got)}){f', {bad} FAILED/WRONG' if bad else ''}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                              "copies_note": "ms per call", "rows": rows_out,
                                              "cublas": [dict(shape=s, rows=m, ms=t) for (s, m), t in cublas.items()]},
                                             indent=1))


if __name__ == "__main__":
    main()
