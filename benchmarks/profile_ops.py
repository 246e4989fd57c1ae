"""Where a V4-Flash slice decode step spends its GPU time, op by op: every op call of one eager step is fenced by
two marker kernels (`torch.cuda._sleep(1)`, named `spin_kernel`), so each kernel the profiler records is put
down to the op that launched it, or to the PyTorch glue after an op (the indexing, cache writes and casts
between ops). Kernel times are device times, the same kernels a graph replay runs; the replay's wall time is
measured beside them.

    python benchmarks/profile_ops.py [--points 1x4096] [--prefill 16384] [--quantized] [--out ops.json]

Prints per point: the replay's wall time, then the ops by summed device time (calls, kernels, us), then the glue
by the op it follows. `--prefill N`: the same for one prefill call of N prompt tokens (one sequence, from position
0; the wall time is the unfenced call's, eager, kernels loaded).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.decode import SLICE, cuda_ms, prebuild, synthetic_cache  # noqa: E402  (after the path)

MARKER = "spin_kernel"


def fenced(table, calls: list[str]):
    """An op table whose every op launches a marker kernel before and after itself and appends its name to `calls`."""
    from tilekernels.op import OpTable
    from tilekernels.ops import DECLARED

    def wrap(name, fn):
        def op(*args, **kwargs):
            calls.append(name)
            torch.cuda._sleep(1)
            out = fn(*args, **kwargs)
            torch.cuda._sleep(1)
            return out
        return op

    return OpTable({name: wrap(name, getattr(table, name)) for name in table.names()}, DECLARED)


def attribute(events: list, calls: list[str]) -> tuple[dict, dict, list]:
    """(op -> [calls, kernels, us], glue after op -> [kernels, us, {kernel: [count, us]}], [op, us, [[kernel, us],
    ...]] per call in order)
    from the CUDA events of one fenced step, in start order."""
    ops: dict = defaultdict(lambda: [0, 0, 0.0])
    glue: dict = defaultdict(lambda: [0, 0.0, defaultdict(lambda: [0, 0.0])])
    order: list = []
    inside, index = False, -1
    for name, us in events:
        if MARKER in name:
            inside = not inside
            if inside:
                index += 1
                ops[calls[index]][0] += 1
                order.append([calls[index], 0.0, []])
            continue
        if inside:
            ops[calls[index]][1] += 1
            ops[calls[index]][2] += us
            order[-1][1] += us
            order[-1][2].append([name[:60], round(us, 2)])
        else:
            key = f"after {calls[index]}" if index >= 0 else "before the first op"
            glue[key][0] += 1
            glue[key][1] += us
            glue[key][2][name[:60]][0] += 1
            glue[key][2][name[:60]][1] += us
    if index + 1 != len(calls):
        raise RuntimeError(f"{index + 1} fenced ops in the trace, {len(calls)} called")
    return ops, glue, order


def traced_step(step) -> list:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [ev for ev in prof.events()
              if ev.device_type == torch.autograd.DeviceType.CUDA and (ev.device_time > 0 or MARKER in ev.name)]
    events.sort(key=lambda ev: ev.time_range.start)
    names = sorted({ev.name for ev in events})
    if not any(MARKER in n for n in names):
        raise RuntimeError(f"no marker kernel in the trace: {names[:40]}")
    return [(ev.name, ev.device_time) for ev in events]


def prefill_trace(cfg, model, probe, calls: list[str], n: int, dtype) -> tuple[float, list]:
    """The wall ms of one unfenced prefill call of `n` tokens (the best of three, warm) and the fenced call's events
    (its op names into `calls`)."""
    from deepinfer.runtime.cache import CacheSpec, PagedCache

    ids = torch.randint(0, cfg.vocab_size, (n,), device="cuda")
    cache = PagedCache(cfg, CacheSpec(num_blocks=n // 128 + 2, max_seqs=1, max_blocks_per_seq=n // 128 + 2),
                       dtype, "cuda")
    seq = cache.admit()
    cache.grow(seq, n)

    def call(m):
        seq.num_tokens = 0
        m.prefill(cache, ids, torch.arange(n, device="cuda"), [(seq, 0, n)], torch.tensor([n - 1], device="cuda"))

    call(model)
    wall = min(cuda_ms(functools.partial(call, model), 1) for _ in range(3))
    call(probe)
    calls.clear()
    return wall, traced_step(functools.partial(call, probe))


def report(label: str, wall: float, events: list, calls: list[str]) -> dict:
    """Print one point's table (ops, glue, each op's kernels) and return it as a dict."""
    ops, glue, order = attribute(events, calls)
    busy = sum(us for name, us in events if MARKER not in name) / 1e3
    print(f"\n## {label}: {wall:.3f} ms wall, {busy:.3f} ms in kernels (markers excluded)", flush=True)
    print("| op | calls | kernels | us | share of kernel time |\n|---|---|---|---|---|")
    for name, (n, k, us) in sorted(ops.items(), key=lambda kv: -kv[1][2]):
        print(f"| {name} | {n} | {k} | {us:.1f} | {us / 1e3 / busy:.1%} |")
    glue_us = sum(g[1] for g in glue.values())
    print(f"\nglue: {sum(g[0] for g in glue.values())} kernels, {glue_us:.1f} us")
    print("| glue | kernels | us | largest kernels (count, us) |\n|---|---|---|---|")
    for name, (k, us, by) in sorted(glue.items(), key=lambda kv: -kv[1][1]):
        top = sorted(by.items(), key=lambda kv: -kv[1][1])[:6]
        print(f"| {name} | {k} | {us:.1f} | " + "; ".join(f"{n[:40]} ({c}, {t:.1f})" for n, (c, t) in top) + " |")
    seen = set()
    for name, us, kernels in order:  # the kernels of each op's first call
        if name not in seen and len(kernels) > 1:
            seen.add(name)
            print(f"{name} ({us:.1f} us): " + ", ".join(f"{k[:28]} {t:.1f}" for k, t in kernels[:12]))
    return dict(label=label, wall_ms=wall, busy_ms=busy,
                ops={n: dict(calls=c, kernels=k, us=u) for n, (c, k, u) in ops.items()},
                glue={n: dict(kernels=k, us=u, by_kernel={kn: dict(count=c, us=t) for kn, (c, t) in by.items()})
                      for n, (k, u, by) in glue.items()}, order=order)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="1x4096", help="BATCHxCONTEXT decode points")
    parser.add_argument("--prefill", type=int, default=0, help="also one prefill call of this many tokens (0: none)")
    parser.add_argument("--quantized", action="store_true", help="V4's FP8 / FP4 weight formats")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from backends.nvidia.graphs import CudaGraphs
    from deepinfer.config import ModelConfig
    from deepinfer.env import Env
    from deepinfer.model.model import DeepseekV4
    from deepinfer.model.weights import ModelWeights
    from deepinfer.runtime.graph import DecodeGraphs
    from deepinfer.tiny import random_tensors
    from tilekernels.kernels import kernel_table

    dtype = torch.bfloat16
    cfg = ModelConfig.from_model_dir(SLICE)
    if args.quantized:  # each tensor quantized as it is made (the bf16 slice would not fit beside it on an H100)
        from deepinfer.weights.synthetic import random_quantized

        cfg, tensors = random_quantized(cfg, seed=0, dtype=dtype, device="cuda")
        prebuild(cfg, False)
    else:
        tensors = random_tensors(cfg, seed=0, dtype=dtype, device="cuda")
    weights = ModelWeights.from_tensors(cfg, tensors)
    table = kernel_table("sm90", Env.read().cache_dir)
    calls: list[str] = []
    # one stream: the op-by-op table fences each call on it (the replay's wall time is then the one-stream step's)
    model = DeepseekV4(cfg, weights, table)
    probe = DeepseekV4(cfg, weights, fenced(table, calls))
    out = {"device": torch.cuda.get_device_name(), "quantized": args.quantized, "points": []}
    for point in filter(None, args.points.split(",")):
        batch, context = (int(x) for x in point.split("x"))
        cache, seqs = synthetic_cache(cfg, batch, context, dtype)
        ids, pos = list(range(100, 100 + batch)), [context] * batch
        with torch.inference_mode():
            graphs = DecodeGraphs(model, cache, batch, CudaGraphs())
            wall = cuda_ms(functools.partial(graphs.run, ids, pos, seqs), 20)
            eager = DecodeGraphs(probe, cache, batch, None)
            step = functools.partial(eager.run, ids, pos, seqs)
            step()
            calls.clear()
            events = traced_step(step)
        label = f"decode batch {batch} at {context}{', quantized' if args.quantized else ''}"
        out["points"].append(report(label, wall, events, calls))
        del cache, graphs, eager
        torch.cuda.empty_cache()
    if args.prefill:
        with torch.inference_mode():
            wall, events = prefill_trace(cfg, model, probe, calls, args.prefill, dtype)
            label = f"prefill of {args.prefill} tokens{', quantized' if args.quantized else ''}"
            out["points"].append(report(label, wall, events, calls))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
