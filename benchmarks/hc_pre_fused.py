"""The mHC pre-block at prefill rows on the GPU: the one-pass kernel (`hc_pre_fused`; on sm_90a a cluster of CTAs
per row tile over distributed shared memory, tilekernels/ops/hc_pre_sm90.py) against the two-kernel form it
replaces above `hc_pre.FUSED_ROWS` rows (the GEMM partials, then the finish), same process, same inputs, V4-Flash's
width (N 4, H 4096), with and without the fused input norm (the model's form has it).

    python benchmarks/hc_pre_fused.py [--rows 65,256,1024,4096,16384] [--tunes "cluster=8,block_m=16;stages=2"]
                                      [--out results.json]

Each `--tunes` entry (";"-separated) is a tile of the one-pass kernel (`hc_pre_sm90.Tune` fields), built on this
host as "hc_pre_fused@<entry>". Per form: the outputs against the PyTorch reference (fp32 on the CPU) within the
op's bf16 tolerance, and the largest difference from the two-kernel form; the median time of CUDA-graph replays;
bytes = the streams read once + the collapse written + the mixing weights (as benchmarks/kernels.py counts
`hc_pre`), as GB/s and as a fraction of the measured copy bandwidth (issue 12's aim: 60 %).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

N, H, ITERS = 4, 4096, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="65,256,1024,4096,16384")
    parser.add_argument("--tunes", default="", help='";"-separated one-pass tiles, e.g. "cluster=8,block_m=16"')
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import backends
    from benchmarks.kernels import copy_bandwidth, time_fn
    from codegen import Compiler
    from codegen.driver import build_all
    from deepinfer.env import Env
    from tilekernels.kernels import Launcher
    from tilekernels.ops import DECLARED, hc_mixes, hc_pre, hc_pre_sm90

    cache_dir = Env.read().cache_dir
    forms = ["two", "fused"] + [f"fused@{t}" for t in filter(None, args.tunes.split(";"))]
    meta = torch.empty(1, N, H, dtype=torch.bfloat16, device="meta")
    variants = [hc_pre.variant(meta, ITERS, norm) for norm in (False, True)]
    items = [("hc_pre", k, v) for v in variants for k in ("hc_pre_split", "hc_pre_finish")]
    items += [("hc_pre", "hc_pre_fused" + form[5:], v) for v in variants for form in forms if form != "two"]
    failed = [r for r in build_all("sm90", items, "tilekernels.ops.hc_pre_sm90:trial_request", cache_dir,
                                   jobs=args.jobs) if r.status == "failed"]
    if failed:
        raise SystemExit("builds failed:\n" + "\n".join(f"{r.label}: {r.path}" for r in failed))
    compiler = Compiler(backends.get("sm90"), cache_dir)
    launcher = Launcher(compiler).for_op("hc_pre")

    def trial(form: str):  # the op's launcher, with the one-pass kernel taken from the tune trial `form`
        if "@" not in form:
            return launcher
        loaded = {}

        def launch(kernel, v):
            if kernel != "hc_pre_fused":
                return launcher(kernel, v)
            if v not in loaded:
                loaded[v] = compiler.load(hc_pre_sm90.trial_request("hc_pre", "hc_pre_fused" + form[5:], v))
            return loaded[v]
        return launch

    def run(form: str, v, s, fn, base, scale, norm):
        if form == "two":
            dots, sq = hc_mixes.partials(launcher, "hc_pre", v, s, fn)
            return hc_pre.finish(launcher, v, s, dots, sq, base, scale, 1e-6, 1e-6, norm)
        return hc_pre.launch_fused(trial(form), v, s, fn, base, scale, 1e-6, 1e-6, norm)

    copy_gbs = copy_bandwidth()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    atol, rtol = DECLARED["hc_pre"].tolerance["bfloat16"]
    mix_tol = DECLARED["hc_mixes"].tolerance["bfloat16"]
    print(f"# {torch.cuda.get_device_name()} | {datetime.date.today()} | commit {commit or 'unknown'} | "
          f"measured HBM copy {copy_gbs:.0f} GB/s")
    print("| rows | norm | form | ms | GB/s | of copy BW | vs two kernels | reference check | max diff from two |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        for v in variants:
            torch.manual_seed(rows)
            streams, fn, base, scale, iters, hc_eps, norm_eps, *norm = hc_pre.example(v, rows, "cuda")
            norm = norm[0] if norm else None
            want = hc_pre.reference(streams.cpu(), fn.cpu(), base.cpu(), scale.cpu(), iters, hc_eps, norm_eps,
                                    None if norm is None else norm.cpu())
            s = streams.reshape(rows, -1).contiguous()
            nbytes = 2 * rows * N * H + 2 * rows * H + 4 * fn.numel() + (4 * H if norm is not None else 0)
            base_out, base_ms = None, None
            for form in forms:
                got = run(form, v, s, fn, base, scale, norm)
                torch.cuda.synchronize()
                ok = all(torch.allclose(g.cpu().float(), w.float(), atol=a, rtol=r)
                         for g, w, (a, r) in zip(got, want, (mix_tol, mix_tol, (atol, rtol))))
                err = max(((g.cpu().float() - w.float()).abs().max().item() for g, w in zip(got, want)))
                diff = 0.0 if base_out is None else max((g.float() - b.float()).abs().max().item()
                                                        for g, b in zip(got, base_out))
                ms, _ = time_fn(lambda: run(form, v, s, fn, base, scale, norm), args.iters)
                base_out = got if base_out is None else base_out
                base_ms = ms if base_ms is None else base_ms
                gbs = nbytes / (ms * 1e-3) / 1e9
                rows_out.append(dict(rows=rows, norm=v.norm, form=form, ms=ms, gbs=gbs, copy_fraction=gbs / copy_gbs,
                                     speedup=base_ms / ms, reference_ok=ok, max_err=err, max_diff_from_two=diff))
                print(f"| {rows} | {v.norm} | {form} | {ms:.4f} | {gbs:.0f} | {gbs / copy_gbs:.1%} | "
                      f"{base_ms / ms:.2f}x | {'ok' if ok else 'FAILED'} ({err:.2e}) | {diff:.2e} |", flush=True)
            streams = s = base_out = got = None  # freed before the next size's inputs
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                                              "commit": commit, "copy_gbs": copy_gbs, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
