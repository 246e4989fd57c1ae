"""Where a V4.1-Flash slice decode step's GPU time goes, op by op: eager decode steps (the same kernels a decode
graph replays) under torch.profiler, every op of the model's op table wrapped in a `record_function` range, the
GPU time of each op's kernels summed per step; work outside the op table (indexing, concatenation, the cache's
row arithmetic) under "torch". The slice, its weights and its kernels are `decode_v41`'s.

    python benchmarks/profile_v41.py --points 1x4096,128x32768 --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.decode_v41 import hasher_for, make_weights, slice_config  # noqa: E402  (after the path)


def profiled(ops):
    """The op table with each op inside a profiler range named `op:<name>`."""
    from tilekernels import OpTable
    from tilekernels.ops import DECLARED

    def wrap(name, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(f"op:{name}"):
                return fn(*args, **kwargs)
        return call

    return OpTable({name: wrap(name, getattr(ops, name)) for name in DECLARED}, DECLARED)


def by_op(prof, steps: int, cuda: bool) -> list[dict]:
    """GPU ms per step of each op's kernels (those its range launched: a range's own GPU-side span would count the
    gaps between launches too), the rest of the kernel time as "torch", largest first (on the CPU: CPU time,
    a smoke run)."""
    from torch.autograd import DeviceType

    rows, kernels = {}, 0.0
    for e in prof.events():
        op = e.name.startswith("op:")
        if op and e.device_type == DeviceType.CPU:
            key = e.name.removeprefix("op:")
            rows[key] = rows.get(key, 0.0) + (e.device_time_total if cuda else e.cpu_time_total) / 1e3 / steps
        elif cuda and not op and e.device_type == DeviceType.CUDA:  # a kernel, memcpy or memset
            kernels += e.device_time_total / 1e3 / steps
    kernels = kernels if cuda else sum(rows.values())
    rows["torch"] = max(kernels - sum(rows.values()), 0.0)
    return [dict(op=k, ms=v, share=v / kernels) for k, v in sorted(rows.items(), key=lambda kv: -kv[1])]


def profile_point(model, batch: int, context: int, steps: int) -> dict:
    from deepinfer.model.v41_compress import Chunk

    cfg, device = model.cfg, model.weights.embed.device
    cache = model.new_cache(batch + 1, context + 1)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)
    chunks = [Chunk(i, i, 1, context) for i in range(batch)]

    def step():
        cache.num_tokens = [context] * (batch + 1)
        model.forward(cache, ids, chunks)

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        step()
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    rows = by_op(prof, steps, cuda)
    return dict(batch=batch, context=context, steps=steps, kernel_ms=sum(r["ms"] for r in rows), ops=rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="1x4096,128x32768", help="batch x context, comma-separated")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true", help="the tiny slice on the CPU reference ops (a smoke run)")
    args = parser.parse_args(argv)
    from deepinfer.compile.plan import kernel_plan
    from deepinfer.compile.prebuild import build_kernels
    from deepinfer.env import Env
    from deepinfer.model.v41 import DeepseekV41
    from tilekernels.kernels import kernel_table

    from tilekernels import reference_table

    begin, cfg = time.perf_counter(), slice_config(args.tiny)
    device = torch.device("cpu" if args.tiny else "cuda")
    ops = reference_table()
    if not args.tiny:
        cache_dir = Env.read().cache_dir
        build_kernels("sm90", kernel_plan(cfg, "bfloat16", quantized=True), cache_dir, jobs=16)
        ops = kernel_table("sm90", cache_dir)
    model = DeepseekV41(cfg, make_weights(cfg, torch.bfloat16, device), profiled(ops), hasher_for(cfg))
    res = dict(device=torch.cuda.get_device_name(device) if not args.tiny else "cpu", commit=args.commit, points=[],
               setup_s=time.perf_counter() - begin)
    for point in args.points.split(","):
        batch, context = (int(x) for x in point.split("x"))
        with torch.inference_mode():
            row = profile_point(model, batch, context, args.steps)
        res["points"].append(row)
        print(f"\n# batch {batch}, context {context}: {'kernels' if not args.tiny else 'CPU'} {row['kernel_ms']:.2f} ms a step (eager)\n"
              "| op | ms / step | share |\n|---|---|---|", flush=True)
        for r in row["ops"][: args.top]:
            print(f"| {r['op']} | {r['ms']:.3f} | {r['share']:.1%} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
