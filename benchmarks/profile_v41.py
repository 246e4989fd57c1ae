"""Where a V4.1-Flash slice decode step's GPU time goes, op by op. Each op of the model's op table (and, as one,
the whole step) is timed on the GPU alone: the stream is first held by a sleep kernel long enough for the host
to enqueue everything the op launches, so the CUDA events around it measure its kernels back to back, without
the launch gaps of an eager step (what a decode graph replays). Work outside the op table (indexing,
concatenation, the cache's row arithmetic) is the step's time less the ops': "torch". The slice, its weights
and its kernels are `decode_v41`'s.

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

HOLD_CYCLES = 4_000_000  # ~2 ms at the H200's clock: more than the host needs to enqueue one op


def gpu_ms(fn, hold: int = HOLD_CYCLES) -> tuple[object, float]:
    """fn() run with the stream held until the host has enqueued it -> (its result, its GPU milliseconds)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(hold)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end)


class OpTimes:
    """The op table with each call timed alone (`gpu_ms`), milliseconds summed by op."""

    def __init__(self, ops):
        from tilekernels import OpTable
        from tilekernels.ops import DECLARED

        self.ms: dict[str, float] = {}
        self.on = False

        def wrap(name, fn):
            def call(*args, **kwargs):
                if not self.on:
                    return fn(*args, **kwargs)
                out, ms = gpu_ms(lambda: fn(*args, **kwargs))
                self.ms[name] = self.ms.get(name, 0.0) + ms
                return out
            return call

        self.table = OpTable({name: wrap(name, getattr(ops, name)) for name in DECLARED}, DECLARED)


def profile_point(model, times: OpTimes, batch: int, context: int, steps: int) -> dict:
    from deepinfer.model.v41_compress import Chunk

    cfg, device = model.cfg, model.weights.embed.device
    cache = model.new_cache(batch + 1, context + 1)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)
    chunks = [Chunk(i, i, 1, context) for i in range(batch)]

    def step():
        cache.num_tokens = [context] * (batch + 1)
        model.forward(cache, ids, chunks)

    step()
    whole = min(gpu_ms(step, 50 * HOLD_CYCLES)[1] for _ in range(steps))  # the host enqueues a step in < 100 ms
    times.ms, times.on = {}, True
    for _ in range(steps):
        step()
    times.on = False
    rows = {k: v / steps for k, v in times.ms.items()}
    rows["torch"] = max(whole - sum(rows.values()), 0.0)
    ops = [dict(op=k, ms=v, share=v / whole) for k, v in sorted(rows.items(), key=lambda kv: -kv[1])]
    return dict(batch=batch, context=context, steps=steps, step_ms=whole, ops=ops)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="1x4096,128x32768", help="batch x context, comma-separated")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
        assert all(len(p) == 2 for p in points)
    except (ValueError, AssertionError):
        parser.error(f"--points {args.points!r}: expected batch x context pairs such as 1x4096,128x32768")
    from deepinfer.compile.plan import kernel_plan
    from deepinfer.compile.prebuild import build_kernels
    from deepinfer.env import Env
    from deepinfer.model.v41 import DeepseekV41
    from tilekernels.kernels import kernel_table

    begin, cfg, device, cache_dir = time.perf_counter(), slice_config(), torch.device("cuda"), Env.read().cache_dir
    build_kernels("sm90", kernel_plan(cfg, "bfloat16", quantized=True), cache_dir, jobs=16)
    times = OpTimes(kernel_table("sm90", cache_dir))
    model = DeepseekV41(cfg, make_weights(cfg, torch.bfloat16, device), times.table, hasher_for(cfg))
    res = dict(device=torch.cuda.get_device_name(device), commit=args.commit, points=[],
               setup_s=time.perf_counter() - begin)
    for batch, context in points:
        with torch.inference_mode():
            row = profile_point(model, times, batch, context, args.steps)
        res["points"].append(row)
        print(f"\n# batch {batch}, context {context}: the step's kernels {row['step_ms']:.2f} ms\n"
              "| op | ms / step | share |\n|---|---|---|", flush=True)
        for r in row["ops"][: args.top]:
            print(f"| {r['op']} | {r['ms']:.3f} | {r['share']:.1%} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
