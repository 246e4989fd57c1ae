"""Overhead of constrained decoding per step: filling the token bitmask of a whole batch (xgrammar, on the CPU)
and applying it to the logits [B, 129,280] (on the logits' device), as the engine does before sampling.

    python benchmarks/structured.py [--device cpu|cuda] [--batches 1,8,64] [--decode-step] [--out results.json]

Every row follows a JSON Schema (an object with strings, integers, an enum and an array); its matcher advances
by the argmax of its masked random logits each step and restarts when the schema is complete, so the steps
cover the whole grammar. With `--decode-step` (CUDA), the same run times the decode step of the V4-Flash slice
(benchmarks/decode.py, 4K context, CUDA graph) plus the greedy pick at each batch size, without and with the
masks (the CPU fill overlaps the GPU step, as in the engine), and reports the difference as the overhead.
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

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "colour": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "colour", "tags"], "additionalProperties": False}
# The same with a length-bounded string: xgrammar 0.2.8 checks most of the vocabulary at run time inside a
# {m,n}-bounded string (about 5 ms per row per step), so this is its worst common case.
BOUNDED = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string", "maxLength": 12}}}
SCHEMAS = {"plain": SCHEMA, "maxLength": BOUNDED}


def _setup(schema: str, batch: int):
    from deepinfer.serving.recipe import Recipe, default_tokenizer_path
    from deepinfer.serving.structured import Grammars, from_so_args
    from deepinfer.tiny import tiny_config

    cfg = tiny_config()
    recipe = Recipe(default_tokenizer_path())
    grammars = Grammars(recipe.path, cfg.vocab_size, cfg.eos_token_ids, recipe.is_v41, recipe.special_token_id("</think>"))
    constraint = from_so_args({"json_schema": SCHEMAS[schema]})
    begin = time.perf_counter()
    grammars.compile(constraint)
    compile_s = time.perf_counter() - begin
    return cfg, grammars, [grammars.start(constraint, False, None) for _ in range(batch)], compile_s


def _advance(states, tokens: list[int], eos: tuple[int, ...]) -> None:
    for s, t in zip(states, tokens):
        if t in eos or s.matcher.is_terminated():
            s.matcher.reset()
        else:
            s.accept(t, None)


def mask_step_ms(schema: str, batch: int, device: str, steps: int) -> dict[str, float]:
    """Bitmask fill + application on random logits, alone (the argmax that moves the grammar is not timed)."""
    from deepinfer.serving.structured import apply_masks

    cfg, grammars, states, compile_s = _setup(schema, batch)
    gen = torch.Generator(device=device).manual_seed(0)
    times = []
    for step in range(steps + 5):
        logits = torch.randn(batch, cfg.vocab_size, device=device, generator=gen)
        if device == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        apply_masks(logits, states, grammars)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= 5:  # warm-up steps first
            times.append(time.perf_counter() - begin)
        _advance(states, logits.argmax(-1).tolist(), cfg.eos_token_ids)
    times.sort()
    return {"schema": schema, "batch": batch, "mask_ms": 1e3 * sum(times) / len(times),
            "p50_ms": 1e3 * times[len(times) // 2], "compile_s": compile_s}


def decode_steps_ms(schema: str, batch: int, steps: int) -> tuple[float, float]:
    """The V4-Flash slice's decode step at 4K context (CUDA graph, as benchmarks/decode.py runs it) followed by
    the greedy pick, without and with the masks: the fill runs on the CPU while the graph runs on the GPU."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import decode as bench
    from backends.nvidia.graphs import CudaGraphs
    from deepinfer.runtime.graph import DecodeGraphs
    from deepinfer.serving.structured import apply_masks

    model = _slice_model()
    cfg, grammars, states, _ = _setup(schema, batch)
    cache, seqs = bench.synthetic_cache(model.cfg, batch, 4096, torch.bfloat16)
    graphs = DecodeGraphs(model, cache, batch, CudaGraphs())
    ids, pos = list(range(100, 100 + batch)), [4096] * batch
    result = []
    with torch.inference_mode():
        for masked in (False, True):
            times = []
            for step in range(steps + 3):
                begin = time.perf_counter()
                logits = graphs.run(ids, pos, seqs)
                if masked:
                    apply_masks(logits, states, grammars)
                tokens = logits.argmax(-1).tolist()
                if step >= 3:
                    times.append(time.perf_counter() - begin)
                if masked:
                    _advance(states, tokens, cfg.eos_token_ids)
            result.append(1e3 * sum(times) / len(times))
    del cache, graphs
    torch.cuda.empty_cache()
    return result[0], result[1]


def _slice_model():
    global _MODEL
    if "_MODEL" not in globals():
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import decode as bench
        from deepinfer.config import ModelConfig
        from deepinfer.env import Env
        from deepinfer.model.model import DeepseekV4
        from deepinfer.model.weights import ModelWeights
        from deepinfer.tiny import random_tensors
        from tilekernels.kernels import kernel_table

        cfg = ModelConfig.from_model_dir(bench.SLICE)
        weights = ModelWeights.from_tensors(cfg, random_tensors(cfg, seed=0, dtype=torch.bfloat16, device="cuda"))
        _MODEL = DeepseekV4(cfg, weights, kernel_table("sm90", Env.read().cache_dir))
    return _MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--decode-step", action="store_true", help="also time the V4-Flash slice decode step (CUDA)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# {name} | {datetime.date.today()} | commit {args.commit} | vocab 129,280, JSON Schema rows")
    print("| schema | batch | mask ms / step (mean) | p50 | step ms, free | step ms, masked | overhead |\n"
          "|---|---|---|---|---|---|---|")
    rows = []
    for schema in SCHEMAS:
        for batch in [int(b) for b in args.batches.split(",")]:
            row = mask_step_ms(schema, batch, args.device, args.steps)
            step = "- | - | -"
            if args.decode_step:
                row["step_free_ms"], row["step_masked_ms"] = decode_steps_ms(schema, batch, args.steps)
                row["overhead"] = row["step_masked_ms"] / row["step_free_ms"] - 1
                step = f"{row['step_free_ms']:.3f} | {row['step_masked_ms']:.3f} | {100 * row['overhead']:+.1f}%"
            rows.append(row)
            print(f"| {schema} | {batch} | {row['mask_ms']:.3f} | {row['p50_ms']:.3f} | {step} |", flush=True)
    print(f"grammar compile (once per schema, cached): {rows[0]['compile_s']:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": name, "date": str(datetime.date.today()),
                                              "commit": args.commit, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
