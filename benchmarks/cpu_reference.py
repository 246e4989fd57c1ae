"""CPU reference path on the embedded tiny model: decode tokens/s (deepinfer vs HF transformers on the same
weights, batch 1, greedy, with cache) and wall time from `deepinfer run offline` start to the first token.

    python benchmarks/cpu_reference.py [--steps 128] [--runs 3]

Prints one Markdown table row per measurement, with the date, commit and machine, for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def deepinfer_decode(steps: int, batch: int) -> float:
    import deepinfer

    llm = deepinfer.LLM()
    params = deepinfer.SamplingParams(temperature=0, max_new_tokens=steps, ignore_eos=True)
    prompts = [{"token_ids": list(range(100 + i, 132 + i))} for i in range(batch)]
    llm.generate(prompts, deepinfer.SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.last_stats
    return stats.decode_tokens / stats.decode_seconds


def hf_decode(steps: int) -> float:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache

    from deepinfer.tiny import TINY_CONFIG, random_tensors, tiny_config

    cfg = tiny_config()
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**{k: v for k, v in TINY_CONFIG.items() if k != "model_type"})).eval()
    state = {("model." + k if not k.startswith("lm_head") else k): v for k, v in random_tensors(cfg).items()}
    hf.load_state_dict(state, strict=True)
    ids = torch.arange(100, 132)[None]
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        token = hf(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            token = hf(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return steps / (time.perf_counter() - start)


def time_to_first_token(runs: int) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_HF_MODEL_DIR"}
    internal, external = [], []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "deepinfer", "run", "offline", "--prompt", "Hello", "--max-new-tokens", "1"],
            capture_output=True, text=True, env=env, cwd=ROOT, check=True,
        )
        external.append(time.perf_counter() - start)
        internal.append(float(re.search(r"first token ([0-9.]+) s after start", proc.stderr).group(1)))
    return statistics.median(internal), statistics.median(external)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    stamp = f"{datetime.date.today()} | {commit()} | {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    ours = deepinfer_decode(args.steps, 1)
    ours8 = deepinfer_decode(args.steps, 8)
    hf = hf_decode(args.steps)
    ttft, wall = time_to_first_token(args.runs)
    print("| measurement | value | reference | ratio | date | commit | machine |")
    print("|---|---|---|---|---|---|---|")
    print(f"| decode, batch 1, tiny default model | {ours:.1f} tok/s | HF transformers {hf:.1f} tok/s | {ours / hf:.2f}x | {stamp} |")
    print(f"| decode, batch 8, tiny default model | {ours8:.1f} tok/s | - | - | {stamp} |")
    print(f"| `deepinfer run offline` start to first token (median of {args.runs}) | {ttft:.2f} s | whole command {wall:.2f} s | - | {stamp} |")


if __name__ == "__main__":
    main()
