"""The kernels one rank of several launches (`kernel_plan(..., ranks=)`): its model, built as a rank builds it
(its attention heads and output groups, its routed-expert slots in an `ExpertShard`), is traced as one process's
model is (`plan.trace`, `plan_v41.trace_v41`) over `TraceComm`, a stand-in for the collectives that keeps their
shapes: a gather repeats the rank's rows once per data-parallel rank, a sum returns its input. What differs from
the whole model's plan: the attention at H/T heads and G/T groups, and the routed experts at the rank's slot
count over every data-parallel rank's rows."""

from __future__ import annotations

import torch

from deepinfer.parallel.config import ParallelConfig, Rank

META = torch.device("meta")


class TraceComm:
    """The collectives of rank 0 of `parallel`, on meta tensors, without a world."""

    def __init__(self, parallel: ParallelConfig):
        self.rank, self.device = Rank(0, 0, parallel), META
        self.dp, self.tp = parallel.data_parallel_size, parallel.tensor_parallel_size

    def tp_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def world_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def dp_sizes(self, n: int) -> list[int]:
        return [n] * self.dp

    def dp_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] * self.dp)


def rank_rows(rows: tuple[int, ...], dp: int) -> tuple[int, ...]:
    """The row counts to trace on a rank: `rows`, and for each, the counts whose gathered dp x n rows fall on both
    sides of it (the experts run every data-parallel rank's rows: their variants change at dp x n)."""
    return tuple(sorted(set(rows) | {max(1, r // dp) for r in rows} | {r // dp + 1 for r in rows}))


def trace_rank(cfg, dtype: str, launcher, rows: tuple[int, ...], quantized: bool | None, parallel: ParallelConfig,
               redundant: int = 0) -> None:
    """Trace rank 0 of `parallel` (every rank launches the same shapes) with `redundant` EPLB slots."""
    from deepinfer.compile.plan import meta_weights, torch_dtype, trace
    from deepinfer.compile.plan_v41 import meta_weights_v41, stand_in_hasher, trace_v41
    from deepinfer.config_v41 import V41Config
    from deepinfer.parallel.experts import EplbConfig, ExpertShard, initial_placement, rows as take, slot_experts
    from deepinfer.parallel.shard import rank_model, rank_model_v41
    from tilekernels.kernels import table

    comm, ops, v41 = TraceComm(parallel), table(launcher), isinstance(cfg, V41Config)
    weights = meta_weights_v41(cfg, torch_dtype(dtype), quantized) if v41 else meta_weights(cfg, torch_dtype(dtype),
                                                                                             quantized)
    eplb = EplbConfig(redundant, 0) if redundant else None
    placement = experts = None
    if parallel.enable_expert_parallel:
        placement = initial_placement(cfg.num_hidden_layers, cfg.n_routed_experts, parallel.world, eplb)
        slots = [torch.tensor(slot_experts(placement, 0, i)) for i in range(cfg.num_hidden_layers)]
        experts = ([take(layer.moe.gate_up, s) for layer, s in zip(weights.layers, slots)],
                   [take(layer.moe.down, s) for layer, s in zip(weights.layers, slots)])
    traced = tuple(rank_rows(rows, parallel.data_parallel_size))
    if v41:
        shard = None if placement is None else ExpertShard(ops, comm, placement, *experts, eplb)
        model = rank_model_v41(cfg, weights, ops, stand_in_hasher(cfg), comm, shard)
        trace_v41(cfg, torch_dtype(dtype), launcher, traced, quantized=quantized, model=model)
    else:
        model = rank_model(cfg, weights, ops, comm, placement, experts, eplb)
        trace(cfg, dtype, launcher, traced, quantized=quantized, model=model)
