"""DeepSeek-V4.1's Engram tables split by rows over the ranks that run every token together.

The two tables of V4.1-Flash are 384M rows each, 188.8 GiB as loaded: whole on every rank, a rank of eight holds
more than an H200 (`benchmarks/memory.py`). Split, part p of P holds rows [p C, p C + C) of each table (C = ceil(rows
/ P); the last part may hold fewer) and reads only those from the checkpoint.

Which ranks split them: the ones whose forward passes already meet. Under expert parallelism with several data-
parallel ranks (lockstep) that is every rank: each forward, the data-parallel ranks' n-gram row ids are gathered
(padded to the largest rank's count, as the experts' exchange does), each rank looks up the rows it holds (zero
for the others), the rows are summed over every rank and each rank keeps its own. Otherwise the tensor-parallel
group (its ranks run the same tokens): each looks up its rows and the group sums them. A layout with neither (one
rank, or data-parallel ranks that do not meet) keeps the tables whole. Each looked-up row comes from exactly one
rank, so the sum is exact: the same rows as one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.parallel.config import Rank
from deepinfer.parallel.experts import gather_rows


@dataclass(frozen=True)
class TableSplit:
    parts: int  # ranks sharing the tables
    part: int  # this rank's part
    world: bool  # the parts are every rank (data-parallel ranks' rows gathered), else the tensor-parallel group

    def rows(self, total: int) -> tuple[int, int]:
        """(first row, row count) of this part of a table of `total` rows."""
        per = -(-total // self.parts)
        first = min(total, self.part * per)
        return first, min(total, first + per) - first


def table_split(cfg, rank: Rank) -> TableSplit | None:
    """How `rank` splits `cfg`'s Engram tables (a V41Config; None: whole on this rank)."""
    if cfg.engram is None:
        return None
    p = rank.parallel
    if p.data_parallel_size > 1 and p.enable_expert_parallel:  # every rank's forward meets the others' (lockstep)
        return TableSplit(p.world, rank.rank, True)
    if p.tensor_parallel_size > 1:
        return TableSplit(p.tensor_parallel_size, rank.tp_rank, False)
    return None


class EngramShard:
    def __init__(self, comm, split: TableSplit, firsts: list[int], counts: list[int]):
        """`firsts` / `counts`: this rank's rows of each Engram layer's table (in `cfg.engram.layer_ids` order)."""
        self.comm, self.split, self.firsts, self.counts = comm, split, firsts, counts

    def __call__(self, lookup, rows: torch.Tensor, tables: list, dtype: torch.dtype) -> torch.Tensor:
        """Every Engram layer's looked-up rows for this rank's tokens: rows [n, layers, C] (global row ids of each
        layer's table), `lookup(ids [m, C], table, dtype) -> [m, C * d]` (the op) -> [n, layers, C * d]. A rank
        with no tokens (n = 0) still looks up its rows for the others'."""
        comm, n, start = self.comm, rows.shape[0], 0
        if self.split.world:
            start, (rows,) = gather_rows(comm, n, (rows,))
        (m, layers, c), width = rows.shape, tables[0].shape[-1]
        out = torch.zeros((m, layers, c * width), dtype=dtype, device=rows.device)  # what this rank's rows add
        for k, table in enumerate(tables):
            local = rows[:, k] - self.firsts[k]
            mine = (local >= 0) & (local < self.counts[k])
            if m == 0 or self.counts[k] == 0:  # nothing to look up here (a kernel takes no empty grid or table)
                continue
            got = lookup(torch.where(mine, local, torch.zeros_like(local)), table, dtype).view(m, c, width)
            out[:, k] = torch.where(mine.unsqueeze(-1), got, 0).view(m, c * width)  # where: a NaN row stays out
            del got
        out = comm.world_sum(out) if self.split.world else comm.tp_sum(out)
        return out[start:start + n]


def exchange_bytes(cfg, split: TableSplit | None, dp: int, tokens: int) -> int:
    """Device bytes the exchange holds at once for a forward of `tokens` rows a rank (`dp` data-parallel ranks):
    every Engram layer's summed rows of every data-parallel rank (the world split) and one layer's lookup (bf16);
    the fit check keeps them free beside the activations."""
    if split is None:
        return 0
    e = cfg.engram
    rows = (dp if split.world else 1) * tokens
    return rows * (e.max_ngram - 1) * e.n_heads * e.head_dim * (len(e.layer_ids) + 1) * 2
