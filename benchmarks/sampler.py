"""The batched sampler's cost per decode step: logits [B, 129,280] fp32 on one device -> B tokens, for the
sampling settings requests use (greedy; temperature + top-p; temperature + top-k + top-p + min-p; penalties
and logit_bias over a 1,024-token history), at several batch sizes. Eager is the stage-skipping path (prefill,
CPU); graph is the decode step's captured sampler (every stage on). The reference point is the decode step it
follows (BENCHMARKS.md: 4.2 ms at batch 1, 12 ms at batch 64 for the V4-Flash slice on the H200), so the figure that matters is the
sampler's share of it.

    python benchmarks/sampler.py [--device cpu|cuda] [--batches 1,8,64] [--out results.json]
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

VOCAB = 129280
HISTORY = 1024
SETTINGS = {
    "greedy": dict(temperature=0),
    "top_p": dict(temperature=0.7, top_p=0.9),
    "top_k_top_p_min_p": dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
    "penalties_bias": dict(temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                           repetition_penalty=1.1, logit_bias={5: 2.0, 77: -100.0}),
}


def measure(device: str, batch: int, setting: str, iters: int, graph: bool = False) -> float:
    from deepinfer.runtime.sampler import Features, History, PenaltyState, SamplerGraphs, pack, select_tokens
    from deepinfer.runtime.sampling import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, VOCAB, generator=gen) * 4).to(device)
    params = [SamplingParams(seed=i, **SETTINGS[setting]) for i in range(batch)]
    histories = [History(torch.randint(0, VOCAB, (HISTORY // 2,), generator=gen).tolist(),
                         torch.randint(0, VOCAB, (HISTORY // 2,), generator=gen).tolist()) for _ in range(batch)]
    seeds, positions, slots = list(range(batch)), [HISTORY] * batch, list(range(batch))
    state = PenaltyState(batch, VOCAB, device)
    owners = [object() for _ in range(batch)]
    index = torch.tensor(slots, device=device)
    graphs = None
    if graph:
        from backends.nvidia.graphs import CudaGraphs

        graphs = SamplerGraphs(state, VOCAB, batch, CudaGraphs())

    def step() -> None:  # as the engine does: the slots' rows (built once), the draw, the new tokens counted
        features = Features.of(params)
        penalized = [h if p.penalized else None for h, p in zip(histories, params)]
        if graphs is not None:
            state.prepare(slots, owners, penalized)
            graphs.run(logits, batch, params, seeds, positions, slots).tolist()  # synchronised
            return
        seen = None
        if features.penalties:
            state.prepare(slots, owners, penalized)
            seen = state.rows(index)
        tokens = select_tokens(logits, pack(params, seeds, positions, VOCAB, device), seen, features)
        if features.penalties:
            state.record(index, tokens)
        tokens.tolist()

    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for setting in SETTINGS:
            iters = args.iters if args.device == "cuda" else 5
            ms = measure(args.device, batch, setting, iters)
            graph_ms = measure(args.device, batch, setting, iters, graph=True) if args.device == "cuda" else None
            rows.append({"batch": batch, "setting": setting, "eager_ms": round(ms, 3),
                         "graph_ms": None if graph_ms is None else round(graph_ms, 3)})
            print(f"batch {batch:3d}  {setting:20s} eager {ms:8.3f} ms" +
                  ("" if graph_ms is None else f"  graph {graph_ms:8.3f} ms"), flush=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"device": name, "date": datetime.date.today().isoformat(), "vocab": VOCAB, "history": HISTORY,
              "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
