"""Decode and prefill of a "V4.1-Flash slice" on the H200 against the bytes floor (decode) and a FLOP roofline
(prefill). The slice (benchmarks/configs/v41-flash-slice) has V4.1-Flash's real widths (hidden 5120, 64 heads of
512, 384 experts top-6 of 2304, index 32 x 128 top-512, candidate blocks 2048 x 8, window 128, mHC 4 x 20) in seven
layers, one of each kind, in the real model's order: 0 window, 1 window + Engram, 2 ratio-2 kv + index source,
3 ratio-2 reader, 4 ratio-1 kv + index + candidate source, 5 ratio-1 reader + index source, 6 ratio-1 reader. The
Engram table is reduced (engram_vocab_size 200,000, not 16M: 4.8M rows, 1.2 GB FP8, not 384M; a lookup reads the
same 24 rows of 256 per token). No DSpark layers. `--device cpu --tiny`: the same code paths at small widths.

Random weights are made on the device in bf16 and quantized there per tensor to their `checkpoint_format_v41`
(FP8 32x32 ue8m0 projections, FP4 1x32 experts, the Engram table FP8 1x32), the experts 16 at a time straight into
each layer's stacked tensors (50 GB at FP4, never a bf16 copy). Kernels (`kernel_plan`) are built first, then
`DeepseekV41` runs eagerly through `kernel_table("sm90")`. Decode contexts are synthetic (a `V41Cache` sized for the
context, token counts set to it, values zeros: a step reads what a step at that context reads); a step's floor is
the bytes it must read over the measured copy bandwidth (`decode_floor`); a prefill's (one sequence in chunks of
4096: the indexer's PyTorch scores are [chunk, 32, E] fp32) its FLOPs at the H200's peaks (`prefill_floor`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.decode import copy_bandwidth, elapsed_ms  # noqa: E402  (after the path: run as a script too)

SLICE = ROOT / "benchmarks" / "configs" / "v41-flash-slice"
PEAKS = dict(fp8=1979e12, bf16=989e12, fp32=67e12)  # H200 SXM dense FLOP/s: FP8 / bf16 tensor cores, fp32 FMA


def per_value(fmt, kind: str, elt: int = 2) -> float:
    """Stored bytes per logical value: FP4 0.5 / FP8 1 plus a scale (1 byte ue8m0, 4 fp32) per block; plain
    tensors at fp32 or the model dtype's `elt`."""
    if fmt is None:
        return 4 if kind == "fp32" else elt
    return (0.5 if fmt[0] == "fp4" else 1.0) + (1 if fmt[2] else 4) / (fmt[1][0] * fmt[1][1])


def distinct_experts(e: int, k: int, batch: int) -> float:
    """Expected distinct experts hit by `batch` tokens routing to k of e each (uniformly): each expert is missed
    by one token with probability 1 - k/e."""
    return e * (1 - (1 - k / e) ** batch)


def per_query(cfg, layer: int, pos: torch.Tensor):
    """What each query at positions `pos` reads in `layer` (deepinfer/model/v41_attention.py, v41_compress.py):
    (window rows it attends, its own included; latents its sparse attention gathers: the top-k of those visible;
    index keys its indexer scores: every visible key of its key owner, or after the candidate source only those
    in the candidate blocks)."""
    r, win, none = cfg.compress_ratios[layer], torch.clamp(pos + 1, max=cfg.sliding_window), torch.zeros_like(pos)
    if r == 0:
        return win, none, none
    visible = torch.div(pos + 1, r, rounding_mode="floor")  # groups complete once the query's token is in
    keys = none
    if layer in cfg.index_source_layers:
        after = cfg.candidate_source_layer is not None and layer > cfg.candidate_source_layer
        keys = torch.clamp(visible, max=cfg.candidate_topk_blocks * cfg.candidate_block_size) if after else visible
    return win, torch.clamp(visible, max=cfg.index_topk), keys


def decode_floor(cfg, batch: int, context: int, elt: int = 2) -> dict[str, float]:
    """Bytes one decode step (one token per sequence, each `context` positions deep) must read, by part: the
    window rows at `elt` bytes per value (V41Cache keeps them in the model dtype), the latents and index keys at
    their FP4 storage (half a byte per value and a scale byte per group)."""
    from deepinfer.model.v41_cache import INDEX_FP4, LATENT_FP4
    from deepinfer.model.v41_weights import TABLE, tensor_specs
    from deepinfer.weights.v41_formats import checkpoint_format_v41

    specs = tensor_specs(cfg)
    # every dense weight once at its kept size (the LM head, router, norms, mHC included); the embedding: its rows
    dense = sum(math.prod(s.shape) * per_value(checkpoint_format_v41(n, cfg), s.kind, elt) for n, s in specs.items()
                if ".ffn.experts." not in n and s.kind != TABLE and n != "embed.weight")
    w1 = "layers.0.ffn.experts.0.w1.weight"  # an expert: w1, w3 [I, D] and w2 [D, I], FP4 + scales
    expert = 3 * math.prod(specs[w1].shape) * per_value(checkpoint_format_v41(w1, cfg), "")
    experts = cfg.num_hidden_layers * distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch) * expert
    e, engram = cfg.engram, 0.0
    if e is not None:  # per token and Engram layer: (max_ngram - 1) sizes x heads rows of head_dim, FP8 + scales
        table = f"layers.{e.layer_ids[0]}.engram.embed.weight"
        engram = len(e.layer_ids) * (e.max_ngram - 1) * e.n_heads * e.head_dim * per_value(
            checkpoint_format_v41(table, cfg), "")
    window = latents = keys = 0.0
    for layer in range(cfg.num_hidden_layers):
        win, lat, key = (float(x) for x in per_query(cfg, layer, torch.tensor([float(context)])))
        window += (win - 1) * cfg.head_dim * elt  # the ring's earlier rows (the step's own row is computed)
        latents += lat * cfg.head_dim * (0.5 + 1 / LATENT_FP4[0])
        keys += key * cfg.index_head_dim * (0.5 + 1 / INDEX_FP4[0])
    out = dict(dense=dense, experts=experts, tokens=batch * (cfg.hidden_size * elt + engram), window=batch * window,
               index_keys=batch * keys, latents=batch * latents)  # tokens: each one's embedding and Engram rows
    out["total"] = sum(out.values())
    return out


def prefill_floor(cfg, n: int, chunk: int, elt: int = 2) -> dict[str, float]:
    """FLOPs of a prefill of n tokens from position 0 in chunks, their time at the H200's peaks (FP8 and bf16 tensor
    cores; the FP4 experts convert to bf16), and the bytes of every weight read once (n x k picks reach all)."""
    from deepinfer.model.v41_weights import TABLE, tensor_specs
    from deepinfer.weights.v41_formats import checkpoint_format_v41

    specs = tensor_specs(cfg)
    flops = dict.fromkeys(PEAKS, 0.0)
    for name, s in specs.items():  # projections, router, mHC mixes: 2 x rows x weight values
        if len(s.shape) != 2 or ".ffn.experts." in name or s.kind == TABLE or name in ("embed.weight", "head.weight"):
            continue
        rows = n // cfg.compress_ratios[int(name.split(".")[1])] if ".indexer.wk." in name else n  # per latent
        fmt = checkpoint_format_v41(name, cfg)  # FP8: W8A8 on Hopper's FP8 wgmma; fp32: ratio-2 compressor, mHC mixes
        flops[fmt[0] if fmt else s.kind if s.kind == "fp32" else "bf16"] += 2 * rows * math.prod(s.shape)
    flops["bf16"] += 2 * -(-n // chunk) * math.prod(specs["head.weight"].shape)  # each chunk's last row's logits
    w1 = specs["layers.0.ffn.experts.0.w1.weight"]  # k experts per token, 3 matrices of I x D each
    flops["bf16"] += 2 * n * cfg.num_hidden_layers * cfg.num_experts_per_tok * 3 * math.prod(w1.shape)
    pos = torch.arange(n, dtype=torch.float64)
    for layer in range(cfg.num_hidden_layers):
        win, lat, keys = per_query(cfg, layer, pos)
        flops["bf16"] += 2 * cfg.num_attention_heads * 2 * cfg.head_dim * float((win + lat).sum())  # QK^T, PV (K=V)
        flops["bf16"] += 2 * cfg.index_n_heads * cfg.index_head_dim * float(keys.sum())
    weights = sum(math.prod(s.shape) * per_value(checkpoint_format_v41(name, cfg), s.kind, elt)
                  for name, s in specs.items())
    return dict(flops=flops, flop_s=sum(f / PEAKS[k] for k, f in flops.items()), weight_bytes=weights)


def nbytes(obj) -> int:
    """Bytes of every tensor (plain or block-quantized) in a weights / cache object, each counted once."""
    from tilekernels.quant import BlockQuantized

    seen, todo = {}, [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, (torch.Tensor, BlockQuantized)):
            seen[id(x)] = x.nbytes if isinstance(x, BlockQuantized) else x.numel() * x.element_size()
        elif dataclasses.is_dataclass(x):
            todo += [getattr(x, f.name) for f in dataclasses.fields(x)]
        elif isinstance(x, (tuple, list, dict)):
            todo += list(x.values() if isinstance(x, dict) else x)
    return sum(seen.values())


def quantized(w: torch.Tensor, fmt):
    """w in checkpoint format `fmt` (ue8m0 scales as exponent bytes, as the loader keeps them), or w itself."""
    from tilekernels.quant import quantize

    q = w if fmt is None else quantize(w, fmt[0], fmt[1], pow2_scales=fmt[2])
    return q.with_exponent_bytes() if fmt and fmt[2] else q


def make_tensor(name: str, spec, fmt, dtype, device, gen):
    """One tensor, random at a scale that keeps activations finite (projections 1/sqrt(fan-in), norms and mHC
    scales near 1, mHC weights small, router bias 0 so that routing follows the tokens), in format `fmt`."""
    from deepinfer.model.v41_weights import TABLE
    from tilekernels.quant import cat_rows

    shape = spec.shape
    if spec.kind == "fp32":  # norms, mHC, sinks, router bias, Engram gate weights, ratio-2 compressor projections
        t = torch.randn(shape, generator=gen, device=device)
        if ".compressor.w" in name:
            return t.mul_(shape[-1] ** -0.5)
        if name.endswith(("norm.weight", "q_weight", "k_weight", "_scale")):
            return t.mul_(0.1).add_(1)
        return t.mul_(0 if name.endswith("gate.bias") else 0.5 if name.endswith(("sink", "_base")) else 0.02)
    if spec.kind == TABLE:  # an FP8 table: made a million rows at a time
        return cat_rows([quantized(torch.randn(min(1 << 20, shape[0] - s), shape[1], generator=gen, device=device,
                                               dtype=dtype), fmt) for s in range(0, shape[0], 1 << 20)])
    std = 1.0 if name == "embed.weight" else shape[-1] ** -0.5
    return quantized(torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(std), fmt)


def expert_stack(e: int, rows: int, cols: int, fmt, dtype, device, gen, step: int = 16):
    """[e, rows, cols] routed-expert weights in `fmt`, made and quantized `step` experts at a time straight into
    the stacked tensor (no bf16 copy of a layer's experts ever exists)."""
    from tilekernels.quant import BlockQuantized

    parts = None
    for s in range(0, e, step):
        q = quantized(torch.randn(min(step, e - s), rows, cols, generator=gen, device=device, dtype=dtype)
                      .mul_(cols ** -0.5), fmt)
        got = (q,) if fmt is None else (q.values, q.scales)
        if parts is None:
            parts = [torch.empty(e, *t.shape[1:], dtype=t.dtype, device=device) for t in got]
        for out, t in zip(parts, got):
            out[s: s + step] = t
    return parts[0] if fmt is None else BlockQuantized(*parts, q.block, q.format)


def make_weights(cfg, dtype, device, seed: int = 0, log=print):
    """The model's weights, made on `device` in their checkpoint formats (`checkpoint_format_v41`); each layer's
    routed experts handed to `from_tensors` stacked (`ffn.experts.gate_up_proj` [E, 2I, D], `down_proj`)."""
    from deepinfer.model.v41_weights import DOWN, GATE_UP, V41Weights, tensor_specs
    from deepinfer.weights.v41_formats import checkpoint_format_v41

    gen, tensors = torch.Generator(device=device).manual_seed(seed), {}
    log("generating weights on the device ...")
    for name, spec in tensor_specs(cfg).items():
        if ".ffn.experts." not in name:
            tensors[name] = make_tensor(name, spec, checkpoint_format_v41(name, cfg), dtype, device, gen)
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fmt = checkpoint_format_v41("layers.0.ffn.experts.0.w1.weight", cfg)  # the same in every layer
    for n in range(cfg.num_hidden_layers):
        up = tensors[f"layers.{n}.ffn.{GATE_UP}"] = expert_stack(e, 2 * i, d, fmt, dtype, device, gen)  # w1 over w3
        down = tensors[f"layers.{n}.ffn.{DOWN}"] = expert_stack(e, d, i, fmt, dtype, device, gen)
        log(f"  layer {n} ({cfg.layer_kind(n)}): experts {nbytes([up, down]) / 1e9:.1f} GB")
    return V41Weights.from_tensors(cfg, tensors)


def hasher_for(cfg):
    """The Engram hasher with a synthetic class map (token id modulo the class count): the kernel plan's."""
    from deepinfer.compile.plan_v41 import stand_in_hasher

    return stand_in_hasher(cfg)


TINY = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32,
            o_lora_rank=32, o_groups=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            sliding_window=8, index_n_heads=4, index_head_dim=32, index_topk=6, candidate_topk_blocks=3,
            candidate_block_size=4, engram_vocab_size=50, engram_n_heads=2, engram_head_dim=32,
            engram_compressed_vocab_size=175, hc_sinkhorn_iters=3)


def slice_config(tiny: bool = False):
    """The slice's config; `tiny`: the same layer kinds, formats and wiring at small widths (Engram rows
    recounted for its hash primes)."""
    from deepinfer.config_v41 import V41Config

    raw = json.loads((SLICE / "config.json").read_text())
    if tiny:
        text = {**raw["text_config"], **TINY}
        text["rope_scaling"] = {**text["rope_scaling"], "original_max_position_embeddings": 16}
        probe = V41Config.from_dict({**raw, "text_config": text}, "tiny slice")
        text["engram_num_embeddings"] = hasher_for(probe).table_rows
        raw = {**raw, "text_config": text}
    return V41Config.from_dict(raw, "tiny slice" if tiny else str(SLICE / "config.json"))


def timed(fn, device, budget_s: float, most: int) -> tuple[float, int, float]:
    """(mean ms, calls, peak GB allocated on a GPU): a warm-up call (kernels load), a timed one, then as many more
    as fit `budget_s` (`most` in all)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    fn()
    ms = elapsed_ms(fn, 1, device)
    more = min(most, int(budget_s * 1e3 / max(ms, 1e-6))) - 1
    if more > 0:
        ms = (ms + more * elapsed_ms(fn, more, device)) / (more + 1)
    return ms, 1 + max(0, more), torch.cuda.max_memory_allocated(device) / 1e9 if cuda else 0.0


def decode_point(model, batch: int, context: int, bw: float, budget_s: float, gen) -> dict:
    """Steps of `batch` sequences each `context` deep: a synthetic cache (zeros, token counts set; one more slot:
    the graphs' scratch), one one-token chunk per sequence; the counts are reset before every step, so every step
    decodes position `context`. On a GPU also the step replayed from a CUDA graph (`V41DecodeGraphs`), reported
    as `step_ms` (the eager step: `eager_ms`)."""
    from deepinfer.model.v41_compress import Chunk

    cfg, device = model.cfg, model.weights.embed.device
    cache = model.new_cache(batch + 1, context + 1)
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device=device)
    chunks = [Chunk(i, i, 1, context) for i in range(batch)]

    def step():
        cache.num_tokens = [context] * (batch + 1)
        model.forward(cache, ids, chunks)

    ms, iters, peak = timed(step, device, budget_s, 20)
    row = dict(eager_ms=ms)
    if device.type == "cuda":
        from backends.nvidia.graphs import CudaGraphs
        from deepinfer.runtime.v41_graphs import V41DecodeGraphs

        graphs = V41DecodeGraphs(model, cache, batch, batch, CudaGraphs())
        token_ids, at, slots = ids.tolist(), [context] * batch, list(range(batch))
        ms, iters, graph_peak = timed(lambda: graphs.run(token_ids, at, slots), device, budget_s, 50)
        peak = max(peak, graph_peak)
    floor = decode_floor(cfg, batch, context)
    return dict(context=context, batch=batch, step_ms=ms, iters=iters, tok_s=batch / ms * 1e3, floor_bytes=floor,
                floor_ms=floor["total"] / (bw * 1e9) * 1e3, ratio=ms * bw * 1e6 / floor["total"],
                cache_gb=cache.num_bytes() / 1e9, peak_gb=peak, **row)


def prefill_point(model, n: int, chunk: int, bw: float, budget_s: float, gen) -> dict:
    """A prefill of one sequence of n tokens from position 0, in chunks (each chunk's last row's logits)."""
    from deepinfer.model.v41_compress import Chunk

    cfg, device = model.cfg, model.weights.embed.device
    cache = model.new_cache(1, n)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen, device=device)

    def run():
        cache.num_tokens = [0]
        for s in range(0, n, chunk):
            model.forward(cache, ids[s: s + chunk], [Chunk(0, 0, min(chunk, n - s), s)])

    ms, reps, peak = timed(run, device, budget_s, 3)
    floor = prefill_floor(cfg, n, chunk)
    bytes_s = floor["weight_bytes"] / (bw * 1e9)
    return dict(tokens=n, chunk=chunk, seconds=ms / 1e3, reps=reps, tok_s=n / ms * 1e3, floor=floor, peak_gb=peak,
                flop_floor_s=floor["flop_s"], bytes_floor_s=bytes_s, ratio=ms / 1e3 / max(floor["flop_s"], bytes_s))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default, text in (
            ("--out", None, "the results as JSON"), ("--commit", "unknown", "recorded in the results"),
            ("--device", "cuda", "cuda (kernels) or cpu (reference ops)"),
            ("--batches", None, "default 1,8,32,128"), ("--contexts", None, "default 4096,32768"),
            ("--prefill", None, "prefill lengths, default 4096,16384"), ("--prefill-chunk", None, "default 4096"),
            ("--budget", "3", "seconds of timed steps per point")):
        parser.add_argument(flag, default=default, help=text)
    parser.add_argument("--tiny", action="store_true", help="small widths, same layer kinds (a CPU smoke run; "
                        "defaults: batches 1,3, contexts 24,40, prefill 40 in chunks of 16)")
    parser.add_argument("--skip-build", action="store_true", help="no kernel build ahead (JIT on first use)")
    args = parser.parse_args(argv)
    from deepinfer.model.v41 import DeepseekV41
    from deepinfer.model.v41_cache import V41Cache
    from tilekernels import reference_table

    log = functools.partial(print, flush=True)
    device, tiny, dtype, cuda = torch.device(args.device), args.tiny, torch.bfloat16, args.device.startswith("cuda")
    ints = lambda text, default: [int(x) for x in (text or default).split(",") if x]  # noqa: E731
    batches = ints(args.batches, "1,3" if tiny else "1,8,32,128")
    contexts = ints(args.contexts, "24,40" if tiny else "4096,32768")
    prefills, budget = ints(args.prefill, "40" if tiny else "4096,16384"), float(args.budget)
    chunk, cfg = int(args.prefill_chunk or (16 if tiny else 4096)), slice_config(tiny)
    log("# V4.1-Flash slice" + " (tiny)" * tiny + ": " + "; ".join(map(cfg.layer_kind, range(cfg.num_hidden_layers))))
    begin, bw, ops = time.perf_counter(), copy_bandwidth(device), reference_table()
    if cuda:
        from deepinfer.compile.plan import kernel_plan
        from deepinfer.compile.prebuild import build_kernels
        from deepinfer.env import Env
        from tilekernels.kernels import kernel_table

        if not args.skip_build:  # every kernel the slice launches, built in parallel into DEEPINFER_CACHE_DIR
            items = kernel_plan(cfg, "bfloat16", quantized=True)
            failed = [f"{r.label} (log {r.path})" for r in build_kernels("sm90", items, Env.read().cache_dir, jobs=16)
                      if r.status == "failed"]
            log(f"built {len(items)} kernels in {time.perf_counter() - begin:.0f} s; failed: {'; '.join(failed) or 0}")
        ops = kernel_table("sm90", Env.read().cache_dir)
    weights = make_weights(cfg, dtype, device, log=log)
    model = DeepseekV41(cfg, weights, ops, hasher_for(cfg))
    name = torch.cuda.get_device_name(device) if cuda else str(device)
    res = dict(device=name, date=str(datetime.date.today()), commit=args.commit, tiny=tiny, copy_gbs=bw,
               weights_gb=nbytes(weights) / 1e9, setup_s=time.perf_counter() - begin, decode=[], prefill=[], skipped=[])
    log(f"# {name} | {res['date']} | commit {args.commit} | copy {bw:.0f} GB/s | weights {res['weights_gb']:.1f} GB "
        f"| setup {res['setup_s']:.0f} s\n| context | batch | step ms | tok/s | floor ms | step / floor | eager ms | "
        f"cache GB | peak GB |\n|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator(device=device).manual_seed(1)
    for context, batch in [(c, b) for c in contexts for b in batches]:
        need = V41Cache.empty(cfg, batch + 1, context + 1, dtype, "meta").num_bytes()
        if cuda:
            torch.cuda.empty_cache()  # the last point's cache back to the device before asking what is free
        if cuda and need + 6e9 > torch.cuda.mem_get_info(device)[0]:  # 6 GB for the step's activations
            res["skipped"].append(f"decode batch {batch} at {context}: its cache ({need / 1e9:.1f} GB) does not fit")
            log("| " + res["skipped"][-1])
            continue
        with torch.inference_mode():
            row = decode_point(model, batch, context, bw, budget, gen)
        res["decode"].append(row)
        log(f"| {context} | {batch} | {row['step_ms']:.2f} | {row['tok_s']:.0f} | {row['floor_ms']:.3f} | "
            f"{row['ratio']:.1f}x | {row['eager_ms']:.2f} | {row['cache_gb']:.2f} | {row['peak_gb']:.1f} |")
    for n in prefills:
        with torch.inference_mode():
            row = prefill_point(model, n, chunk, bw, 2 * budget, gen)
        res["prefill"].append(row)
        log(f"prefill {n} tokens (chunks of {chunk}): {row['seconds']:.2f} s, {row['tok_s']:.0f} tok/s | FLOP floor "
            f"{row['flop_floor_s'] * 1e3:.1f} ms, bytes floor {row['bytes_floor_s'] * 1e3:.1f} ms | "
            f"{row['ratio']:.1f}x the larger | peak {row['peak_gb']:.0f} GB")
    res["total_s"] = time.perf_counter() - begin
    res["max_memory_allocated_gb"] = max([r["peak_gb"] for r in res["decode"] + res["prefill"]], default=0)
    log(f"done in {res['total_s']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
