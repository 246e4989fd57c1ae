"""One rank's torch.distributed groups and the collectives the model and the engine use.

Groups: the world (the target's backend: NCCL on NVIDIA, HCCL on Ascend, gloo on the CPU), each tensor-parallel
group (the ranks of one data-parallel rank), each data-parallel group (the ranks of one tensor-parallel rank),
and a gloo group on the host for control (which ranks step, results), so that the host's small exchanges never
wait on the device. Every collective has the run's timeout (DEEPINFER_DIST_TIMEOUT): a rank that stops
answering makes the others fail with an error instead of hanging.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.parallel.config import Rank

HOST_COLLECTIVES = "gloo"


class Comm:
    def __init__(self, rank: Rank, collectives: str, device: torch.device, timeout_s: float):
        """Join the world (env:// rendezvous: MASTER_ADDR / MASTER_PORT, as torchrun and deepinfer's own launcher
        set them) and make the groups; every rank makes every group, in the same order."""
        self.rank, self.device = rank, device
        p = rank.parallel
        self.dp, self.tp = p.data_parallel_size, p.tensor_parallel_size
        timeout = datetime.timedelta(seconds=timeout_s)
        self._owner = not dist.is_initialized()
        if self._owner:
            dist.init_process_group(collectives, rank=rank.rank, world_size=p.world, timeout=timeout)
        self.world = dist.group.WORLD
        self.control = self.world if collectives == HOST_COLLECTIVES else dist.new_group(backend=HOST_COLLECTIVES,
                                                                                          timeout=timeout)
        self.tp_group = self.dp_group = None
        for d in range(self.dp):  # tensor-parallel groups: the ranks of data-parallel rank d
            group = dist.new_group([d * self.tp + t for t in range(self.tp)], timeout=timeout)
            if d == rank.dp_rank:
                self.tp_group = group
        for t in range(self.tp):  # data-parallel groups: the ranks of tensor-parallel rank t
            group = dist.new_group([d * self.tp + t for d in range(self.dp)], timeout=timeout)
            if t == rank.tp_rank:
                self.dp_group = group

    @property
    def lockstep(self) -> bool:
        """Whether the ranks' forward passes must meet (data-parallel ranks exchanging tokens for the experts)."""
        return self.dp > 1 and self.rank.parallel.enable_expert_parallel

    # ---- the model's collectives (device tensors) ---------------------------------------------------
    def tp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the tensor-parallel group (in place)."""
        if self.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def world_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over every rank (in place)."""
        dist.all_reduce(x, group=self.world)
        return x

    def dp_sizes(self, n: int) -> list[int]:
        """Every data-parallel rank's `n` (rows it brings to an exchange), in rank order."""
        mine = torch.tensor([n], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(mine) for _ in range(self.dp)]
        dist.all_gather(sizes, mine, group=self.dp_group)
        return [int(s) for s in sizes]

    def dp_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's `x` (the same shape on each) stacked in rank order along dim 0."""
        parts = [torch.empty_like(x) for _ in range(self.dp)]
        dist.all_gather(parts, x.contiguous(), group=self.dp_group)
        return torch.cat(parts, dim=0)

    # ---- the engine's collectives (host) ----------------------------------------------------------
    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank."""
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())

    def agree(self, active: bool, prefill: bool, rows: int) -> tuple[bool, bool, int]:
        """Before a forward: (does any rank step, does any rank prefill, the most decode rows of a rank)."""
        t = torch.tensor([int(active), int(prefill), rows], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t[0]), bool(t[1]), int(t[2])

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        out: list[Any] = [None] * self.rank.parallel.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def close(self) -> None:
        """Leave the world (when this object joined it)."""
        if self._owner and dist.is_initialized():
            dist.destroy_process_group()
            self._owner = False
