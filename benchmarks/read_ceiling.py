"""How fast one kernel can stream B bytes from HBM at the sizes one decode step's weight reads have: the ceiling a
bandwidth-bound kernel of that size can reach, as a fraction of the large-copy bandwidth the aims are counted in.

    python benchmarks/read_ceiling.py [--sizes-mb 4,8,...] [--iters 40] [--out ceiling.json]

Per size B (MB = 10^6 bytes), timed as `benchmarks/fp4_experts.py` times the expert GEMMs (CUDA events around one
launch, L2 flushed before every call, median of `--iters`):
- `read`: torch's sum of B bytes of fp32 (one reduction kernel reading B bytes, a scalar written);
- `copy`: a device-to-device copy of B/2 bytes (B bytes of traffic);
- `gemv`: cuBLAS's bf16 matrix-vector product over a [B / 8192, 4096] weight (a one-token projection of B bytes).
All include the launch and the kernel's fill and drain, as the expert GEMMs' times do. The default sizes add the
FP4 routed experts' bytes at one token (V4-Flash, top 6: gate_up 53.5 MB, down 26.7 MB) to a ladder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.fp4_experts import copy_bandwidth, timed  # noqa: E402  (after the path)

TOP_K, HIDDEN, INTER, FP4_BLOCK = 6, 4096, 2048, 32


def expert_bytes(n: int, k: int) -> int:
    """One expert GEMM's FP4 codes (two a byte) and ue8m0 exponents (one per 32 values) for TOP_K experts."""
    return TOP_K * (n * k // 2 + n * k // FP4_BLOCK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="4,8,16,32,64,128,256,1024")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "read_ceiling.json")
    args = parser.parse_args()
    named = {"fp4 gate_up, 1 token": expert_bytes(2 * INTER, HIDDEN), "fp4 down, 1 token": expert_bytes(HIDDEN, INTER)}
    sizes = {**{f"{mb} MB": int(float(mb) * 1e6) for mb in args.sizes_mb.split(",") if mb}, **named}
    dev = torch.device("cuda")
    copy_gbs = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()} | copy bandwidth (2 GiB) {copy_gbs:.0f} GB/s", flush=True)
    flush = torch.empty(64 << 20, dtype=torch.float32, device=dev)  # 256 MiB > the 50 MiB L2
    src = torch.randn(max(sizes.values()) // 4 + 1, device=dev)
    dst = torch.empty_like(src)
    rows = []
    vec = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    print("| size | bytes | read us | read GB/s (of copy) | copy us | copy GB/s (of copy) | gemv us | gemv GB/s (of copy) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, size in sizes.items():
        n = size // 4
        x, half = src[:n], n // 2
        read_ms = timed(lambda x=x: x.sum(), flush, args.iters)
        copy_ms = timed(lambda h=half: dst[:h].copy_(src[:h]), flush, args.iters)
        weight = src[:n].view(torch.bfloat16)[: n * 2 // 4096 * 4096].view(-1, 4096)
        gemv_ms = timed(lambda w=weight: torch.mv(w, vec), flush, args.iters)
        row = dict(size=name, bytes=n * 4, read_us=read_ms * 1e3, read_gbs=n * 4 / read_ms / 1e6,
                   copy_us=copy_ms * 1e3, copy_gbs=2 * half * 4 / copy_ms / 1e6, gemv_us=gemv_ms * 1e3,
                   gemv_gbs=weight.numel() * 2 / gemv_ms / 1e6, copy_bandwidth_gbs=copy_gbs,
                   device=torch.cuda.get_device_name())
        rows.append(row)
        print(f"| {name} | {n * 4:,} | {row['read_us']:.1f} | {row['read_gbs']:.0f} ({row['read_gbs'] / copy_gbs:.0%}) "
              f"| {row['copy_us']:.1f} | {row['copy_gbs']:.0f} ({row['copy_gbs'] / copy_gbs:.0%}) "
              f"| {row['gemv_us']:.1f} | {row['gemv_gbs']:.0f} ({row['gemv_gbs'] / copy_gbs:.0%}) |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
