"""The whole DeepSeek-V4-Flash on several GPUs: decode and prefill per GPU with the routed experts split over the
ranks (expert parallelism, data-parallel attention; `--tp` for tensor-parallel attention), random weights in
native precision (FP8 dense, FP4 experts: `--bf16` for bf16) made on each GPU, only that rank's experts; and the
expert exchange alone (dispatch: every data-parallel rank's rows gathered; combine: the partial outputs summed over
the ranks) per MoE layer, with the bus bandwidth it reaches.

    python benchmarks/parallel_decode.py --ranks 2 [--tp 1] [--batches 1,8,32,128,256] [--contexts 4096,32768]
        [--prefill 4096,16384] [--out results.json] [--commit SHA]

deepinfer's own launcher starts one process per GPU (`parallel.pool.RankPool`). A rank holds 76.9 GiB of weights
at `--ranks 2` (`benchmarks/memory.py`): H200s; 42.7 GiB at 4. Decode contexts are synthetic as in
`benchmarks/decode.py`: each sequence's cache is sized and its token count set to the context. A step's batch is
per GPU (each data-parallel rank its own sequences); the floor of a step is the bytes one rank must read (every
dense weight, its own experts that the whole step's tokens touch, its sequences' cache rows) over `--copy-gbs` or
the measured copy bandwidth. Every timed call runs the same number of times on every rank (the collectives inside
meet); a row's time is the slowest rank's.

On the CPU (`--backend reference --config <a tiny config.json>`, gloo) it checks itself in CI
(`tests/test_parallel_bench.py`); its GPU figures need a machine with several GPUs (not yet lent: BENCHMARKS.md).
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
PUBLISHED = "the product on SM100 clusters: 86K prefill / 26K decode tokens/s per GPU"


class RankBench:
    """One rank: its share of the model (built in a `RankPool` worker) and the timed calls."""

    def __init__(self, config: str, backend: str, native: bool, dp: int, tp: int, seed: int = 0):
        from deepinfer.assemble import kernel_layout
        from deepinfer.config import ModelConfig
        from deepinfer.env import Env
        from deepinfer.model.weights import ModelWeights
        from deepinfer.parallel.config import ParallelConfig, launched_rank
        from deepinfer.parallel.ranks import join
        from deepinfer.parallel.shard import TP_CUT, expert_placement, rank_model, take_experts
        from deepinfer.runtime.backend import select
        from deepinfer.tiny import iter_random_tensors

        env = Env.read()
        parallel = ParallelConfig(dp, tp, enable_expert_parallel=True)
        self.comm = join(launched_rank(parallel), backend, env)
        self.backend = select(backend, env.cache_dir, env)
        cfg = ModelConfig.from_dict(json.loads(Path(config).read_text()))
        quantization = None
        if native:
            from deepinfer.weights.synthetic import V4_QUANTIZATION, quantize_in_memory, with_quantization

            cfg, quantization = with_quantization(cfg, V4_QUANTIZATION), V4_QUANTIZATION
        placement = expert_placement(cfg, self.comm, None)
        slots = placement.slots_per_rank
        device, self.dtype = self.backend.device, torch.bfloat16
        pairs = iter_random_tensors(cfg, seed, self.dtype, device,  # one seed: tensor-parallel ranks cut the same
                                    rows=lambda name: slots if ".mlp.experts." in name else None)
        pairs = ((n, t) for n, t in pairs if not n.startswith("mtp."))  # speculative decoding runs on one device
        tensors = quantize_in_memory(pairs, quantization) if native else dict(pairs)
        gate_up, down = take_experts(tensors, cfg, placement, self.comm.rank.rank, whole=False)
        layout = kernel_layout(self.backend)
        experts = ([layout(w) for w in gate_up], [layout(w) for w in down])
        weights = ModelWeights.from_tensors(cfg, tensors)
        self.model = rank_model(cfg, weights, self.backend.ops, self.comm, placement, experts, None)
        self.cfg, self.quantization, self.slots = cfg, quantization, slots
        cut = sum(_nbytes(t) for name, t in tensors.items() if any(part in name + "." for part in TP_CUT))
        self.weight_bytes = (sum(_nbytes(t) for t in tensors.values()) + sum(map(_nbytes, gate_up + down))
                             - cut * (1 - 1 / tp))  # the attention's cut tensors: this rank's share

    def describe(self) -> dict:
        from deepinfer.parallel.ranks import describe

        name = torch.cuda.get_device_name() if self.backend.device.type == "cuda" else str(self.backend.device)
        return dict(device=name, layout=describe(self.comm.rank.parallel), layers=self.cfg.num_hidden_layers,
                    slots_per_rank=self.slots, weights_gib=self.weight_bytes / 2**30,
                    native=self.quantization is not None)

    def decode(self, batch: int, context: int, iters: int, copy_gbs: float) -> dict:
        """A decode step of `batch` sequences on each data-parallel rank (its tensor-parallel GPUs share them),
        each `context` deep, replayed (CUDA graphs where the backend captures) `iters` times."""
        from benchmarks.decode import floor_parts, synthetic_cache
        from deepinfer.model.weights import tensor_specs
        from deepinfer.parallel.shard import TP_CUT
        from deepinfer.runtime.graph import DecodeGraphs

        cache, seqs = synthetic_cache(self.cfg, batch, context, self.dtype, self.backend.device)
        self.model.expert_shard.static = True  # every rank brings `batch` rows: no size exchange in the step
        graphs = DecodeGraphs(self.model, cache, batch, self.backend.capture)
        ids, pos = list(range(100, 100 + batch)), [context] * batch
        with torch.inference_mode():
            seconds = self._timed(lambda: graphs.run(ids, pos, seqs), iters)
        self.model.expert_shard.static = False
        cfg, specs, tp = self.cfg, tensor_specs(self.cfg), self.comm.tp
        dense, experts, per_seq = floor_parts(cfg, specs, batch * self.comm.dp, context, self.quantization)
        heads = {n: s for n, s in specs.items() if any(part in n + "." for part in TP_CUT)}  # each rank reads 1/tp
        dense -= floor_parts(cfg, heads, 1, context, self.quantization)[0] * (1 - 1 / tp)
        floor = dense + experts * self.slots / cfg.n_routed_experts + batch * per_seq
        ms, floor_ms = seconds * 1e3, floor / (copy_gbs * 1e9) * 1e3
        return dict(context=context, batch_per_gpu=batch / tp, step_ms=ms, tok_s_per_gpu=batch / seconds / tp,
                    floor_ms=floor_ms, ratio=ms / floor_ms)

    def prefill(self, n: int, iters: int) -> dict:
        """One sequence of `n` tokens prefilled in one call on every rank at once (the expert exchange carries
        every data-parallel rank's n rows)."""
        from benchmarks.decode import synthetic_cache

        cache, seqs = synthetic_cache(self.cfg, 1, n, self.dtype, self.backend.device)
        ids = torch.randint(2, self.cfg.vocab_size, (n,), device=self.backend.device)
        positions = torch.arange(n, device=self.backend.device)
        last = torch.tensor([n - 1], device=self.backend.device)  # the head on the prompt's last row, as the engine

        def once():
            seqs[0].num_tokens = 0  # the same prompt again, from its start
            self.model.prefill(cache, ids, positions, [(seqs[0], 0, n)], last)

        with torch.inference_mode():
            seconds = self._timed(once, iters)
        return dict(tokens=n, seconds=seconds, tok_s_per_gpu=n / seconds / self.comm.tp)

    def exchange(self, rows: int, iters: int) -> dict:
        """One MoE layer's expert exchange for `rows` tokens a data-parallel rank: dispatch (the rows' hidden states
        [rows, H] gathered from every data-parallel rank and concatenated, as the engine runs it; their routing is a
        few bytes more) and combine (the partial outputs [dp x rows, H] summed over every rank), each alone; bus
        bandwidth as NCCL counts it."""
        comm, h, world = self.comm, self.cfg.hidden_size, self.comm.rank.parallel.world
        x = torch.randn(rows, h, dtype=self.dtype, device=self.backend.device)
        y = torch.randn(rows * comm.dp, h, dtype=self.dtype, device=self.backend.device)
        dispatch = self._timed(lambda: comm.dp_gather(x), iters) if comm.dp > 1 else 0.0
        combine = self._timed(lambda: comm.world_sum(y), iters)
        gathered = x.numel() * x.element_size() * comm.dp
        summed = y.numel() * y.element_size()
        return dict(rows=rows, dispatch_us=dispatch * 1e6, combine_us=combine * 1e6,
                    dispatch_bus_gbs=gathered * (comm.dp - 1) / comm.dp / dispatch / 1e9 if dispatch else None,
                    combine_bus_gbs=2 * summed * (world - 1) / world / combine / 1e9)

    def close(self) -> None:  # the worker calls it when the pool closes
        self.comm.close()

    # ---- internals ------------------------------------------------------------------------------------
    def _timed(self, fn, iters: int) -> float:
        """Seconds per call of `fn`: one warm-up call, then `iters` calls, the same count on every rank; the
        slowest rank's time."""
        import torch.distributed as dist

        fn()
        self._sync()
        dist.barrier(group=self.comm.control)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        self._sync()
        t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.comm.control)
        return float(t)

    def _sync(self) -> None:
        if self.backend.device.type == "cuda":
            torch.cuda.synchronize()


def prebuild(config: str, backend: str, native: bool, parallel) -> None:
    """Build, in parallel on this host, the kernels one rank launches (its own plan: `compile.plan_ranks`), before
    the ranks start: otherwise each rank would build them one by one at their first launch."""
    import os

    from deepinfer.compile.plan import kernel_plan
    from deepinfer.compile.prebuild import build_kernels
    from deepinfer.config import ModelConfig
    from deepinfer.env import Env
    from deepinfer.runtime.backend import resolve

    env = Env.read()
    target = resolve(backend, env)
    if not target.kernels:
        return
    cfg = ModelConfig.from_dict(json.loads(Path(config).read_text()))
    if native:
        from deepinfer.weights.synthetic import with_quantization

        cfg = with_quantization(cfg)
    plan = kernel_plan(cfg, "bfloat16", None, False, (parallel, 0))
    failed = [r for r in build_kernels(target.name, plan, env.cache_dir, jobs=min(16, os.cpu_count() or 1))
              if r.status == "failed"]
    if failed:
        raise RuntimeError("kernels failed to build: " + ", ".join(f"{r.label} ({r.path})" for r in failed))


def _nbytes(t) -> int:
    """`decode.nbytes`, 0 for the meta stand-ins of the experts other ranks hold."""
    from benchmarks.decode import nbytes

    return 0 if getattr(t, "is_meta", False) else nbytes(t)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="GPUs (processes): data-parallel x tensor-parallel")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the attention's heads)")
    parser.add_argument("--config", default=str(ROOT / "benchmarks/configs/v4-flash.json"))
    parser.add_argument("--backend", default="nvidia")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights instead of FP8 dense / FP4 experts")
    parser.add_argument("--batches", default="1,8,32,128,256", help="decode sequences per data-parallel rank")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--prefill", default="4096,16384", help="prompt tokens per data-parallel rank, one call each")
    parser.add_argument("--exchange-rows", default="1,8,32,128,256,4096", help="rows a rank brings to the exchange")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--copy-gbs", type=float, default=None, help="HBM bandwidth for the floor (default: measured)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args(argv)
    from deepinfer.errors import ConfigError
    from deepinfer.parallel.config import ParallelConfig
    from deepinfer.parallel.pool import RankPool

    if args.ranks % args.tp:
        raise ConfigError(f"--tp {args.tp} must divide --ranks {args.ranks}")
    dp = args.ranks // args.tp
    copy_gbs = args.copy_gbs
    if copy_gbs is None:
        if not torch.cuda.is_available():
            raise ConfigError("--copy-gbs: no GPU here to measure the copy bandwidth the floor is counted at; give it")
        from benchmarks.decode import copy_bandwidth

        copy_gbs = copy_bandwidth()
        torch.cuda.empty_cache()  # the measurement's buffers: rank 0's GPU is this one
    from benchmarks.parallel_decode import RankBench as build  # by its importable name: the workers unpickle it

    parallel = ParallelConfig(dp, args.tp, enable_expert_parallel=True)
    prebuild(args.config, args.backend, not args.bf16, parallel)
    pool = RankPool(parallel, build,
                    dict(config=args.config, backend=args.backend, native=not args.bf16, dp=dp, tp=args.tp))
    try:
        info = pool.ready[0]
        results = dict(info, date=str(datetime.date.today()), commit=args.commit, copy_gbs=copy_gbs,
                       published=PUBLISHED, decode=[], prefill=[], exchange=[])
        print(f"# {info['device']} x {args.ranks} | {results['date']} | commit {args.commit} | {info['layout']} | "
              f"{info['layers']} layers, {info['slots_per_rank']} expert slots a rank, weights "
              f"{info['weights_gib']:.1f} GiB a rank ({'FP8 / FP4' if info['native'] else 'bf16'}) | floor at "
              f"{copy_gbs:.0f} GB/s", flush=True)
        print("| context | batch per GPU | step ms | tok/s per GPU | floor ms | step / floor |")
        print("|---|---|---|---|---|---|")
        for context in [int(c) for c in args.contexts.split(",")]:
            for batch in [int(b) for b in args.batches.split(",")]:
                row = pool.call("decode", batch, context, args.iters, copy_gbs)
                results["decode"].append(row)
                print(f"| {context} | {row['batch_per_gpu']:g} | {row['step_ms']:.3f} | {row['tok_s_per_gpu']:.0f} | "
                      f"{row['floor_ms']:.3f} | {row['ratio']:.2f}x |", flush=True)
        for n in [int(n) for n in args.prefill.split(",")]:
            row = pool.call("prefill", n, max(1, args.iters // 10))
            results["prefill"].append(row)
            print(f"prefill {n} tokens a data-parallel rank: {row['seconds'] * 1e3:.1f} ms, "
                  f"{row['tok_s_per_gpu']:.0f} tok/s per GPU", flush=True)
        print("| rows a rank | dispatch us | dispatch bus GB/s | combine us | combine bus GB/s |")
        print("|---|---|---|---|---|")
        for rows in [int(r) for r in args.exchange_rows.split(",")]:
            row = pool.call("exchange", rows, args.iters)
            results["exchange"].append(row)
            bus = "-" if row["dispatch_bus_gbs"] is None else f"{row['dispatch_bus_gbs']:.1f}"
            print(f"| {rows} | {row['dispatch_us']:.1f} | {bus} | {row['combine_us']:.1f} | "
                  f"{row['combine_bus_gbs']:.1f} |", flush=True)
        print(f"(per-GPU figures beside {PUBLISHED})")
    finally:
        pool.close()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":  # the rank workers import this module: keep the run under the guard
    main()
