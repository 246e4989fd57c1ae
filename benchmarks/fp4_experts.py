"""The routed experts of one V4-Flash layer (256 experts, hidden 4096, intermediate 2048, top 6) at decode sizes:
the FP4 grouped GEMMs (weights converted in the kernel) against the bf16 grouped GEMMs on the same routing, with
the bytes of the experts the batch touches divided by the time (GB/s) and by the measured HBM copy bandwidth.

    python benchmarks/fp4_experts.py [--tokens 1,8,64] [--copy-gbs 4245] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

E, H, I, TOP = 256, 4096, 2048, 6


def timed(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    from deepinfer.env import Env
    from tilekernels.kernels import kernel_table
    from tilekernels.quant import quantize

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--copy-gbs", type=float, default=4245.0, help="measured HBM copy bandwidth (BENCHMARKS.md)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ops = kernel_table("sm90", Env.read().cache_dir)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=dev) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, device=dev) / I**0.5).to(torch.bfloat16)
    q_up, q_down = quantize(gate_up, "fp4"), quantize(down, "fp4")
    per_expert_fp4 = (q_up.nbytes + q_down.nbytes) / E
    per_expert_bf16 = (gate_up.numel() + down.numel()) * 2 / E
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, H, device=dev).to(torch.bfloat16)
        idx = torch.rand(tokens, E, device=dev).topk(TOP, dim=-1).indices
        w = torch.softmax(torch.randn(tokens, TOP, device=dev), -1)
        touched = int(idx.unique().numel())
        fp4_ms = timed(lambda: ops.moe_experts(x, w, idx, q_up, q_down, 10.0))
        bf16_ms = timed(lambda: ops.moe_experts(x, w, idx, gate_up, down, 10.0))
        fp4_gbs = touched * per_expert_fp4 / fp4_ms / 1e6
        bf16_gbs = touched * per_expert_bf16 / bf16_ms / 1e6
        row = {"tokens": tokens, "experts_touched": touched, "fp4_ms": round(fp4_ms, 4), "bf16_ms": round(bf16_ms, 4),
               "fp4_GBps": round(fp4_gbs, 1), "bf16_GBps": round(bf16_gbs, 1),
               "fp4_of_copy_bw": round(fp4_gbs / args.copy_gbs, 3), "speedup_vs_bf16": round(bf16_ms / fp4_ms, 2)}
        rows.append(row)
        print(row, flush=True)
    result = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
