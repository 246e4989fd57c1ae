"""The host side of decoding, with and without asynchronous scheduling: the engine's mean decode-step time
(wall clock per decode step, `RunStats.decode_seconds / decode_steps`: forward, sampling, appending,
detokenizing, stop checks and grammar masks) for the V4-Flash slice (benchmarks/decode.py's model, random
weights, CUDA graphs) at batch 1, 8 and 64, free text and JSON-schema constrained (xgrammar masks filled on the
CPU), `async_scheduling` on and off; beside it the bare graph replay of the same step (the device's own time).

    python benchmarks/async_steps.py [--batches 1,8,64] [--new-tokens 64] [--out results.json]

The engine runs through the public API (`LLM.generate`): an LLM on the embedded tiny model gives the tokenizer,
grammars and request handling; its engine is replaced by one over the slice model.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "colour": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "colour", "tags"], "additionalProperties": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import decode as bench
    import deepinfer
    from deepinfer.config import ModelConfig
    from deepinfer.model.model import DeepseekV4
    from deepinfer.model.weights import ModelWeights
    from deepinfer.runtime.cache import CacheSpec, PagedCache
    from deepinfer.runtime.engine import Engine
    from deepinfer.runtime.graph import DecodeGraphs
    from deepinfer.runtime.sampling import SamplingParams
    from deepinfer.runtime.scheduler import SchedulerConfig
    from deepinfer.runtime.steps import V4Steps
    from deepinfer.tiny import random_tensors

    batches = [int(b) for b in args.batches.split(",")]
    top = max(batches)
    started = time.perf_counter()

    def progress(what: str) -> None:  # where a slow run spends its time (stderr, as it goes)
        print(f"async_steps: {what} at {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    llm = deepinfer.LLM(backend="nvidia", max_num_seqs=top)
    progress("the tiny LLM built")
    cfg = ModelConfig.from_model_dir(bench.SLICE)
    model = DeepseekV4(cfg, ModelWeights.from_tensors(cfg, random_tensors(cfg, seed=0, dtype=torch.bfloat16,
                                                                          device="cuda")), llm.backend.ops)
    per_seq = -(-(args.prompt_tokens + args.new_tokens + 1) // 128)
    cache = PagedCache(cfg, CacheSpec(num_blocks=top * per_seq, max_seqs=top, max_blocks_per_seq=per_seq),
                       torch.bfloat16, "cuda")
    steps = V4Steps(model, cache, DecodeGraphs(model, cache, top, llm.backend.capture))
    engines = {flag: Engine(steps, cache, SchedulerConfig(top, 2048, flag), llm.grammars) for flag in (True, False)}
    progress("the slice's weights made")
    for engine in engines.values():
        engine.capture_all()
    progress("every decode bucket captured, both engines")
    llm.cache = cache
    gen = torch.Generator().manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()), "commit": args.commit,
               "new_tokens": args.new_tokens, "rows": []}
    print(f"# {results['device']} | {results['date']} | commit {args.commit} | V4-Flash slice, "
          f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens")
    print("| batch | output | graph replay ms | step ms, async | step ms, no async | async gain | masks ms/step |")
    print("|---|---|---|---|---|---|---|")
    for batch in batches:
        prompts = [{"token_ids": torch.randint(2, 1000, (args.prompt_tokens,), generator=gen).tolist()}
                   for _ in range(batch)]
        ids, pos = list(range(100, 100 + batch)), [args.prompt_tokens] * batch
        seqs = [cache.admit() for _ in range(batch)]
        for s in seqs:
            cache.grow(s, args.prompt_tokens + 1)
        with torch.inference_mode():
            replay = bench.cuda_ms(lambda: steps.graphs.run(ids, pos, seqs), 20)
        for s in seqs:
            cache.release(s)
        for label, so in (("free", None), ("json schema", {"json_schema": SCHEMA})):
            items = [dict(p, **({"so_args": so} if so else {})) for p in prompts]
            params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=args.new_tokens, ignore_eos=so is None)
                      for i in range(batch)]
            row = {"batch": batch, "output": label, "replay_ms": replay}
            for flag, engine in engines.items():
                llm.engine = engine
                llm.generate(items, params, use_tqdm=False)  # warm-up: grammars compiled, buckets touched
                progress(f"batch {batch} {label} async={flag}: warm-up generated")
                llm.generate(items, params, use_tqdm=False)
                progress(f"batch {batch} {label} async={flag}: measured")
                st = llm.last_stats
                key = "async" if flag else "sync"
                row[f"{key}_step_ms"] = 1e3 * st.decode_seconds / max(st.decode_steps, 1)
                row[f"{key}_mask_ms"] = 1e3 * st.mask_seconds / max(st.decode_steps, 1)
                row[f"{key}_steps"] = st.decode_steps
                row[f"{key}_ahead_steps"] = st.ahead_steps
                row[f"{key}_dropped_rows"] = st.dropped_rows
            results["rows"].append(row)
            print(f"| {batch} | {label} | {replay:.3f} | {row['async_step_ms']:.3f} | {row['sync_step_ms']:.3f} | "
                  f"{row['sync_step_ms'] / row['async_step_ms']:.2f}x | {row['async_mask_ms']:.3f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
