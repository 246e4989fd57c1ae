"""Where a V4-Flash slice decode step (and a prefill chunk) spends its GPU time, kernel by kernel: the slice,
weights, synthetic cache and decode graphs of `benchmarks/decode.py`, a CUDA-graph replay traced by
`torch.profiler` (kernels inside a graph are recorded one by one), kernels grouped by name.

    python benchmarks/profile_decode.py [--points 1x4096,32x65536] [--prefill 4096] [--top 25] [--out prof.json]

Prints per point: the replay's wall time (CUDA events), the kernels per step, their summed time and the gaps
between them (wall - summed kernel time: launch latency inside the graph), then the top kernels by time. Every
TileLang kernel is named `kernel_kernel`: the table tells the TileLang kernels as a whole from PyTorch's (the
indexing, concatenation and cache arithmetic between the ops, and the ops that run their PyTorch reference).
(Profiler ranges cannot attribute kernels to ops here: kernels launched through TVM-FFI are not linked to the host
range. `benchmarks/profile_ops.py` does it with marker kernels around each op call.)
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
from benchmarks.decode import SLICE, cuda_ms, synthetic_cache  # noqa: E402  (after the path)


def traced(fn, iters: int) -> tuple[dict, int]:
    """{kernel name: [calls, total us]} over `iters` calls of fn, and the number of kernels per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    table: dict = defaultdict(lambda: [0, 0.0])
    count = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            name = ev.name[:90]
            table[name][0] += 1
            table[name][1] += ev.device_time
            count += 1
    return {k: [c / iters, us / iters] for k, (c, us) in table.items()}, count // iters


def report(label: str, wall_ms: float, table: dict, per_call: int, top: int) -> dict:
    busy = sum(us for _, us in table.values()) / 1e3
    print(f"\n## {label}: {wall_ms:.3f} ms wall, {per_call} kernels, {busy:.3f} ms in kernels, "
          f"{wall_ms - busy:.3f} ms between them", flush=True)
    print("| kernel | calls | us | share |\n|---|---|---|---|")
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])
    for name, (calls, us) in rows[:top]:
        print(f"| {name} | {calls:g} | {us:.1f} | {us / 1e3 / wall_ms:.1%} |")
    return dict(label=label, wall_ms=wall_ms, kernels=per_call, busy_ms=busy,
                table=[dict(name=n, calls=c, us=u) for n, (c, u) in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="1x4096,32x65536", help="BATCHxCONTEXT decode points")
    parser.add_argument("--prefill", type=int, default=4096, help="profile one prefill chunk of this many tokens (0: none)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from backends.nvidia.graphs import CudaGraphs
    from deepinfer.config import ModelConfig
    from deepinfer.env import Env
    from deepinfer.model.model import DeepseekV4
    from deepinfer.model.weights import ModelWeights
    from deepinfer.runtime.cache import CacheSpec, PagedCache
    from deepinfer.runtime.graph import DecodeGraphs
    from deepinfer.tiny import random_tensors
    from tilekernels.kernels import kernel_table

    dtype = torch.bfloat16
    cfg = ModelConfig.from_model_dir(SLICE)
    weights = ModelWeights.from_tensors(cfg, random_tensors(cfg, seed=0, dtype=dtype, device="cuda"))
    model = DeepseekV4(cfg, weights, kernel_table("sm90", Env.read().cache_dir))
    out = {"device": torch.cuda.get_device_name(), "points": []}
    for point in args.points.split(","):
        batch, context = (int(x) for x in point.split("x"))
        cache, seqs = synthetic_cache(cfg, batch, context, dtype)
        graphs = DecodeGraphs(model, cache, batch, CudaGraphs())
        ids, pos = list(range(100, 100 + batch)), [context] * batch
        with torch.inference_mode():
            step = functools.partial(graphs.run, ids, pos, seqs)
            wall = cuda_ms(step, args.iters)
            table, per_call = traced(step, args.iters)
        out["points"].append(report(f"decode batch {batch} at {context}", wall, table, per_call, args.top))
        del cache, graphs
        torch.cuda.empty_cache()
    if args.prefill:
        n = args.prefill
        ids = torch.randint(0, cfg.vocab_size, (n,), device="cuda")
        blocks = n // 128 + 2
        cache = PagedCache(cfg, CacheSpec(num_blocks=blocks, max_seqs=1, max_blocks_per_seq=blocks), dtype, "cuda")
        seq = cache.admit()
        cache.grow(seq, n)
        positions, last = torch.arange(n, device="cuda"), torch.tensor([n - 1], device="cuda")

        def chunk(m):
            seq.num_tokens = 0
            m.prefill(cache, ids, positions, [(seq, 0, n)], last)

        with torch.inference_mode():
            wall = cuda_ms(functools.partial(chunk, model), 3)
            table, per_call = traced(functools.partial(chunk, model), 3)
        out["points"].append(report(f"prefill chunk of {n}", wall, table, per_call, args.top))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
