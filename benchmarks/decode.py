"""Decode and prefill of a "V4-Flash slice" on the GPU: V4-Flash's real layer shapes (H 4096, 64 heads of
512, 256 experts top-6 of width 2048) in four layers (sliding + hash-MoE, sliding, CSA, HCA), random bf16
weights, through the engine's kernels and decode graphs; in the same run, the same weights under HF
transformers and under the project's own PyTorch reference path on the GPU.

    deepinfer compile --target sm90 --model benchmarks/configs/v4-flash-slice --jobs 16
    python benchmarks/decode.py [--out results.json] [--commit SHA] [--quantized]

With `--quantized` the slice's weights are V4's native formats, quantized on the GPU as they are generated
(FP8 projections with ue8m0 128x128 scales, FP4 experts): the engine runs its FP8 and FP4 kernels, and the
floor counts the bytes those formats read.

Decode contexts are synthetic: each sequence's cache is sized and its token count set to the context, so a
step reads exactly what a step at that context reads (the values are zeros). The floor of a step is the bytes
it must read (the weights it touches: every dense weight, the expected distinct experts for the batch, plus
the KV rows, indexer keys and compressed entries its queries read) divided by the measured HBM bandwidth.

DeepSeek-V4.1 has its own: benchmarks/decode_v41.py (a "V4.1-Flash slice": real widths, one layer of each kind,
FP8 / FP4 weights, eager `DeepseekV41` through the sm90 kernels, the same floors).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SLICE = ROOT / "benchmarks" / "configs" / "v4-flash-slice"


def floor_bytes(cfg, specs, batch: int, context: int, quantization=None) -> int:
    """Bytes a decode step must read; with a `quantization` config, FP8 projections at 1 byte per value and FP4
    experts at 0.5 (plus their scales)."""
    dense, experts, per_seq = floor_parts(cfg, specs, batch, context, quantization)
    return int(dense + experts + batch * per_seq)


def floor_parts(cfg, specs, batch: int, context: int, quantization=None) -> tuple[float, float, float]:
    """`floor_bytes`' parts: (every dense weight, the routed experts `batch` tokens touch, each sequence's cache
    rows and hidden state)."""
    from deepinfer.config import CSA, HCA, SLIDING
    from deepinfer.weights.quant import checkpoint_format

    def per_value(name: str, kind: str) -> float:
        fmt = checkpoint_format(name, quantization)
        if fmt is None:
            return 4 if kind == "fp32" else 2
        block = fmt[1]
        return (0.5 if fmt[0] == "fp4" else 1.0) + (1 if fmt[2] else 4) / (block[0] * block[1])

    dense = sum(torch.Size(s.shape).numel() * per_value(name, s.kind) for name, s in specs.items()
                if ".experts." not in name and name != "embed_tokens.weight" and s.kind != "int")
    e, k, h, i = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    hit = e * (1 - (1 - k / e) ** batch)
    experts = cfg.num_hidden_layers * hit * 3 * h * i * per_value("layers.0.mlp.experts.down_proj", "model")
    d, w = cfg.head_dim, cfg.sliding_window
    kv = 0
    for kind in cfg.layer_types:
        rows = w
        if kind == CSA:
            rows += min(cfg.index_topk, context // cfg.compress_rate_csa)
            kv += context // cfg.compress_rate_csa * cfg.index_head_dim * 2
        elif kind == HCA:
            rows += context // cfg.compress_rate_hca
        assert kind in (SLIDING, CSA, HCA)
        kv += rows * d * 2
    return dense, experts, kv + h * 2


def nbytes(t) -> int:
    from tilekernels.quant import BlockQuantized

    return t.nbytes if isinstance(t, BlockQuantized) else t.numel() * t.element_size()


def prebuild(cfg, invariant: bool) -> None:
    """Build the kernels the slice launches that its compiled manifest may lack (the FP8 / FP4 ones of the quantized
    slice; with `invariant`, the batch-invariant variants too)."""
    import os

    from deepinfer.compile.plan import kernel_plan
    from deepinfer.compile.prebuild import build_kernels
    from deepinfer.env import Env

    items = kernel_plan(cfg, "bfloat16") + (kernel_plan(cfg, "bfloat16", invariant=True) if invariant else [])
    build_kernels("sm90", list(dict.fromkeys(items)), Env.read().cache_dir, jobs=min(16, os.cpu_count() or 1))


def cuda_ms(fn, iters: int, warm_s: float = 1.0, min_calls: int = 3) -> float:
    """Mean milliseconds of `fn` on the GPU over `iters` calls after `warm_s` seconds of calls (at least
    `min_calls`): on the H100 the first point of a quantized run read 2.040 ms after one warm-up call and 1.576
    after three, where the same point read 1.403-1.408 when measured again (BENCHMARKS.md, twelfth round)."""
    begin, calls = time.perf_counter(), 0
    while calls < min_calls or time.perf_counter() - begin < warm_s:
        fn()
        calls += 1
        if calls % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return elapsed_ms(fn, iters, torch.device("cuda"))


def elapsed_ms(fn, iters: int, device: torch.device) -> float:
    """Mean milliseconds of `fn` over `iters` calls: CUDA events on a GPU, the wall clock elsewhere."""
    cuda = device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    if not cuda:
        return (time.perf_counter() - begin) * 1e3 / iters
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth(device: torch.device = torch.device("cuda")) -> float:
    """GB/s of a device-to-device copy (read + write bytes): 4 GiB on a GPU, 16 MiB elsewhere."""
    src = torch.randn(1 << (30 if device.type == "cuda" else 22), device=device)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    copy()
    return 2 * src.numel() * 4 / (elapsed_ms(copy, 20, device) * 1e-3) / 1e9


def synthetic_cache(cfg, batch: int, context: int, dtype, device="cuda"):
    from deepinfer.runtime.cache import CacheSpec, PagedCache

    per_seq = context // 128 + 2
    cache = PagedCache(cfg, CacheSpec(num_blocks=batch * per_seq, max_seqs=batch, max_blocks_per_seq=per_seq), dtype, device)
    seqs = []
    for _ in range(batch):
        s = cache.admit()
        assert cache.grow(s, context + 1)
        s.num_tokens = context
        seqs.append(s)
    return cache, seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--prefill-chunks", default="4096",
                        help="prompt tokens per prefill call (a list: each prefill size is measured at each)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--quantized", action="store_true", help="V4's FP8 / FP4 weight formats (see above)")
    parser.add_argument("--batch-invariant", choices=("off", "on", "both"), default="off",
                        help="the batch-invariant kernels (both: off and on side by side, with the slowdown)")
    parser.add_argument("--overlap", choices=("off", "on", "both"), default="on",
                        help="a decode step's second CUDA stream (backends/nvidia/side_stream.py; both: without it "
                             "first, decode only)")
    parser.add_argument("--hc-fused", choices=("off", "on", "both"), default="on",
                        help="the mHC post-block and the next pre-block's partials in one kernel at decode rows "
                             "(tilekernels/ops/hc_mid.py; off: hc_post, then hc_pre's two kernels; both: off first)")
    args = parser.parse_args()

    from backends.nvidia.side_stream import SideStream
    from deepinfer.config import ModelConfig
    from deepinfer.env import Env
    from deepinfer.model.model import DeepseekV4
    from deepinfer.model.weights import ModelWeights, tensor_specs
    from deepinfer.runtime.graph import DecodeGraphs
    from deepinfer.tiny import random_tensors
    from tilekernels import reference_table
    from tilekernels.kernels import kernel_table
    from tilekernels.ops import hc_mid

    dtype = torch.bfloat16
    cfg = ModelConfig.from_model_dir(SLICE)
    specs = tensor_specs(cfg)
    quantization = None
    if args.quantized:  # each tensor quantized as it is made: the bf16 slice (68 GB) never whole on the GPU
        from deepinfer.weights.synthetic import V4_QUANTIZATION, random_quantized

        quantization = V4_QUANTIZATION
        cfg, tensors = random_quantized(cfg, seed=0, dtype=dtype, device="cuda")
    else:
        tensors = random_tensors(cfg, seed=0, dtype=dtype, device="cuda")
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.batch_invariant]
    if args.quantized or True in modes:
        prebuild(cfg, True in modes)
    if args.quantized:
        args.skip_hf = True  # HF and the reference path would dequantize: their figures are the bf16 run's
    weights = ModelWeights.from_tensors(cfg, tensors)
    bw = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()), "commit": args.commit,
               "copy_gbs": bw, "weights_gb": sum(nbytes(t) for t in tensors.values()) / 1e9,
               "quantized": args.quantized, "decode": [], "prefill": []}
    print(f"# {results['device']} | {results['date']} | commit {args.commit} | copy {bw:.0f} GB/s | "
          f"slice weights {results['weights_gb']:.1f} GB", flush=True)
    overlaps = {"off": (False,), "on": (True,), "both": (False, True)}[args.overlap]
    fusions = {"off": (False,), "on": (True,), "both": (False, True)}[args.hc_fused]
    fused_rows = hc_mid.FUSED_ROWS
    for invariant in modes:
        for overlap in overlaps:
            for fused in fusions:
                hc_mid.FUSED_ROWS = fused_rows if fused else 0  # 0: every call takes hc_post and hc_pre
                model = DeepseekV4(cfg, weights, kernel_table("sm90", Env.read().cache_dir, invariant=invariant),
                                   side=SideStream(torch.device("cuda")) if overlap else None)
                measure(model, cfg, specs, quantization, bw, dtype, args, results, invariant,
                        prefill_too=overlap == overlaps[-1] and fused == fusions[-1], hc_fused=fused)
                del model
    hc_mid.FUSED_ROWS = fused_rows
    if len(modes) == 2:
        print(invariance_cost(results), flush=True)
    if args.quantized or args.batch_invariant != "off":  # the reference path dequantizes per call (quantized)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return
    # the project's PyTorch reference path on the GPU, batch 1 at 4K (eager: its expert loop syncs)
    ref_model = DeepseekV4(cfg, weights, reference_table())
    cache, seqs = synthetic_cache(cfg, 1, 4096, dtype)
    graphs = DecodeGraphs(ref_model, cache, 1, None)
    with torch.inference_mode():
        ref_ms = cuda_ms(lambda: graphs.run([100], [4096], seqs), 5)
    results["reference_path_b1_4k_ms"] = ref_ms
    print(f"own PyTorch reference path, batch 1, 4K: {ref_ms:.2f} ms/step ({1e3 / ref_ms:.1f} tok/s)", flush=True)
    if not args.skip_hf:
        results["hf_b1_4k_ms"] = hf_decode(cfg, tensors)
        print(f"HF transformers, batch 1, 4K: {results['hf_b1_4k_ms']:.2f} ms/step "
              f"({1e3 / results['hf_b1_4k_ms']:.1f} tok/s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def measure(model, cfg, specs, quantization, bw: float, dtype, args, results: dict, invariant: bool,
            prefill_too: bool = True, hc_fused: bool = True) -> None:
    """Decode steps (CUDA graphs) at each context and batch, then (`prefill_too`) prefill at 4K and 16K, into
    `results` (rows tagged with the batch-invariant mode and the decode step's second stream)."""
    from backends.nvidia.graphs import CudaGraphs
    from deepinfer.runtime.graph import DecodeGraphs

    overlap = model.side is not None
    mode = (("batch-invariant" if invariant else "default") + " kernels" + (", two streams" if overlap else ", one stream")
            + ("" if hc_fused else ", mHC post and pre apart"))
    print(f"## {mode}\n| context | batch | step ms | tok/s | floor ms | step / floor |\n|---|---|---|---|---|---|")
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            cache, seqs = synthetic_cache(cfg, batch, context, dtype)
            graphs = DecodeGraphs(model, cache, batch, CudaGraphs())
            ids, pos = list(range(100, 100 + batch)), [context] * batch
            with torch.inference_mode():
                ms = cuda_ms(lambda: graphs.run(ids, pos, seqs), 10)
            floor = floor_bytes(cfg, specs, batch, context, quantization) / (bw * 1e9) * 1e3
            row = dict(context=context, batch=batch, step_ms=ms, tok_s=batch / ms * 1e3, floor_ms=floor,
                       ratio=ms / floor, invariant=invariant, overlap=overlap, hc_fused=hc_fused)
            results["decode"].append(row)
            print(f"| {context} | {batch} | {ms:.3f} | {row['tok_s']:.0f} | {floor:.3f} | {ms / floor:.2f}x |", flush=True)
            cache = graphs = None
            torch.cuda.empty_cache()
    for n in (4096, 16384) if prefill_too else ():
        for chunk in [int(c) for c in args.prefill_chunks.split(",")]:
            if chunk <= n:
                row = prefill(model, cfg, dtype, n, chunk)
                tflops = prefill_flops(cfg, specs, n) / row["seconds"] / 1e12
                print(f"  {tflops:.0f} TFLOP/s of useful FLOPs ({prefill_flops(cfg, specs, n) / n / 1e9:.2f} GFLOP a "
                      f"token), {tflops / PEAK_BF16_TFLOPS:.1%} of the {PEAK_BF16_TFLOPS} TFLOP/s dense bf16 peak",
                      flush=True)
                results["prefill"].append(dict(row, invariant=invariant, useful_tflops=tflops,
                                               of_bf16_peak=tflops / PEAK_BF16_TFLOPS))


PEAK_BF16_TFLOPS = 989  # H100 / H200 SXM, dense bf16 tensor cores


def prefill_flops(cfg, specs, n: int) -> float:
    """Useful FLOPs of prefilling one sequence of `n` tokens from position 0: 2 per weight each token multiplies (every
    layer's matrices with the routed experts at top_k of E; not the embedding; lm_head for the last token only), the
    attention's 4 x rows x heads x head_dim at each position's own causal rows (window; CSA: + its top-k of the closed
    entries; HCA: + every closed entry) and CSA's indexer scores (2 x closed entries x index heads x index dim)."""
    from deepinfer.config import CSA, HCA

    top = cfg.num_experts_per_tok / cfg.n_routed_experts
    per_token = sum(2 * torch.Size(sp.shape).numel() * (top if ".experts." in name else 1)
                    for name, sp in specs.items()
                    if name.startswith("layers.") and len(sp.shape) >= 2 and sp.kind != "int"
                    and "position_bias" not in name)
    seen = torch.arange(1, n + 1, dtype=torch.float64)  # each position's causal length
    window = seen.clamp(max=cfg.sliding_window)
    rows = index = 0.0
    for kind in cfg.layer_types:
        rows += window.sum().item()
        if kind == CSA:
            closed = torch.div(seen, cfg.compress_rate_csa, rounding_mode="floor")
            rows += closed.clamp(max=cfg.index_topk).sum().item()
            index += 2 * closed.sum().item() * cfg.index_n_heads * cfg.index_head_dim
        elif kind == HCA:
            rows += torch.div(seen, cfg.compress_rate_hca, rounding_mode="floor").sum().item()
    attention = 4 * rows * cfg.num_attention_heads * cfg.head_dim
    return n * per_token + attention + index + 2 * specs["lm_head.weight"].shape[0] * cfg.hidden_size


def prefill(model, cfg, dtype, n: int, chunk: int) -> dict:
    """One sequence of `n` random tokens prefilled in calls of `chunk` tokens: the best of two warm runs."""
    from deepinfer.runtime.cache import CacheSpec, PagedCache

    ids = torch.randint(0, cfg.vocab_size, (n,), device="cuda")
    cache = PagedCache(cfg, CacheSpec(num_blocks=n // 128 + 2, max_seqs=1, max_blocks_per_seq=n // 128 + 2),
                       dtype, "cuda")
    seq = cache.admit()
    cache.grow(seq, n)

    def run_prefill():
        seq.num_tokens = 0
        for start in range(0, n, chunk):
            size = min(chunk, n - start)
            model.prefill(cache, ids[start : start + size], torch.arange(start, start + size, device="cuda"),
                          [(seq, 0, size)], torch.tensor([size - 1], device="cuda"))

    times = []
    for _ in range(3):  # the first run loads kernels and warms allocator and caches: the best of the next two
        torch.cuda.synchronize()
        begin = time.perf_counter()
        with torch.inference_mode():
            run_prefill()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    secs = min(times[1:])
    print(f"prefill {n} tokens in chunks of {chunk}: {secs:.3f} s, {n / secs:.0f} tok/s (warm; first run "
          f"{times[0]:.2f} s)", flush=True)
    return dict(tokens=n, chunk=chunk, seconds=secs, tok_s=n / secs, first_run_s=times[0])


def invariance_cost(results: dict) -> str:
    """A markdown table: each decode row and prefill size with the mode off and on, and the slowdown."""
    lines = ["| measure | default | batch-invariant | slowdown |", "|---|---|---|---|"]
    rows: dict = {}
    for r in results["decode"]:
        rows.setdefault((f"decode step ms, context {r['context']}, batch {r['batch']}", "ms"), {})[r["invariant"]] = r["step_ms"]
    for r in results["prefill"]:
        rows.setdefault((f"prefill {r['tokens']} tokens in chunks of {r['chunk']}, tok/s", "tok/s"), {})[r["invariant"]] = r["tok_s"]
    for (name, unit), v in rows.items():
        if len(v) == 2:
            slow = v[True] / v[False] - 1 if unit == "ms" else v[False] / v[True] - 1
            lines.append(f"| {name} | {v[False]:.3f} | {v[True]:.3f} | {100 * slow:+.1f} % |")
    return "\n".join(lines)


def hf_decode(cfg, tensors, context: int = 4096, steps: int = 5) -> float:
    """HF transformers' DeepseekV4ForCausalLM on the same weight storage: prefill `context`, then time decode."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache

    raw = {k: v for k, v in cfg.raw.items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        hf = DeepseekV4ForCausalLM(DeepseekV4Config(**raw))
    state = {("model." + k if not k.startswith("lm_head") else k): v for k, v in tensors.items()}
    hf.load_state_dict(state, strict=True, assign=True)
    hf.eval()
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    for name, module in list(hf.named_modules()):  # non-persistent rotary tables stayed on meta: rebuild them
        if isinstance(module, DeepseekV4RotaryEmbedding):
            parent = hf.get_submodule(name.rsplit(".", 1)[0]) if "." in name else hf
            setattr(parent, name.rsplit(".", 1)[-1], DeepseekV4RotaryEmbedding(hf.config, device="cuda"))
    for name, buf in hf.named_buffers():
        if buf.is_meta:
            raise RuntimeError(f"HF buffer {name} was not materialised")
    ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")
    with torch.no_grad():
        past = DynamicCache(config=hf.config)
        out = hf(ids, past_key_values=past, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        # one warm-up call: every call appends a token to HF's cache (the context grows by the calls made)
        return cuda_ms(lambda: hf(token, past_key_values=past, use_cache=True), steps, warm_s=0.0, min_calls=1)


if __name__ == "__main__":
    main()
