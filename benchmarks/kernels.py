"""Each op's TileLang kernels on the GPU at V4-Flash shapes, side by side with torch's own implementation
(the op's PyTorch reference: cuBLAS for the GEMMs) and the measured HBM copy bandwidth, in one run.

    python benchmarks/kernels.py [--out results.json] [--tokens 1,8,64,128,256,4096]

Times are the median of CUDA-graph replays (eager when a reference cannot be captured), so they measure GPU
time, not Python dispatch. Bytes are the minimum traffic of the op (each input read once, each output written
once); GB/s = bytes / time; FLOP/s for the GEMMs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H, E, K, I, NH, D = 4096, 256, 6, 2048, 64, 512
TOKENS = (1, 8, 64, 128, 256, 4096)  # the default token counts (tools/gpu_prebuild.py `bench` builds their kernels)


def time_fn(fn, iters: int = 30) -> tuple[float, str]:
    """Median milliseconds of `fn` replayed from a CUDA graph (or eager if it cannot be captured)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    mode = "graph"
    try:
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception:  # a reference with a host sync (e.g. .tolist()) cannot be captured
        torch.cuda.synchronize()
        mode, run = "eager", fn
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], mode


def copy_bandwidth() -> float:
    """Device-to-device copy of 4 GiB of fp32 (bytes read + bytes written per second), timed eagerly: a
    graph-replayed copy measured ~2.7 TB/s where the eager one gives ~4.3 TB/s on the H200."""
    src = torch.randn(1 << 30, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 4 * 10 / (start.elapsed_time(end) * 1e-3) / 1e9


def cases(t: int, device: str = "cuda", wanted: set[str] | None = None) -> dict:
    """label -> (op, args, bytes, flops) at V4-Flash shapes for t tokens; the args are each op's own `example`
    for its V4-Flash variant (the generator the kernel tests use), made only for the `wanted` ops (all if None:
    the whole set at 4,096 tokens does not fit an 80 GB GPU at once). On "meta" (`tools/gpu_prebuild.py bench`
    records the kernels) the experts' bytes count every expert."""
    from tilekernels.ops import (DECLARED, act_quant, compress_pool, hc_mid, hc_post, hc_pre, linear, moe_experts,
                                 moe_gate, rms_norm, rope, swiglu)

    def ex(name, variant):
        if wanted is not None and name not in wanted:
            return None
        return DECLARED[name].example(variant, t, device)

    out = {
        "rms_norm[4096]": ("rms_norm", ex("rms_norm", rms_norm.Variant(H, "bfloat16")), 4 * t * H + 4 * H, 0),
        "rope[q 64x512]": ("rope", ex("rope", rope.Variant(NH, D, 64, "bfloat16")), 4 * t * NH * D, 0),
        "swiglu[2x2048]": ("swiglu", ex("swiglu", swiglu.Variant(I, "bfloat16")), 2 * t * 3 * I, 0),
        "moe_gate[256 top6]": ("moe_gate", ex("moe_gate", moe_gate.Variant(E, K, "sqrtsoftplus", "bfloat16")),
                               2 * t * E + 8 * t * K, 0),
        "hc_pre[4x4096]": ("hc_pre", ex("hc_pre", hc_pre.Variant(4, H, 20, "bfloat16")),
                           2 * t * 4 * H + 2 * t * H + 4 * 24 * 4 * H, 2 * t * 24 * 4 * H),
        "hc_post[4x4096]": ("hc_post", ex("hc_post", hc_post.Variant(4, H, "bfloat16")), 2 * t * 9 * H, 0),
        # hc_post, then the next hc_pre (fused up to hc_mid.FUSED_ROWS rows): the post-block's bytes and the pre-block's
        "hc_mid[4x4096]": ("hc_mid", ex("hc_mid", hc_mid.Variant(4, H, "bfloat16", hc_mid.PART)),
                           2 * t * 9 * H + 2 * t * H + 4 * 24 * 4 * H, 2 * t * 24 * 4 * H),
    }
    for label, (slots, dim) in {"CSA 8x512": (8, D), "HCA 128x512": (128, D)}.items():  # one window per token
        pool = compress_pool.Variant(slots, dim, "bfloat16")
        out[f"compress_pool[{label}]"] = ("compress_pool", ex("compress_pool", pool), t * slots * dim * 6 + 2 * t * dim, 0)
    for label, (n, k) in {"q_a_proj 1024x4096": (1024, H), "q_b_proj 32768x1024": (NH * D, 1024),
                          "o_b_proj 4096x8192": (H, 8192), "lm_head 129280x4096": (129280, H)}.items():
        out[f"linear[{label}]"] = ("linear", ex("linear", linear.Variant(n, k, "bfloat16")),
                                   2 * (t * k + n * k + t * n), 2 * t * n * k)
    out["grouped_linear[o_a 8x1024x4096]"] = ("grouped_linear", ex("grouped_linear", linear.Variant(1024, H, "bfloat16",
                                                                                                    groups=8)),
                                               2 * (t * 8 * H + 8 * 1024 * H + t * 8 * 1024), 2 * t * 8 * 1024 * H)
    # the same projections with the checkpoint's FP8 weights (128x128 ue8m0 scales; activations quantized per
    # 1x128 inside the op): bytes are the FP8 codes and scales read, plus the bf16 activations in and out
    from tilekernels.ops import linear_fp8

    for label, (n, k) in {"q_a_proj 1024x4096": (1024, H), "q_b_proj 32768x1024": (NH * D, 1024),
                          "o_b_proj 4096x8192": (H, 8192)}.items():
        v = linear_fp8.Variant(n, k, "bfloat16", (128, 128), ue8m0=True)
        out[f"linear[{label}, FP8]"] = ("linear", ex("linear", v), n * k + n * k // 16384 + 2 * (t * k + t * n),
                                         2 * t * n * k)
    for k in (H, 8192):  # the FP8 projections' activations, quantized per 1x128 (codes and fp32 scales written)
        out[f"act_quant[1x128 of {k}]"] = ("act_quant", ex("act_quant", act_quant.Variant(k, 128, "bfloat16", True)),
                                           t * k * 3 + t * k // 128 * 4, 0)
    for fp4 in (False, True):
        args = ex("moe_experts", moe_experts.Variant(2 * I, H, E, "bfloat16", fp4=fp4))
        if args is None:
            continue
        top_k = args[2].shape[1]
        hit = E if device == "meta" else int(args[2].unique().numel())
        per_value = (0.5 + 1 / 32) if fp4 else 2  # FP4 e2m1 + one ue8m0 byte per 32, or bf16
        out[f"moe_experts[256 x (4096x4096 + 4096x2048), top {top_k}{', FP4' if fp4 else ''}]"] = (
            "moe_experts", args, int(hit * 3 * I * H * per_value) + 4 * t * H, 2 * t * top_k * 3 * I * H)
    return {label: case for label, case in out.items() if case[1] is not None}


def attention_cases(t: int, device: str = "cuda", wanted: set[str] | None = None) -> dict:
    """Attention over the window (128) plus the compressed entries a query sees at 4K and 64K context (the
    op's `example` with that many KV rows per query)."""
    from tilekernels.ops import DECLARED, sparse_attention

    out = {}
    if wanted is not None and "sparse_attention" not in wanted:
        return out
    for ctx, rows in (("4K CSA", 128 + 512), ("4K HCA", 128 + 4096 // 128), ("64K CSA", 128 + 512),
                      ("64K HCA", 128 + 65536 // 128)):
        args = DECLARED["sparse_attention"].example(sparse_attention.Variant(NH, D, "bfloat16"), t, device,
                                                  kv_rows=rows)
        bytes_ = t * rows * D * 2 + 2 * t * NH * D * 2
        out[f"sparse_attention[{ctx}: {rows} rows]"] = ("sparse_attention", args, bytes_, 4 * t * NH * rows * D)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--out", default=None)
    parser.add_argument("--ops", default=None, help="comma-separated op names to run (default: all)")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = parser.parse_args()

    from deepinfer.env import Env
    from tilekernels.kernels import kernel_table
    from tilekernels.ops import DECLARED

    ops = kernel_table("sm90", Env.read().cache_dir)
    wanted = set(args.ops.split(",")) if args.ops else None
    copy_gbs = copy_bandwidth()
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip()
    rows = []
    print(f"# {torch.cuda.get_device_name()} | {datetime.date.today()} | commit {commit or 'unknown'} | "
          f"measured HBM copy {copy_gbs:.0f} GB/s")
    print("| op | tokens | ours ms | torch ms | ours GB/s | of copy BW | ours TFLOP/s | vs torch |")
    print("|---|---|---|---|---|---|---|---|")
    for t in [int(x) for x in args.tokens.split(",")]:
        todo = {**cases(t, wanted=wanted), **attention_cases(t, wanted=wanted)}
        for label, (name, call_args, nbytes, flops) in todo.items():
            if wanted and name not in wanted:
                continue
            ours, mode = time_fn(lambda: getattr(ops, name)(*call_args))
            ref, ref_mode = time_fn(lambda: DECLARED[name].reference(*call_args), iters=10)
            gbs = nbytes / (ours * 1e-3) / 1e9
            tflops = flops / (ours * 1e-3) / 1e12 if flops else 0.0
            row = dict(op=label, tokens=t, ours_ms=ours, torch_ms=ref, ours_gbs=gbs, copy_fraction=gbs / copy_gbs,
                       tflops=tflops, speedup_vs_torch=ref / ours, timing=mode, torch_timing=ref_mode)
            rows.append(row)
            print(f"| {label} | {t} | {ours:.4f} | {ref:.4f}{'*' if ref_mode == 'eager' else ''} | {gbs:.0f} | "
                  f"{gbs / copy_gbs:.0%} | {tflops:.1f} | {ref / ours:.2f}x |", flush=True)
        torch.cuda.empty_cache()
    print("(* torch timed eagerly: its implementation syncs with the host and cannot be graph-captured)")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                                              "commit": commit, "copy_gbs": copy_gbs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
